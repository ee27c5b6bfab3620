"""The spec's schema: strict pydantic models for a spec's sections, validation, and overrides.

Every section refuses unknown keys and YAML booleans where a number is asked; a validation
failure becomes one SpecError (:mod:`ckplan.spec.messages`). ``Spec.with_overrides`` applies the
CLI's and the API's overrides (--batch-size, seq_len=, ...) and validates again.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import SpecError, UsageError
from ..options import OPTIMIZER_ALIASES, OPTIMIZERS, PRECISIONS
from .messages import spec_error

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}
MAX_INPUT_BYTES = 2**63 - 1  # what torch can count (int64): no machine has this much memory


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data):
        # YAML's true/false would pass as 1/0 where a count is asked (batch_size: true -> 1)
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                v = data.get(name)
                ann = str(field.annotation)
                if "int" in ann and "bool" not in ann and (
                        isinstance(v, bool) or (isinstance(v, list) and any(isinstance(x, bool) for x in v))):
                    raise ValueError(f"{name} must be a number, not {v!r}")
        return data


class ModelSpec(_Strict):
    builtin: Optional[str] = None
    hf: Optional[dict[str, Any]] = None
    target: Optional[str] = None
    args: dict[str, Any] = Field(default_factory=dict)
    task: Optional[Literal["causal-lm", "masked-lm", "seq2seq-lm", "sequence-classification",
                           "image-classification", "speech-seq2seq", "base"]] = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("builtin", "hf", "target") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("name the model in exactly one way: `builtin: NAME`, `hf: {model_type: ...}` "
                             f"or `target: \"module:callable\"` (found {given or 'none'})")
        if self.hf is not None and "model_type" not in self.hf:
            raise ValueError("`hf:` needs `model_type` (e.g. gpt2, bert, llama)")
        if self.target is not None and ":" not in self.target:
            raise ValueError(f"target {self.target!r} must look like \"package.module:callable\"")
        if self.hf is not None and self.args:
            raise ValueError("`args:` goes with builtin/target; put Hugging Face config fields inside `hf:`")
        return self


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class LabelSpec(_Strict):
    shape: list[int] = Field(default_factory=list)
    dtype: Literal[DTYPES] = "int64"  # type: ignore[valid-type]
    high: Optional[int] = None


class InputSpec(_Strict):
    batch_size: int = Field(gt=0)
    shape: list[int]
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    high: Optional[int] = Field(default=None, gt=0)
    name: Optional[str] = None  # keyword to pass the input by; positional when absent
    labels: Union[Literal["copy", "none"], LabelSpec] = "none"

    @field_validator("shape")
    @classmethod
    def _positive(cls, v):
        if not v:
            raise ValueError("shape is [], but it must list at least one dimension: the shape of one sample "
                             "after the batch dimension, e.g. [512] for 512 token ids or [3, 224, 224] for "
                             "an image")
        if any(d <= 0 for d in v):
            raise ValueError(f"every dimension of shape must be positive, got {v}")
        return v

    def tensors(self) -> list[tuple[str, list[int], str]]:
        """``(what, shape, dtype)`` of each tensor of one batch: the input, and the labels when drawn."""
        out = [("input", [self.batch_size, *self.shape], self.dtype)]
        if isinstance(self.labels, LabelSpec):
            out.append(("labels", [self.batch_size, *self.labels.shape], self.labels.dtype))
        return out

    def nbytes(self) -> int:
        """Bytes of one batch (input and drawn labels), worked out without making it."""
        return sum(_numel(shape) * DTYPE_BYTES[dtype] for _, shape, dtype in self.tensors())

    @model_validator(mode="after")
    def _fits_a_machine(self):
        # torch counts elements in int64; a batch past 8 EiB is a typo, and torch's own error
        # for it is a C++ stack dump
        for what, shape, dtype in self.tensors():
            size = _numel(shape) * DTYPE_BYTES[dtype]
            if size > MAX_INPUT_BYTES:
                raise ValueError(f"the {what} (batch_size {self.batch_size} x shape {shape[1:]}, {dtype}) would "
                                 f"take about {size:.2g} bytes, larger than any machine's memory (8 EiB)")
        return self

    @model_validator(mode="after")
    def _ints_need_high(self):
        if self.dtype.startswith("int") and self.high is None:
            raise ValueError("an integer input needs `high:` (e.g. the vocabulary size for token ids)")
        if not self.dtype.startswith("int") and self.high is not None:
            # a float input is drawn from a normal distribution: `high` would be ignored silently
            raise ValueError(f"`high: {self.high}` is set on a {self.dtype} input, but `high` is the "
                             "exclusive upper bound of integer inputs (token ids) and a float input is "
                             "drawn from a normal distribution; remove `high:`, or set `dtype: int64` "
                             "for token ids")
        return self


class TrainSpec(_Strict):
    optimizer: str = "adamw"
    precision: Literal[PRECISIONS] = "fp32"  # type: ignore[valid-type]
    accum: int = Field(default=1, gt=0)
    lr: float = Field(default=1e-4, gt=0)

    @field_validator("optimizer")
    @classmethod
    def _opt(cls, v):
        v = OPTIMIZER_ALIASES.get(v, v)
        if v not in OPTIMIZERS:
            raise ValueError(f"optimizer {v!r} is not one of {', '.join(OPTIMIZERS)}")
        return v


class ParallelSpec(_Strict):
    """How the job runs across ranks: ``plan`` and ``bench`` default to it (``--world-size`` /
    ``--nproc`` and ``--parallel`` override). ``input.batch_size`` is per rank."""

    world_size: int = Field(default=1, gt=0)
    kind: Literal["fsdp", "ddp"] = "fsdp"
    # FSDP2's MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32): all-gathers and compute
    # in this dtype, fp32 shards, optimizer state and gradient reduction (torchtitan's default)
    param_dtype: Optional[Literal["bf16", "fp16"]] = None
    # The policy's reduce_dtype: fp32 (the default here, torchtitan's), or the param dtype (what
    # MixedPrecisionPolicy(param_dtype=torch.bfloat16) with no reduce_dtype does): the
    # reduce-scatter's buffers in it, the sharded gradients fp32 all the same
    reduce_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None


class Spec(_Strict):
    name: Optional[str] = None
    model: ModelSpec
    input: InputSpec
    chain: Optional[str] = None
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    seed: int = 0

    @model_validator(mode="after")
    def _param_dtype_is_fsdp2s(self):
        dtype = self.parallel.param_dtype
        if dtype is not None and self.parallel.kind != "fsdp":
            raise ValueError(f"parallel.param_dtype {dtype} is FSDP2's MixedPrecisionPolicy, but parallel.kind is "
                             f"{self.parallel.kind}: set kind: fsdp, or drop param_dtype and use train.precision "
                             "(autocast)")
        if dtype is not None and self.train.precision != "fp32":
            raise ValueError(f"parallel.param_dtype {dtype} (FSDP2 computes in {dtype}) and train.precision "
                             f"{self.train.precision} (autocast) are two kinds of mixed precision: keep one, "
                             "train.precision: fp32 with param_dtype")
        reduce = self.parallel.reduce_dtype
        if reduce is not None and dtype is None:
            raise ValueError(f"parallel.reduce_dtype {reduce} is part of FSDP2's MixedPrecisionPolicy: set "
                             "param_dtype (bf16 or fp16) too, or drop reduce_dtype")
        if reduce is not None and reduce not in ("fp32", dtype):
            raise ValueError(f"parallel.reduce_dtype {reduce} with param_dtype {dtype}: ckplan plans a reduce in "
                             f"fp32 or in the param dtype ({dtype}); set reduce_dtype: fp32 or {dtype}")
        return self

    def with_overrides(self, *, batch_size: int | None = None, seq_len: int | None = None,
                       precision: str | None = None, optimizer: str | None = None,
                       accum: int | None = None) -> Spec:
        """The spec with overrides applied (the CLI's --batch-size etc., the API's keywords), validated.

        Each override is checked on its own first, so a bad one is named as the argument it came
        from (``precision='int8'``), not as the spec field it would have replaced.
        """
        check_overrides(batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                        accum=accum)
        if seq_len is not None and not self.input.dtype.startswith("int"):
            inp = self.input
            what = " (an image)" if len(inp.shape) == 3 else " (features)" if len(inp.shape) == 1 else ""
            raise UsageError(f"seq_len={seq_len} (--seq-len) sets the sequence length, the first dimension of a "
                             f"token-id input, but this spec's input{f' {inp.name!r}' if inp.name else ''} is "
                             f"a {inp.dtype} tensor of shape {inp.shape}{what}, not a token sequence",
                             tip=f"drop the sequence length; to change the input's shape, edit input.shape "
                                 f"{inp.shape} in the spec (the batch size override still applies)")
        d = self.model_dump()
        if batch_size is not None:
            d["input"]["batch_size"] = batch_size
        if seq_len is not None:
            d["input"]["shape"] = [seq_len, *d["input"]["shape"][1:]]
            if isinstance(d["input"]["labels"], dict) and d["input"]["labels"]["shape"]:
                d["input"]["labels"]["shape"] = [seq_len, *d["input"]["labels"]["shape"][1:]]
        for key, val in (("precision", precision), ("optimizer", optimizer), ("accum", accum)):
            if val is not None:
                d["train"][key] = str(val) if key != "accum" else val
        given = ", ".join(f"{k}={getattr(v, 'value', v)!r}" for k, v in
                          (("batch_size", batch_size), ("seq_len", seq_len), ("precision", precision),
                           ("optimizer", optimizer), ("accum", accum)) if v is not None)
        return validate(d, source=f"with the override {given}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name}={value!r} must be a whole number of at least 1")


def check_overrides(*, batch_size=None, seq_len=None, precision=None, optimizer=None, accum=None) -> None:
    """Reject a bad override by its argument name (``accum=0``, ``precision='int8'``)."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("accum", accum)):
        if value is not None:
            _positive_int(name, value)
    if precision is not None:
        check_precision(precision)
    if optimizer is not None:
        check_optimizer(optimizer)


def check_precision(precision) -> str:
    """``precision`` as its name (fp32, bf16, fp16), or a UsageError naming the choices: the one
    check of a precision a caller passes (overrides, the Python API); a spec file's goes through
    ``TrainSpec``, which takes the same names."""
    if str(precision) not in PRECISIONS:
        raise UsageError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return str(precision)


def check_optimizer(optimizer) -> str:
    """``optimizer``'s canonical name (aliases: ``adam``, ``momentum``...), or a UsageError naming
    the choices: the one check of an optimizer a caller passes, as ``TrainSpec`` checks a spec's."""
    name = OPTIMIZER_ALIASES.get(str(optimizer), str(optimizer))
    if name not in OPTIMIZERS:
        raise UsageError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    return name


def validate(data: Any, *, source: str = "spec") -> Spec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping with `model:` and `input:`, got {type(data).__name__}",
                        tip="see README, section 'Specs', and docs/spec.md")
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        raise spec_error(e, Spec, source) from None
