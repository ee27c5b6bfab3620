"""FSDP2's ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)`` on one process.

Under the policy every FSDP unit all-gathers its parameters in ``param_dtype``, casts the floating
tensors its forward receives to it (``cast_forward_inputs``), and computes in it; the shards and
the optimizer state stay fp32, and the reduce-scatter runs in ``reduce_dtype`` (fp32 by default
here, or the param dtype), its output cast to the fp32 sharded gradient. One process reproduces what a rank computes by
casting the parameters (not the buffers: FSDP2 leaves them) and hooking the same input casts on
each chain layer and on the model (the root unit): the profile of that model is what
``planner.parallel`` turns into a rank's chain, and the distributed bench's one-process reference
runs it too.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .chainfind import resolve_chain

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def policy_text(param_dtype: str, reduce_dtype: str | None) -> str:
    """The policy as a user writes it: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``."""
    return f"MixedPrecisionPolicy(param_dtype={param_dtype}, reduce_dtype={reduce_dtype or 'fp32'})"


def cast_like_fsdp(model: torch.nn.Module, chain_path: str | None, param_dtype: str) -> torch.nn.Module:
    """``model`` in place: floating parameters in ``param_dtype``, floating inputs of each chain
    layer and of the model cast to it before their forward, as FSDP2's policy does per unit."""
    dtype = DTYPES[param_dtype]
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t

    def hook(_module, args, kwargs):  # FSDP2's _cast_fp_tensor over the inputs' pytree
        return tree_map(cast, args), tree_map(cast, kwargs)

    _, container, _ = resolve_chain(model, chain_path)
    for layer in container:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model
