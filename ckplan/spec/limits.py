"""Inputs a model can take, checked before anything is built or allocated: token ids within its
vocabulary, and a sequence no longer than its position table (zoo models and Hugging Face's)."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import SpecError
from ..zoo import zoo_args
from .schema import InputSpec, Spec


def check_token_range(inp: InputSpec, vocab_size: Any, where: str) -> None:
    """Token ids are drawn from [0, input.high): ``high`` above the model's vocabulary would index
    past its embedding table, an IndexError only at run time (and never on the meta device); a
    float input is no token ids at all."""
    if not inp.dtype.startswith(("int", "uint")):
        raise SpecError(f"input.dtype {inp.dtype!r}: the model embeds token ids ({where.split(',')[0]}), which "
                        "must be integers", tip=f"set input.dtype: int64 and input.high: {vocab_size}"
                        if isinstance(vocab_size, int) else "set input.dtype: int64")
    if (inp.dtype.startswith("int") and inp.high is not None and isinstance(vocab_size, int)
            and not isinstance(vocab_size, bool) and inp.high > vocab_size):
        raise SpecError(f"input.high {inp.high} is above the model's vocabulary size {vocab_size} ({where}): "
                        f"token ids up to {inp.high - 1} would index past its embedding table",
                        tip=f"set input.high to at most {vocab_size} (usually equal to the vocabulary size), "
                            f"or raise {where.split(',')[0]}")


def check_builtin_vocab(spec: Spec) -> None:
    """A zoo model that embeds token ids (gpt, bert) declares ``vocab_size``: check ``input.high``."""
    name = spec.model.builtin
    try:
        defaults = zoo_args(str(name))
    except KeyError:
        return  # an unknown builtin: building it says so (ckplan.spec.build)
    if "vocab_size" not in defaults:
        return
    given = "vocab_size" in spec.model.args
    vocab = spec.model.args["vocab_size"] if given else defaults["vocab_size"]
    check_token_range(spec.input, vocab, "model.args.vocab_size" if given else
                      f"model.args.vocab_size, the default of builtin {name!r}")


# The argument that sizes each zoo model's position table (the longest sequence it takes).
_BUILTIN_LENGTH = {"gpt": "block_size", "bert": "max_position"}


def _token_length(inp: InputSpec) -> int | None:
    """The sequence length of a token-id input (its first dimension), else None."""
    return inp.shape[0] if inp.dtype.startswith("int") else None


def _too_long(length: int, limit: int, where: str) -> SpecError:
    return SpecError(f"input.shape[0], the sequence length, is {length}, above the {limit} positions the model "
                     f"takes ({where}): the forward would fail after the whole batch was allocated",
                     tip=f"use a sequence length of at most {limit} (--seq-len {limit}, seq_len= in the API), "
                         f"or raise {where.split(',')[0]}")


def check_builtin_length(spec: Spec) -> None:
    """A zoo model's position table (gpt's ``block_size``, bert's ``max_position``) bounds the
    sequence: refuse a longer one before anything is built or allocated."""
    name = str(spec.model.builtin)
    arg, length = _BUILTIN_LENGTH.get(name), _token_length(spec.input)
    if arg is None or length is None:
        return
    given = arg in spec.model.args
    limit = spec.model.args[arg] if given else zoo_args(name)[arg]
    if isinstance(limit, int) and not isinstance(limit, bool) and length > limit:
        raise _too_long(length, limit, f"model.args.{arg}" if given else
                        f"model.args.{arg}, the default of builtin {name!r}")


def check_position_table(model, inp: InputSpec) -> None:
    """A Hugging Face model with a learned position table (GPT-2's ``wpe``, BERT's
    ``position_embeddings``, OPT's ``embed_positions``) takes at most its rows of tokens; rotary
    models have no table and no such bound."""
    length = _token_length(inp)
    if length is None:
        return
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(m, torch.nn.Embedding) and (last == "wpe" or "position" in last):
            limit = m.num_embeddings - int(getattr(m, "offset", 0) or 0)
            if length > limit:
                raise _too_long(length, limit, f"the position table {name} has {limit} rows")
            return


def check_speech_features(inp: InputSpec, config: Any, model_type: str) -> None:
    """Whisper-style encoders take log-mel features of exactly ``num_mel_bins`` x
    ``2 * max_source_positions`` frames (two convolutions, the second of stride 2, then a position
    table of ``max_source_positions`` rows); another shape fails only inside the model's forward."""
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if inp.name != "input_features" or not (isinstance(mels, int) and isinstance(positions, int)):
        return
    want = [mels, 2 * positions]
    if list(inp.shape) != want:
        raise SpecError(f"input.shape {list(inp.shape)}: {model_type} takes input_features of shape "
                        f"[num_mel_bins, 2 x max_source_positions] = {want}",
                        tip=f"set input.shape: {want}, or change model.hf.num_mel_bins / max_source_positions")
