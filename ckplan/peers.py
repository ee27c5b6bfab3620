"""Peers: the checkpointing users would pick instead of ckplan, run inside ckplan's bench.

``hf``          per-layer checkpointing as Hugging Face's ``gradient_checkpointing_enable`` does
                (every chain layer in its own non-reentrant checkpoint); run as ckplan's
                every-k k=1 plan, which is exactly that, so its prediction is every-k k=1's.
``sac-policy``  PyTorch selective activation checkpointing on every chain layer: one
                ``checkpoint(layer, use_reentrant=False, context_fn=...)`` per layer whose policy
                saves the outputs of compute-heavy ops (matmuls, attention kernels,
                convolution; ``MUST_SAVE``) and recomputes the rest (``PREFER_RECOMPUTE``):
                ckplan's ``sac-compute`` option (:mod:`ckplan.sac`) on every layer, so the
                ``selective`` strategy with that policy predicts it.
``offload-all`` every tensor the chain layers save for backward offloaded to pinned host memory
                on a side stream and copied back when the backward needs it, as torchtune's
                ``OffloadActivations`` does (:mod:`ckplan.execute.offload`; CUDA only): no recompute.
``offload-attn`` Megatron-style fine-grained offload (``--offload-modules core_attn attn_proj``):
                what each chain layer's attention block saves (q, k, v, the attention core's outputs,
                the output projection's input; not the block's own input) offloaded as above, in
                every chain layer but the last, whose backward comes first (:func:`attention_blocks`).
``torch-compile``           the whole model compiled with ``torch.compile`` (TorchInductor), with
                ``torch._functorch.config.activation_memory_budget`` set to the share of the
                no-checkpoint activation memory that ckplan's budget leaves (:func:`budget_fraction`),
                so AOTAutograd's min-cut partitioner recomputes to meet it.
``torch-compile-nobudget``  the same with budget 1.0: the partitioner's default (fusion, and the
                recomputation of cheap pointwise ops it always does), so fusion and recomputation
                are told apart.

Each compiled row runs a copy of the model (``copy.deepcopy`` before any plan is applied) that
shares the original's parameters and buffers, so it trains the same weights with the same
optimizer; each copy has its own backend function, and Dynamo's cache guards on the backend,
so the two budgets never share a compiled graph (:class:`CompiledPeer`).
"""
from __future__ import annotations

import contextlib
import copy
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from .chainfind import resolve_chain
from .errors import UsageError, first_line
from .execute.offload import layers_offloaded
from .forwards import forwards_replaced
from .sac import COMPUTE_OPS as SAC_SAVE_OPS  # noqa: F401  (re-exported)
from .sac import SAC_KWARGS, policy_fn

PEER_NAMES: tuple[str, ...] = ("hf", "sac-policy", "offload-all", "offload-attn")


def _sac_context():
    # torch's documented policy as a user writes it: without ckplan's KeepLaterRandom
    return create_selective_checkpoint_contexts(policy_fn("sac-compute", rng_safe=False))


class _SacForward:
    """A chain layer's forward run under one selective checkpoint (no-op outside grad mode)."""

    def __init__(self, fwd):
        self.fwd = fwd

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fwd(*args, **kwargs)
        return checkpoint(self.fwd, *args, use_reentrant=False, context_fn=_sac_context, **SAC_KWARGS, **kwargs)


def sac_policy(model: nn.Module, chain: str | None = None):
    """Wrap every chain layer's forward in a selective checkpoint until the block ends."""
    _, container, _ = resolve_chain(model, chain)
    return forwards_replaced(list(container), lambda _i, fwd: _SacForward(fwd))


def offload_all(model: nn.Module, chain: str | None = None):
    """Offload what every chain layer saves to pinned host memory (CUDA) until the block ends."""
    _, container, _ = resolve_chain(model, chain)
    return layers_offloaded(list(container))


