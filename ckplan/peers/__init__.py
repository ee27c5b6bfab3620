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

The package, one peer family per module: :mod:`~ckplan.peers.names` (the peers' names),
:mod:`~ckplan.peers.hf` (``hf``), :mod:`~ckplan.peers.selective` (``sac-policy``),
:mod:`~ckplan.peers.offload` (``offload-all``, ``offload-attn``) and
:mod:`~ckplan.peers.torch_compile` (``torch-compile``, ``torch-compile-nobudget``).
"""
from ..sac import COMPUTE_OPS as SAC_SAVE_OPS
from .hf import hf_checkpointing, is_hf_model
from .names import COMPILE_PEERS, PEER_NAMES, UNAVAILABLE
from .offload import attention_blocks, offload_all, offload_attention
from .selective import sac_policy
from .torch_compile import (
    COPIES,
    CompiledPeer,
    budget_fraction,
    compile_unavailable,
    copies_compile,
    eager_random_ops,
    save_random_ops,
    shared_copy,
)

__all__ = ["COMPILE_PEERS", "COPIES", "PEER_NAMES", "SAC_SAVE_OPS", "UNAVAILABLE", "CompiledPeer", "attention_blocks",
           "budget_fraction", "compile_unavailable", "copies_compile", "eager_random_ops", "hf_checkpointing",
           "is_hf_model", "offload_all", "offload_attention", "sac_policy", "save_random_ops", "shared_copy"]
