"""Model spec (YAML) -> validated config -> model, batch and loss.

A spec names the model in exactly one of three ways (``builtin`` from ckplan's zoo, ``hf`` a
Hugging Face config built offline with random weights, ``target`` the user's own factory), the
inputs, the chain of checkpointable layers and the training settings. See README "Specs" and docs/spec.md.

A spec is code. ``target: "package.module:callable"`` imports that module (running whatever it
runs on import) and calls the callable with ``args:``, before ckplan can look at the result:
``target: "os:system"`` would run a shell command. That happens on every device, ``meta``
included (fake tensors spare the memory, not the code), and in ``bench --plan``'s early check.
Run only specs you trust, as you would a Python script.

schema    the sections and their checks, validate(), overrides   messages  validation errors, readable
load      load_spec(): a YAML file -> Spec                        limits    vocabulary and sequence length
build     build_model(): zoo, target (and hf, in hf.py)           batch     make_batch(), to_loss()
labels    the loss for a model that takes no labels (timm, torchvision): hooks on the model
"""
from .batch import batch_bytes, make_batch, to_loss, torch_dtype
from .build import build_model
from .hf import HF_GENERIC_FIELDS, hf_config_fields
from .limits import check_token_range
from .load import load_spec
from .schema import (
    DTYPE_BYTES,
    DTYPES,
    MAX_INPUT_BYTES,
    InputSpec,
    LabelSpec,
    ModelSpec,
    ParallelSpec,
    Spec,
    TrainSpec,
    check_optimizer,
    check_overrides,
    check_precision,
    validate,
)

__all__ = [
    "DTYPES", "DTYPE_BYTES", "HF_GENERIC_FIELDS", "MAX_INPUT_BYTES", "InputSpec", "LabelSpec", "ModelSpec",
    "ParallelSpec", "Spec", "TrainSpec", "batch_bytes", "build_model", "check_optimizer", "check_overrides",
    "check_precision", "check_token_range", "hf_config_fields", "load_spec", "make_batch", "to_loss", "torch_dtype",
    "validate",
]
