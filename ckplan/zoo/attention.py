"""Multi-head attention shared by the zoo's transformers (gpt.py, bert.py).

The models keep their own projections (GPT's fused ``c_attn``, BERT's ``query``/``key``/
``value``), so their state_dict keys stay those of nanoGPT and BERT; what they share is the
part between the projections: heads split out, scaled dot-product attention (grouped-query when
there are fewer key/value heads), heads merged back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# enable_gqa arrived in torch 2.5; before it, K/V heads are expanded by hand (which is also what
# SDPA's math backend does internally, so the saved activations are about the same).
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, n_head * hd) -> (B, n_head, T, hd), a view."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hd) -> (B, T, nh * hd), contiguous."""
    B, nh, T, hd = y.shape
    return y.transpose(1, 2).contiguous().view(B, T, nh * hd)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float,
           is_causal: bool) -> torch.Tensor:
    """Attention of (B, nh, T, hd) queries over (B, nkv, T, hd) keys and values -> (B, nh, T, hd).

    nkv < nh is grouped-query attention (Ainslie et al. 2023): query head i reads kv head
    i // (nh / nkv).
    """
    n_head, n_kv = q.shape[1], k.shape[1]
    if n_kv == n_head:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal,
                                              enable_gqa=True)
    groups = n_head // n_kv
    k = k.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
    v = v.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
