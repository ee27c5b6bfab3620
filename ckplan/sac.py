"""Selective recomputation inside a layer: the policies ckplan measures and installs.

Each policy runs a layer under PyTorch's selective activation checkpointing (SAC,
``torch.utils.checkpoint.create_selective_checkpoint_contexts``): one non-reentrant checkpoint
around the layer whose policy says, op by op, whether its output is kept from the forward
(``MUST_SAVE``) or recomputed in the backward (``PREFER_RECOMPUTE``). In the backward the layer's
forward runs again, the kept outputs are taken from the cache and the other ops are redone. So
a policy keeps the outputs of its saved ops (and the layer's input and output); its recompute
time is the forward time of the other ops.

``sac-compute``  keep the outputs of compute-heavy ops (matmuls, attention kernels, convolution),
                 recompute the cheap ones (pointwise, norms, activations, dropout): the policy
                 of torch's SAC documentation, and ckplan's ``sac-policy`` peer.
``sac-linear``   keep the outputs of linear layers and convolutions only; recompute the
                 attention core (scores, softmax, dropout, attention kernels) and the pointwise
                 ops: Megatron-LM's "selective recomputation" plus the cheap ops.
``sac-attn``     keep the outputs of linear layers, norms and activations; recompute the
                 attention core and the other pointwise ops: close to Megatron-LM's selective
                 recomputation (Korthikanti et al. 2022, "Reducing activation recomputation in
                 large transformer models"), which keeps everything outside the attention core.
                 (A policy that saves every op but the core would cache tensors that attention's
                 decomposed math then changes in place, which SAC refuses.)

Compiled layers (``--compile``, :mod:`ckplan.compiled`) have three more options, run by
torch.compile's own partitioner instead of a SAC policy:

``mincut-80``    the layer compiled with ``activation_memory_budget`` 0.8: the partitioner recomputes
                 the pointwise ops whose recompute fuses into the backward's kernels (a GPT-2 block
                 at 2 x 512 on CPU: 57 MiB saved instead of 75, at the same step time).
``mincut-50``    the layer compiled with ``activation_memory_budget`` 0.5: AOTAutograd's min-cut
                 partitioner keeps at most half of what the layer's compiled graph saves by default
                 and recomputes the ops its knapsack finds cheapest (by FLOPs) inside the compiled
                 backward, as ``torch.compile`` with that budget does for a whole model.
``mincut-20``    the same at budget 0.2.

So ckplan's plan space holds, layer by layer, what torch.compile's budget does for the whole model,
beside checkpoints and SAC policies; on eager layers they are refused (SpecError).

Two more ways to treat a layer need no policy: ``store`` (keep everything, no checkpoint) and
``full`` (recompute the whole layer: ``Checkpoint(i, i + 1)``). On a layer without the ops a
policy names, the policy keeps (almost) nothing or everything; the profile measures each one
and the planner drops the options another beats on both memory and time.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .errors import SpecError
from .options import MINCUT_BUDGETS as MINCUT
from .options import SAC_POLICIES as POLICY_DOC
from .options import SELECTIVE_OPTIONS as OPTIONS
from .planner.chain import STORE
from .recompute import recompute_keeping_stats


def _ops(names: list[str]) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))  # every overload


_ATTN_KERNELS = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_flash_attention_forward", "_efficient_attention_forward"]
LINEAR_OPS = _ops(["mm", "addmm", "convolution", "_convolution", "linear"])
COMPUTE_OPS = LINEAR_OPS | _ops(["bmm", "baddbmm", *_ATTN_KERNELS])
# Outside the attention core: what Megatron keeps (its pointwise ops are recomputed here: they are
# cheap, and attention's own pointwise ops cannot be told apart at the dispatcher).
NON_CORE_OPS = LINEAR_OPS | _ops(["native_layer_norm", "_fused_rms_norm", "native_batch_norm",
                                  "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                                  "gelu", "silu", "relu", "tanh", "sigmoid", "_fused_rms_norm"])

# The option names are ckplan.options' (plan files are checked there without torch).
POLICIES: tuple[str, ...] = tuple(POLICY_DOC)


def check_option(name: str) -> None:
    """Fail (SpecError) unless ``name`` is one of ckplan's selective options."""
    if name not in OPTIONS:
        raise SpecError(f"unknown selective option {name!r}",
                        tip=f"use one of: {', '.join(OPTIONS)} (or 'store')")


def compiled_only(name: str) -> SpecError:
    """The error for a compiled-only option (``mincut-*``) asked of an eager layer."""
    return SpecError(f"selective option {name!r} runs only in compiled chain layers (torch.compile's "
                     "partitioner does the recompute)",
                     tip="compile the chain layers (ckplan bench --compile, or ckplan.compiled_layers "
                         "before apply_plan), or plan without --compile")


