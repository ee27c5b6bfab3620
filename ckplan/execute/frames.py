"""torch's private checkpoint frames (torch.utils.checkpoint's ``_CheckpointFrame`` and
``_checkpoint_hook``), under the two ways torch versions save a frame's inputs.

torch >= 2.12: ``frame.save_inputs`` / ``get_inputs``. Older: the frame's ``input_saver``, the
output of ``_NoopSaveInputs.apply(dummy, kwargs, *args)``, whose recompute gets ``(kwargs, *args)``.
Where the API is missing, ``_CAN_SPAN`` is False and checkpoints are one layer each.
"""
from __future__ import annotations

import functools

import torch
from torch.utils import checkpoint as _tc

try:  # torch's non-reentrant checkpoint internals (torch 2.4 .. 2.13: two ways to save inputs)
    _CheckpointFrame = _tc._CheckpointFrame
    _checkpoint_hook = _tc._checkpoint_hook
    _metadata_fn = _tc._allowed_determinism_checks_to_fns[_tc._DEFAULT_DETERMINISM_MODE]
    _infer_device_type = _tc._infer_device_type
    _get_device_module = _tc._get_device_module
    _get_autocast_kwargs = _tc._get_autocast_kwargs
    _SAVES_INPUTS = hasattr(_CheckpointFrame, "save_inputs") and hasattr(_CheckpointFrame, "get_inputs")
    _CAN_SPAN = _SAVES_INPUTS or hasattr(_tc, "_NoopSaveInputs")
except (ImportError, AttributeError, KeyError):  # pragma: no cover - depends on the torch version
    _SAVES_INPUTS = _CAN_SPAN = False
    _CheckpointFrame = _checkpoint_hook = _metadata_fn = None
    _infer_device_type = _get_device_module = _get_autocast_kwargs = None


def _new_frame(recompute, early_stop: bool, metadata_fn=None):
    """A torch checkpoint frame whose recompute is called with the inputs :func:`_save_inputs`
    saved to it, whichever way this torch saves a frame's inputs."""
    if _SAVES_INPUTS or recompute is None:
        return _CheckpointFrame(recompute, early_stop, None, metadata_fn)
    return _CheckpointFrame(functools.partial(_without_kwargs, recompute), early_stop, None, metadata_fn)


def _without_kwargs(recompute, _kwargs, *inputs):
    return recompute(*inputs)


def _save_inputs(frame, inputs) -> None:
    """Save ``inputs`` to ``frame`` as torch's own checkpoint does (through the saved-tensor hooks
    active now: a parent checkpoint's, when nested)."""
    if _SAVES_INPUTS:
        frame.save_inputs(*inputs)
    else:
        dummy = torch.empty((0,), requires_grad=True)
        frame.input_saver = _tc._NoopSaveInputs.apply(dummy, None, *inputs)


def _early_stop() -> bool:
    flag = getattr(_tc, "_enable_checkpoint_early_stop", None)
    return True if flag is None else flag

