"""The ``hf`` peer where the model is a Hugging Face model: its own activation checkpointing
(``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` before transformers 5).
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face model that supports its own activation checkpointing."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable"))


@contextmanager
def hf_checkpointing(model: nn.Module):
    """The model's own ``activation_checkpointing_enable`` (transformers >= 5; older:
    ``gradient_checkpointing_enable``) with ``use_reentrant=False``; disabled on exit.

    Enabling also hooks the input embeddings so that their output requires grad (for frozen
    embeddings: LoRA, PEFT), and disabling leaves that hook: it is removed on exit unless the
    model had one before, so the rows measured after this one run the model as it was."""
    had_hook = _input_grad_hooked(model)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        off = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        off = model.gradient_checkpointing_disable
    try:
        yield
    finally:
        off()
        # transformers 4 enables it for PEFT models only, and its disable fails without one
        if not had_hook and _input_grad_hooked(model) and hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()


def _input_grad_hooked(model: nn.Module) -> bool:
    """Whether the model's input embeddings carry Hugging Face's requires-grad hook (transformers 5:
    ``_require_grads_hooks``, a list; 4: ``_require_grads_hook``)."""
    return bool(getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None))
