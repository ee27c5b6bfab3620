"""The offload peers: ``offload-all`` (what every chain layer saves, as torchtune's
``OffloadActivations``) and ``offload-attn`` (what the attention blocks save, Megatron-style),
copied to pinned host memory by :mod:`ckplan.execute.offload` (CUDA).
"""
from __future__ import annotations

from torch import nn

from ..chainfind import resolve_chain
from ..errors import UsageError
from ..execute.offload import layers_offloaded


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
