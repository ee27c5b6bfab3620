"""The torch-compile peers: the whole model compiled with ``torch.compile`` (TorchInductor), its
min-cut partitioner given ckplan's budget as ``activation_memory_budget`` (:func:`budget_fraction`),
and the settings under which compiled code draws random numbers as eager does.

Each compiled row runs a copy of the model (``copy.deepcopy`` before any plan is applied) that
shares the original's parameters and buffers, so it trains the same weights with the same
optimizer; each copy has its own backend function, and Dynamo's cache guards on the backend,
so the two budgets never share a compiled graph (:class:`CompiledPeer`).
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ..errors import first_line

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