def attention_blocks(layer: nn.Module) -> list[nn.Module]:
    """The attention blocks of a chain layer: its outermost submodules whose class name ends in
    ``Attention`` (Hugging Face's ``LlamaAttention``, ``BertAttention``; ckplan's zoo), or whose
    own name is ``attn``/``attention``/``self_attn``."""
    found: list[nn.Module] = []
    def visit(m: nn.Module) -> None:
        for name, child in m.named_children():
            if type(child).__name__.endswith("Attention") or name in ("attn", "attention", "self_attn"):
                found.append(child)
            else:
                visit(child)
    visit(layer)
    return found


def offload_attention(model: nn.Module, chain: str | None = None, hooks: list | None = None):
    """Offload what the attention blocks of every chain layer but the last save, each block's input
    kept on the device, until the block ends (CUDA; Megatron's fine-grained activation offloading)."""
    _, container, _ = resolve_chain(model, chain)
    layers = list(container)[:-1]
    blocks = [b for layer in layers for b in attention_blocks(layer)]
    if layers and not blocks:
        raise UsageError(f"offload-attn found no attention block in chain layer {type(layers[0]).__name__}: it "
                         "offloads submodules whose class name ends in Attention (or named attn, attention, self_attn)",
                         tip="drop offload-attn from --compare, or compare offload-all")
    return layers_offloaded(blocks, keep_inputs=True, hooks=hooks)


COMPILE_PEERS: tuple[str, ...] = ("torch-compile", "torch-compile-nobudget")
UNAVAILABLE = "unavailable"
_CXX = ("g++", "c++", "clang++", "gcc", "cc")


def budget_fraction(budget_bytes: int | None, persistent_bytes: int, none_peak_bytes: int) -> float:
    """``torch._functorch.config.activation_memory_budget`` for ckplan's budget: the share of the
    no-checkpoint activation memory the budget leaves, ``(budget - persistent) / (none peak -
    persistent)`` clipped to [0, 1]; no budget (or no activations) is 1.0 (save everything)."""
    span = none_peak_bytes - persistent_bytes
    if budget_bytes is None or span <= 0:
        return 1.0
    return min(1.0, max(0.0, (budget_bytes - persistent_bytes) / span))


def compile_unavailable(device_type: str) -> str:
    """Why the torch-compile peers cannot run here ('' when nothing is known to stop them)."""
    try:
        import torch._functorch.config as functorch_config
        import torch._inductor.compile_fx
    except Exception as e:  # an inductor that cannot import cannot compile either
        return f"TorchInductor does not import ({type(e).__name__}: {first_line(str(e))[:160]})"
    if not hasattr(functorch_config, "activation_memory_budget"):
        return (f"torch {torch.__version__} has no torch._functorch.config.activation_memory_budget "
                "(added in torch 2.4): the partitioner cannot be given a budget")
    if device_type == "cpu":
        import shutil
        if not any(shutil.which(c) for c in _CXX):
            return ("no C++ compiler on PATH (looked for " + ", ".join(_CXX) + "): TorchInductor compiles "
                    "C++ for CPU; install one (apt-get install g++) to run this row")
    elif device_type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return "Triton is not installed: TorchInductor generates Triton kernels for CUDA (pip install triton)"
    else:
        return f"TorchInductor does not compile for device {device_type!r} here"
    return ""


def shared_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are the original's own tensors: the
    same weights, updated by the same optimizer, but separate module objects to compile."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


