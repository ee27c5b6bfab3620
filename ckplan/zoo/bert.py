"""A BERT-style encoder with a masked-language-model head (Devlin et al. 2019).

The defaults are BERT-base; the parameter count (109,514,298) equals Hugging Face's
``BertForMaskedLM`` for bert-base-uncased, which has no pooler either.

Chain: ``Bert.layers`` (an ``nn.ModuleList`` of :class:`EncoderLayer`); ``layer(x)`` maps the
hidden state (B, T, d_model) to a new one of the same shape.

Known limitations: no attention (padding) mask and token types are always 0, so every sequence
in a batch is taken as full length. Meta-device safe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._args import ZooArgumentError, check_float, check_int
from .attention import attend, merge_heads, split_heads


@dataclass
class BertConfig:
    vocab_size: int = 30522
    max_position: int = 512
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_ff: int = 3072
    dropout: float = 0.1  # hidden and attention dropout alike, as in BERT

    def __post_init__(self):
        m = "bert"
        for name in ("vocab_size", "max_position", "n_layer", "n_head", "d_model", "d_ff"):
            check_int(m, name, getattr(self, name))
        self.dropout = check_float(m, "dropout", self.dropout, low=0.0, high=1.0)
        if self.d_model % self.n_head:
            raise ZooArgumentError(f"bert: d_model={self.d_model} must be a multiple of n_head={self.n_head}")


_LN_EPS = 1e-12  # BERT's value


class Embeddings(nn.Module):
    """Token + position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.max_position, config.d_model)
        self.token_type = nn.Embedding(2, config.d_model)
        self.ln = nn.LayerNorm(config.d_model, eps=_LN_EPS)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        x = self.word(input_ids) + self.position(torch.arange(T, device=input_ids.device))  # (B, T, d)
        # All token types are 0: add row 0 instead of embedding a (B, T) tensor of zeros.
        x = x + self.token_type.weight[0]  # (B, T, d)
        return self.dropout(self.ln(x))


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention with separate q/k/v projections, as in BERT."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.query = nn.Linear(config.d_model, config.d_model)
        self.key = nn.Linear(config.d_model, config.d_model)
        self.value = nn.Linear(config.d_model, config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.out_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.query(x), self.n_head)  # (B, nh, T, hd)
        k = split_heads(self.key(x), self.n_head)  # (B, nh, T, hd)
        v = split_heads(self.value(x), self.n_head)  # (B, nh, T, hd)
        y = attend(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=False)
        y = merge_heads(y)  # (B, T, C)
        return self.out_dropout(self.out(y))


class FeedForward(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.intermediate = nn.Linear(config.d_model, config.d_ff)
        self.gelu = nn.GELU()
        self.output = nn.Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.output(self.gelu(self.intermediate(x))))  # (B, T, d)


class EncoderLayer(nn.Module):
    """Post-norm block (the original Transformer's order): LN(x + attn(x)), then LN(x + ffn(x))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln_1 = nn.LayerNorm(config.d_model, eps=_LN_EPS)
        self.ffn = FeedForward(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=_LN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x))  # (B, T, d)
        x = self.ln_2(x + self.ffn(x))  # (B, T, d)
        return x


class MLMHead(nn.Module):
    """dense + GELU + LayerNorm, then a decoder whose weight is the token embedding matrix."""

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.gelu = nn.GELU()
        self.ln = nn.LayerNorm(config.d_model, eps=_LN_EPS)
        self.decoder = nn.Linear(config.d_model, config.vocab_size)  # its bias stays its own
        self.decoder.weight = word_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(self.gelu(self.dense(x))))  # (B, T, V)


class Bert(nn.Module):
    chain_attr = "layers"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layer))
        self.head = MLMHead(config, self.embeddings.word)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """BERT's init: N(0, 0.02) weights, zero biases, unit LayerNorms. A no-op on meta."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) without labels; with labels (B, T) the mean MLM cross-entropy over
        every position whose label is not -100 (labels = a copy of the ids scores all of them)."""
        T = input_ids.shape[1]
        if self.config.max_position < T:
            raise ValueError(f"bert: sequence length {T} exceeds max_position={self.config.max_position}")
        x = self.embeddings(input_ids)  # (B, T, d)
        for layer in self.layers:
            x = layer(x)  # (B, T, d)
        logits = self.head(x)  # (B, T, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def build_bert(**kwargs) -> Bert:
    return Bert(BertConfig(**kwargs))
