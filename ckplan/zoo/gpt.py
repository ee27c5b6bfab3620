"""A decoder-only transformer in the style of nanoGPT, stretchable to Llama shapes.

The defaults are GPT-2 small (124,439,808 parameters). Switching ``norm="rmsnorm"``,
``mlp="swiglu"``, ``pos="rope"``, ``bias=False``, ``tie_weights=False`` and setting
``n_kv_head`` gives Llama: with n_layer=32, n_head=32, n_embd=4096, ffn_hidden=11008,
vocab_size=32000 it is Llama-2-7B (6,738,415,616 parameters); with n_layer=80, n_head=64,
n_kv_head=8, n_embd=8192, ffn_hidden=28672 it is Llama-2-70B (68,976,648,192).

Chain: ``GPT.blocks`` (an ``nn.ModuleList`` of :class:`Block`); ``block(x)`` maps the hidden
state (B, T, C) to a new one of the same shape.

Everything is meta-device safe: no value is read in ``__init__`` or ``forward``, so a 70B model
builds and runs forward and backward under ``with torch.device("meta"):`` in a blink.

Known limitations:

- After building on meta and ``to_empty(device=...)``, weights and the rotary tables hold
  garbage; call :meth:`GPT.init_weights` to fill them.
- No KV cache, no attention mask other than causal, no generation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._args import ZooArgumentError, check_bool, check_choice, check_float, check_int, check_optional_int
from .attention import attend, merge_heads, split_heads


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024  # the longest sequence; sizes the learned position table or rope tables
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    mlp: str = "gelu"  # "gelu" | "swiglu"
    ffn_hidden: int | None = None  # None: 4*n_embd (gelu), or Llama's rule (swiglu), see ffn_dim
    n_kv_head: int | None = None  # None: n_head; fewer is grouped-query attention
    pos: str = "learned"  # "learned" | "rope"
    tie_weights: bool = True  # lm_head shares the token embedding matrix

    def __post_init__(self):
        m = "gpt"
        check_int(m, "vocab_size", self.vocab_size)
        check_int(m, "block_size", self.block_size)
        check_int(m, "n_layer", self.n_layer)
        check_int(m, "n_head", self.n_head)
        check_int(m, "n_embd", self.n_embd)
        self.dropout = check_float(m, "dropout", self.dropout, low=0.0, high=1.0)
        check_bool(m, "bias", self.bias)
        check_choice(m, "norm", self.norm, ("layernorm", "rmsnorm"))
        check_choice(m, "mlp", self.mlp, ("gelu", "swiglu"))
        check_optional_int(m, "ffn_hidden", self.ffn_hidden)
        check_optional_int(m, "n_kv_head", self.n_kv_head)
        check_choice(m, "pos", self.pos, ("learned", "rope"))
        check_bool(m, "tie_weights", self.tie_weights)
        if self.n_embd % self.n_head:
            raise ZooArgumentError(f"gpt: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ZooArgumentError(f"gpt: n_head={self.n_head} must be a multiple of "
                                   f"n_kv_head={self.kv_heads}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ZooArgumentError(f"gpt: pos='rope' needs an even head size, "
                                   f"got n_embd/n_head={self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        # Llama keeps SwiGLU's three matrices at the cost of GELU's two: 2/3 of 4*C, rounded up
        # to a multiple of 256 (4096 -> 11008).
        hidden = int(2 * 4 * self.n_embd / 3)
        return 256 * ((hidden + 255) // 256)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=1e-5)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer), "rotate half" layout as in HF Llama.

    One instance is shared by every block's attention, so its cos/sin tables exist once.
    """

    def __init__(self, head_dim: int, block_size: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # Non-persistent: derived from the config, so they stay out of state_dict.
        self.register_buffer("cos", torch.empty(block_size, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(block_size, head_dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        device = self.cos.device
        dims = torch.arange(0, self.head_dim, 2, device=device).float()  # (hd/2,)
        inv_freq = 1.0 / self.theta ** (dims / self.head_dim)
        t = torch.arange(self.cos.shape[0], device=device).float()
        freqs = torch.outer(t, inv_freq)  # (block_size, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (block_size, hd)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[-2]  # x: (B, nh, T, hd)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        # in x's dtype, as Hugging Face's Llama does (a bf16 model's fp32 tables would promote q and k)
        return x * self.cos[:T].to(x.dtype) + rotated * self.sin[:T].to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; grouped-query when n_kv_head < n_head (Ainslie et al. 2023)."""

    def __init__(self, config: GPTConfig, rotary: Rotary | None):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        kv_dim = self.n_kv_head * self.head_dim
        # q, k and v in one matmul, as in nanoGPT; with GQA k and v are narrower than q.
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        C = x.shape[-1]
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.c_attn(x).split([C, kv_dim, kv_dim], dim=2)
        q = split_heads(q, self.n_head)  # (B, nh, T, hd)
        k = split_heads(k, self.n_kv_head)  # (B, nkv, T, hd)
        v = split_heads(v, self.n_kv_head)  # (B, nkv, T, hd)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = attend(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = merge_heads(y)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GeluMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"), as in Llama."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_gate = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.c_fc = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.c_gate(x)) * self.c_fc(x)  # (B, T, ffn)
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, rotary: Rotary | None):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, rotary)
        self.ln_2 = make_norm(config)
        self.mlp = SwiGLU(config) if config.mlp == "swiglu" else GeluMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    chain_attr = "blocks"

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else None
        self.rotary = Rotary(config.head_dim, config.block_size) if config.pos == "rope" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, self.rotary) for _ in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight  # weight tying (Press & Wolf 2017), as GPT-2
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """nanoGPT's init: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2*n_layer).

        A no-op on meta tensors; call it again after ``to_empty`` to get real values.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        # GPT-2: each residual branch adds to the stream, so its output projection starts smaller.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        if self.rotary is not None:
            self.rotary.reset_parameters()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) without labels; with labels (a copy of the ids, as in Hugging Face)
        the mean next-token cross-entropy, shifted here; -100 in labels is ignored."""
        _, T = input_ids.shape
        if self.config.block_size < T:
            raise ValueError(f"gpt: sequence length {T} exceeds block_size={self.config.block_size}")
        x = self.wte(input_ids)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=input_ids.device))  # (B, T, C)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        if labels is None:
            return logits
        # Position t predicts token t+1. The slice copies (B, T-1, V) logits, as HF's shift does.
        V = logits.shape[-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)


def build_gpt(**kwargs) -> GPT:
    return GPT(GPTConfig(**kwargs))