def _save_if_in(ops: frozenset, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in ops else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class KeepLaterRandom:
    """A SAC policy that never lets the recompute draw other random numbers than the forward.

    The recompute starts from the forward's RNG state, and a kept op is not run again: if it drew
    random numbers (CUDA's fused attention with dropout: ``_scaled_dot_product_efficient_attention``
    is kept by ``sac-compute``), every random op after it would draw the wrong ones in the
    recompute (a dropout mask that differs from the forward's: wrong gradients, seen on BERT-large
    on an H200). So once a random op (``torch.Tag.nondeterministic_seeded``) is kept, every later
    random op of the same pass is kept too. One instance per checkpoint call: its forward and its
    recompute count apart (``ctx.is_recompute``) and see the same ops in the same order."""

    def __init__(self, base):
        self.base = base
        self.kept_random = {False: False, True: False}

    def __call__(self, ctx, op, *args, **kwargs):
        policy = self.base(ctx, op, *args, **kwargs)
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            if policy in _SAVE:
                self.kept_random[ctx.is_recompute] = True
            elif self.kept_random[ctx.is_recompute]:
                policy = CheckpointPolicy.MUST_SAVE
        return policy


_POLICY_FN = {
    "sac-compute": functools.partial(_save_if_in, COMPUTE_OPS),
    "sac-linear": functools.partial(_save_if_in, LINEAR_OPS),
    "sac-attn": functools.partial(_save_if_in, NON_CORE_OPS),
}


def policy_fn(name: str, *, rng_safe: bool = True):
    """The SAC policy function of option ``name``: a new one per checkpoint call (it counts the
    random ops it keeps, :class:`KeepLaterRandom`); ``rng_safe=False``: the bare policy."""
    if name in MINCUT:
        raise compiled_only(name)
    try:
        base = _POLICY_FN[name]
    except KeyError:
        raise SpecError(f"unknown selective option {name!r}",
                        tip=f"use one of: {', '.join(POLICIES)} (or 'store')") from None
    return KeepLaterRandom(base) if rng_safe else base


# torch 2.14 added checkpoint(..., respect_saved_tensors_hooks=): unset, the tensors a SAC policy keeps
# bypass any saved_tensors_hooks around the layer (with a FutureWarning that a later release will
# route them through). ckplan's hooks around a layer with an option (the profile's tracker, the
# executor's offload hooks) are built for the bypass, so it is asked for by name where torch has it.
SAC_KWARGS = ({"respect_saved_tensors_hooks": False}
              if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})
# With that switch on, what a policy keeps reaches the hooks around the layer, so a layer stored with
# an option can also send it to host memory (``sac-compute+offload``, ckplan.execute.offload).
OFFLOAD_OPTIONS = bool(SAC_KWARGS)


def _contexts(name: str):
    return create_selective_checkpoint_contexts(policy_fn(name))


def sac_contexts(name: str):
    """Option ``name``'s SAC forward and recompute contexts, to enter without ``checkpoint``; the
    tensors the policy keeps bypass saved-tensor hooks around them, as ``SAC_KWARGS`` asks."""
    fwd, rec = _contexts(name)
    if SAC_KWARGS and hasattr(fwd, "respect_saved_tensors_hooks"):
        fwd.respect_saved_tensors_hooks = False
    return fwd, rec


def context_fn(name: str):
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` applying option ``name``."""
    policy_fn(name)  # an unknown option fails now
    return functools.partial(_contexts, name)


@functools.cache
def warm_up() -> None:
    """Run one tiny layer under a policy, forward and backward, once per process: the first SAC
    checkpoint of a process initialises torch's own machinery (on torch 2.6, some 80 ops on
    scratch tensors), which a profile must not bill to the first layer it measures."""
    x = torch.ones(2, requires_grad=True)
    checkpoint(torch.sin, x, use_reentrant=False, context_fn=context_fn("sac-compute"), **SAC_KWARGS).sum().backward()


def run_with_option(fn, name: str, *args, _ckplan_hooks: bool = False, **kwargs):
    """Run ``fn(*args, **kwargs)`` as a layer stored with option ``name`` (``store``: as is);
    ``_ckplan_hooks``: what the policy keeps goes through the saved-tensor hooks around it (torch
    2.14 on: ``OFFLOAD_OPTIONS``)."""
    if name == STORE or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    compiled = getattr(fn, "with_option", None)  # a compiled layer (ckplan.compiled): SAC compiled in
    if compiled is not None:
        return compiled(name)(*args, **kwargs)
    how = {"respect_saved_tensors_hooks": True} if _ckplan_hooks else SAC_KWARGS
    return checkpoint(recompute_keeping_stats(fn), *args, use_reentrant=False, context_fn=context_fn(name),
                      **how, **kwargs)