class CompiledPeer:
    """One torch-compile row: ``module`` is ``torch.compile`` of a :func:`shared_copy` of the model,
    with a backend of its own (TorchInductor's ``compile_fx``) that runs with the partitioner's
    ``activation_memory_budget`` set to ``fraction``: AOTAutograd partitions the joint
    forward+backward graph when the forward compiles, and the bench also holds the setting around
    the whole first forward+backward (:meth:`compiling`), so a lazily compiled backward sees it too.
    ``graphs`` counts the graphs compiled, so the bench can see that something compiled at all, and
    any recompilation after the warm-up. ``prepare``, when given, changes the copy before it is
    compiled (:class:`ckplan.whole_compile.CompiledModel` installs a plan's regions)."""

    def __init__(self, model: nn.Module, fraction: float, prepare=None):
        self.fraction = fraction
        self.graphs = 0
        copy = shared_copy(model)
        if prepare is not None:
            prepare(copy)
        self.module = torch.compile(copy, backend=self._backend)

    @contextlib.contextmanager
    def compiling(self):
        """The partitioner's budget set to this row's ``fraction``, and TorchInductor's random
        ops left to eager's generator (``fallback_random``): without it compiled dropout draws
        other masks than eager, and the gradient check against ``none`` fails on any model with
        dropout (BERT-large: loss 10.5244 vs 10.4978; with it, equal)."""
        import torch._functorch.config as functorch_config
        with functorch_config.patch(activation_memory_budget=self.fraction), eager_random_ops(), copies_compile():
            yield

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        self.graphs += 1
        with self.compiling():
            return compile_fx(gm, example_inputs)


COPIES = 64  # compiled copies of one model (one forward code object) a process may hold


def copies_compile():
    """Dynamo's per-code recompile limit raised to :data:`COPIES`: every compiled copy of a model
    is another cache entry of the same ``forward``, and past the default (8) Dynamo runs the next
    copy eagerly without a word (a whole-model bench compiles a copy per uniform step, per plan and
    per peer)."""
    import torch._dynamo.config as dynamo_config
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    return dynamo_config.patch(**{name: max(COPIES, getattr(dynamo_config, name))})


def eager_random_ops():
    """TorchInductor settings under which compiled code draws random numbers as eager does
    (``fallback_random``) and never recomputes them in the backward (:func:`save_random_ops`)."""
    import torch._inductor.config as inductor_config
    return inductor_config.patch(fallback_random=True, joint_custom_pre_pass=save_random_ops)


def save_random_ops(graph) -> None:
    """A joint-graph pass for TorchInductor: random ops' outputs are saved for the backward, never
    recomputed there. With ``fallback_random`` they draw from eager's generator, which nothing
    replays in the backward on CPU; under an ``activation_memory_budget`` the min-cut partitioner
    would recompute them (a 6-layer GPT with dropout 0.1 at budget 0.5: a new dropout mask in the
    backward, gradients off by 0.065). ``MUST_SAVE`` keeps them out of the budget's choice."""
    import operator

    from torch.utils.checkpoint import CheckpointPolicy
    for node in graph.nodes:
        tags = getattr(node.target, "tags", ())
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            # A tuple-valued op (native_dropout): its items too, over a SAC policy's tag that
            # would have them recomputed from an op that may not be (a compiled selective option).
            for user in node.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face model that supports its own activation checkpointing."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable"))


@contextmanager
def hf_checkpointing(model: nn.Module):
    """The model's own ``activation_checkpointing_enable`` (transformers >= 5; older:
    ``gradient_checkpointing_enable``) with ``use_reentrant=False``; disabled on exit.

    Enabling also hooks the input embeddings so that their output requires grad (for frozen
    embeddings: LoRA, PEFT), and disabling leaves that hook: it is removed on exit unless the
    model had one before, so the rows measured after this one run the model as it was."""
    had_hook = _input_grad_hooked(model)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        off = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        off = model.gradient_checkpointing_disable
    try:
        yield
    finally:
        off()
        # transformers 4 enables it for PEFT models only, and its disable fails without one
        if not had_hook and _input_grad_hooked(model) and hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()


def _input_grad_hooked(model: nn.Module) -> bool:
    """Whether the model's input embeddings carry Hugging Face's requires-grad hook (transformers 5:
    ``_require_grads_hooks``, a list; 4: ``_require_grads_hook``)."""
    return bool(getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None))
