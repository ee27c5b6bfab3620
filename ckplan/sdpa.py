"""Which kernel ``F.scaled_dot_product_attention`` runs on the target device, replayed on meta.

SDPA picks a kernel per call, and the kernels keep very different tensors for the backward: the
fused ones (CPU flash; CUDA flash and memory-efficient) keep the output and a (B, H, T) logsumexp,
the math path keeps the (B, H, T, T) attention matrix (and, with dropout, its mask and the dropped
copy). On meta tensors SDPA always takes the math path, so a meta profile must make the choice
the target device would make and run that kernel's meta implementation, or its sizes are wrong
(BERT with attention dropout on CPU: the math path; without this, meta assumed fused).

``SdpaOnMeta`` is that replay. The choice follows torch's own rules:

* CPU target: torch's CPU selector itself (``torch._fused_sdp_choice``) asked about CPU stand-ins
  of the same shapes, dtypes, strides of the last dimension, mask, dropout and GQA flag (the
  stand-ins are expanded views of one row, so asking costs nothing). Today that is: flash
  unless dropout > 0, a mask of an unsupported shape or one that requires grad, 3-D inputs,
  mismatched head dims or a non-float dtype; otherwise math. ``torch.backends.cuda.sdp_kernel``
  / ``sdpa_kernel`` settings are honoured because the selector reads them.
* CUDA target: the selector on CUDA stand-ins when this machine has a GPU; without one, the rules of
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` for an sm80+ GPU, in its priority
  order (:func:`cuda_choice`): flash (fp16/bf16, no mask, head dim <= 256 and a multiple of 8),
  then memory-efficient (fp16/bf16/fp32, masks allowed, no GQA), then math.

For a CUDA target, dropout runs as CUDA runs it too: the fused ``native_dropout``, which keeps a
bool mask, not the noise tensor a meta tensor's dropout keeps (``_fused_dropout``).

Known limitations: nested tensors and cuDNN attention are not modelled; on CUDA without a GPU
the rules are a transcription (sm80+ assumed) and may lag torch's.
"""
from __future__ import annotations

import inspect
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from . import meta_autocast
from .meta_fromdata import NOT_DONE, made_on_meta

TARGETS = ("cpu", "cuda")

_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
_PATH_NAMES = {SDPBackend.MATH: "math", SDPBackend.FLASH_ATTENTION: "flash",
               SDPBackend.EFFICIENT_ATTENTION: "memory-efficient"}


def default_target() -> str:
    """The device a meta profile stands for when none is named: CUDA when this machine has one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _bind(args, kwargs) -> dict:
    call = dict(_DEFAULTS)
    call.update(zip(_ARG_NAMES, args))
    call.update(kwargs)
    return call


def _standin(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    """A tensor on ``device`` with ``t``'s shape, dtype, last-dim stride and requires_grad (some
    rules read it), backed by one row."""
    if t is None:
        return None
    last_stride = t.stride(-1) if t.dim() else 1
    row = torch.empty(max(1, t.shape[-1] if t.dim() else 1) * max(1, last_stride), dtype=t.dtype,
                      device=device)
    if t.dim() == 0:
        return row[0]
    strides = [0] * (t.dim() - 1) + [last_stride]
    return row.as_strided(t.shape, strides).detach().requires_grad_(t.requires_grad)


def cuda_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p: float,
                is_causal: bool, enable_gqa: bool) -> SDPBackend:
    """torch's CUDA selection rules (sdp_utils.cpp) for an sm80+ GPU, without asking a GPU."""
    dims_ok = q.dim() == k.dim() == v.dim() == 4
    head = q.shape[-1]
    same_head = head == k.shape[-1] == v.shape[-1]
    same_heads = q.shape[-3] == k.shape[-3] == v.shape[-3] if dims_ok else False
    gqa_ok = dims_ok and enable_gqa and k.shape[-3] == v.shape[-3] and q.shape[-3] % k.shape[-3] == 0
    dtypes = {q.dtype, k.dtype, v.dtype}
    if dims_ok and same_head and len(dtypes) == 1 and attn_mask is None \
            and q.dtype in (torch.float16, torch.bfloat16) and head <= 256 and head % 8 == 0 \
            and (same_heads or gqa_ok):
        return SDPBackend.FLASH_ATTENTION
    alignment = 4 if q.dtype == torch.float32 else 8
    mask_ok = attn_mask is None or not attn_mask.requires_grad
    if dims_ok and same_head and len(dtypes) == 1 and same_heads and mask_ok \
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and head % alignment == 0:
        return SDPBackend.EFFICIENT_ATTENTION
    return SDPBackend.MATH


def choose(target: str, call: dict) -> SDPBackend:
    """The kernel SDPA would run for this call on ``target`` ("cpu" or "cuda")."""
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    if target == "cuda" and not torch.cuda.is_available():
        return cuda_choice(q, k, v, mask, call["dropout_p"], call["is_causal"], call["enable_gqa"])
    dev = "cuda" if target == "cuda" else "cpu"
    choice = torch._fused_sdp_choice(
        _standin(q, dev), _standin(k, dev), _standin(v, dev), _standin(mask, dev),
        call["dropout_p"], call["is_causal"], scale=call["scale"], enable_gqa=call["enable_gqa"])
    return SDPBackend(choice)


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive one the fused kernels take (what SDPA does before calling them)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    neg_inf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg_inf)


_DROPOUTS = (F.dropout, torch.dropout)


def _fused_dropout(func, args, kwargs):
    """Dropout as a CUDA tensor runs it: ``native_dropout``, which keeps a one-byte mask for the
    backward, where a meta (or CPU) tensor draws a noise tensor of its own dtype and keeps that
    (``is_fused_kernel_acceptable`` in aten/src/ATen/native/Dropout.cpp: CUDA, 0 < p < 1, not empty)."""
    names = ("input", "p", "training", "inplace") if func is F.dropout else ("input", "p", "train")
    call = dict(p=0.5, training=True, inplace=False)
    call.update(zip(names, args))
    call.update(kwargs)
    x, p = call["input"], call["p"]
    train = call["train"] if "train" in call else call["training"]
    if not (train and 0 < p < 1 and x.numel() > 0):
        return func(*args, **kwargs)
    out = torch.native_dropout(x, p, True)[0]
    return x.copy_(out) if call["inplace"] else out


class SdpaOnMeta(TorchFunctionMode):
    """On meta, run ``F.scaled_dot_product_attention`` with the kernel ``target`` would choose.

    ``paths`` counts the kernels chosen ({"flash": 12}, ...), for the profile's notes. Tensors
    made from Python data are made where the trackers see them (ckplan.meta_fromdata).
    """

    def __init__(self, target: str):
        super().__init__()
        if target not in TARGETS:
            raise ValueError(f"meta target {target!r} is not one of {', '.join(TARGETS)}")
        self.target = target
        self.paths: dict[str, int] = {}
        self._undo: list = []

    def __enter__(self):
        # A stack: the profiler enters the same mode again around a recompute in the backward.
        self._undo.append(_unpacked_on_meta(self.target))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._undo.pop()()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made = made_on_meta(func, args, kwargs)
        if made is not NOT_DONE:
            return made
        if func in _DROPOUTS and self.target == "cuda":
            return _fused_dropout(func, args, kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _bind(args, kwargs)
        backend = choose(self.target, call)
        name = _PATH_NAMES.get(backend, "math")
        self.paths[name] = self.paths.get(name, 0) + 1
        q, k, v = call["query"], call["key"], call["value"]
        p, causal, scale = call["dropout_p"], call["is_causal"], call["scale"]
        if backend == SDPBackend.FLASH_ATTENTION and self.target == "cpu":
            mask = _float_mask(call["attn_mask"], q.dtype)
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, p, causal, attn_mask=mask, scale=scale)
            return out
        if backend == SDPBackend.FLASH_ATTENTION:  # CUDA flash reads GQA's kv heads in place
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal, scale=scale)[0]
        if backend == SDPBackend.EFFICIENT_ATTENTION:
            mask = _float_mask(call["attn_mask"], q.dtype)
            need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, need_lse, p, causal, scale=scale)[0]
        return func(*args, **kwargs)  # math: what SDPA on meta tensors runs anyway

    def note(self) -> str:
        if not self.paths:
            return f"meta device: attention as on {self.target} (no scaled_dot_product_attention call seen)"
        counts = ", ".join(f"{name} x{n}" for name, n in sorted(self.paths.items()))
        return (f"meta device: attention modelled as {self.target}'s scaled_dot_product_attention "
                f"would run it ({counts} calls per step); --target cpu|cuda|h100|h200|a100|l4|FILE "
                "(meta_target= in the API) to change")


def _unpacked_on_meta(target: str = "cuda"):
    """Hugging Face's masks (transformers 4.5x and 5) read three values that meta tensors do not have:
    whether the position ids pack several sequences into one row (``find_packed_sequence_indices``),
    whether the padding mask is all ones (``fast_all``, which decides whether SDPA can run with
    ``is_causal`` and no mask tensor) and, in encoders, whether the first or last token is the pad
    token (a warning only); transformers 4's older masks ask the second too
    (``_older_masks_on_meta``). ckplan's batches hold one unpadded sequence per row (position ids
    0..T-1, no padding, no attention mask), so on meta the answers are what a real device gives
    for them: not packed, all ones, no warning. Mixture-of-experts matmuls run as on ``target``
    (:func:`_experts_matmul_as_on`). Returns the undo."""
    undo = []

    def patch(owner, name, make):
        orig = getattr(owner, name, None)
        if orig is not None:
            setattr(owner, name, make(orig))
            undo.append(lambda: setattr(owner, name, orig))

    def on_meta(t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "meta"

    mu = sys.modules.get("transformers.masking_utils")
    if mu is not None:
        patch(mu, "find_packed_sequence_indices", lambda orig: lambda ids, *a, **k: _packed(orig, ids, *a, **k))
        patch(mu, "fast_all", lambda orig: lambda t: True if on_meta(t) else orig(t))
        # Encoders: whether the padding mask is all ones decides whether SDPA runs without a mask.
        patch(mu, "_ignore_bidirectional_mask_sdpa",
              lambda orig: lambda pad, *a, **k: orig(None if on_meta(pad) else pad, *a, **k))
    mu2 = sys.modules.get("transformers.modeling_utils")
    pm = getattr(mu2, "PreTrainedModel", None) if mu2 is not None else None
    if pm is not None:
        patch(pm, "warn_if_padding_and_no_attention_mask",
              lambda orig: lambda self, ids, mask: None if on_meta(ids) else orig(self, ids, mask))

    undo.extend(_older_masks_on_meta())
    undo.append(_grouped_mm_on_meta())
    undo.append(_experts_matmul_as_on(target))
    undo.append(meta_autocast.on_meta_device())

    def undo_all() -> None:
        for u in reversed(undo):
            u()
    return undo_all


def _older_masks_on_meta() -> list:
    """transformers 4's masks (``modeling_attn_mask_utils``, still used by BERT, BART, DistilBERT,
    BioGPT, ... in 4.57) ask ``torch.all(mask == 1)`` of the padding mask. On meta the answer is the
    one a device gives for ckplan's unpadded batches, the mask computed the same way (its bytes):
    ``_prepare_4d_attention_mask_for_sdpa`` returns no mask, and ``_ignore_causal_mask_sdpa`` is
    asked with a mask of ones on the CPU. Returns the undos."""
    mau = sys.modules.get("transformers.modeling_attn_mask_utils")
    if mau is None:
        return []
    undo = []
    conv = getattr(mau, "AttentionMaskConverter", None)
    was = conv.__dict__.get("_ignore_causal_mask_sdpa") if conv is not None else None
    if isinstance(was, staticmethod):
        ignore = was.__func__

        def ignore_on_meta(attention_mask, *args, **kwargs):
            if not (isinstance(attention_mask, torch.Tensor) and attention_mask.device.type == "meta"):
                return ignore(attention_mask, *args, **kwargs)
            if attention_mask.dim() != 4:
                torch.all(attention_mask == 1)
            return ignore(torch.ones(attention_mask.shape, dtype=attention_mask.dtype), *args, **kwargs)
        conv._ignore_causal_mask_sdpa = staticmethod(ignore_on_meta)
        undo.append(lambda: setattr(conv, "_ignore_causal_mask_sdpa", was))
    prepare = getattr(mau, "_prepare_4d_attention_mask_for_sdpa", None)
    if prepare is not None:
        def prepare_on_meta(mask, dtype, tgt_len=None):
            if not (isinstance(mask, torch.Tensor) and mask.device.type == "meta"):
                return prepare(mask, dtype, tgt_len)
            torch.all(mask == 1)
            return None
        # the models import it by name: replaced wherever it was imported
        owners = [m for name, m in list(sys.modules.items())
                  if name.startswith("transformers") and getattr(m, "_prepare_4d_attention_mask_for_sdpa", None)
                  is prepare]
        for m in owners:
            m._prepare_4d_attention_mask_for_sdpa = prepare_on_meta
        undo.append(lambda: [setattr(m, "_prepare_4d_attention_mask_for_sdpa", prepare) for m in owners])
    return undo


def _packed(orig, ids, *args, **kwargs):
    """``find_packed_sequence_indices`` on meta position ids as a real device runs it on ckplan's
    (0..T-1 in every row): transformers 5 reads the result's values and answers None (not packed,
    so SDPA may skip the mask); transformers 4 returns the sequence indices, a tensor, whose mask
    every layer then gets. Asked of the version installed on a CPU stand-in; where it answers a
    tensor it is made on meta, by the same ops."""
    if not (isinstance(ids, torch.Tensor) and ids.device.type == "meta"):
        return orig(ids, *args, **kwargs)
    stand_in = torch.arange(ids.shape[-1], dtype=ids.dtype).expand(ids.shape)
    return None if orig(stand_in, *args, **kwargs) is None else orig(ids, *args, **kwargs)


def _experts_matmul_as_on(target: str):
    """transformers 5 picks its experts' matmul by the weights' device
    (``integrations.moe._can_use_grouped_mm``): ``torch._grouped_mm``, or, on a CPU with torch
    <= 2.8 (no CPU kernel there), a loop of ``mm`` in a custom op that keeps its tensors for
    backward otherwise. On meta the weights' device is meta, so for a CPU target the question is
    asked of CPU stand-ins (one element each, expanded to the tensors' shapes and dtypes); a CUDA
    target keeps transformers' answer for meta (``_grouped_mm``, as on an H100). Returns the undo."""
    moe = sys.modules.get("transformers.integrations.moe")
    can = getattr(moe, "_can_use_grouped_mm", None)
    if target != "cpu" or can is None:
        return lambda: None

    def stand_in(t):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            return torch.empty(1, dtype=t.dtype).expand(t.shape)
        return t

    def as_on_cpu(*args, **kwargs):
        return can(*(stand_in(a) for a in args), **{k: stand_in(v) for k, v in kwargs.items()})

    moe._can_use_grouped_mm = as_on_cpu
    return lambda: setattr(moe, "_can_use_grouped_mm", can)


def _grouped_mm_on_meta():
    """Mixture-of-experts layers (transformers 5's ``grouped_mm`` experts: Mixtral, Qwen-MoE,
    DeepSeek, OLMoE, ...) multiply every token's rows by its expert's weights with
    ``torch._grouped_mm``, whose CPU kernel takes fp32 but whose meta kernel accepts bf16 only.
    The output's shape does not depend on the routing (tokens x top-k rows), so on meta the
    output is made as torch's own meta kernel makes it (the input's dtype) for any dtype; the
    backward (two more ``_grouped_mm`` calls) follows. Registered for the meta pass only;
    returns the undo."""
    try:
        from torch._meta_registrations import _create_grouped_mm_output_tensor
    except ImportError:  # a torch without it has no grouped_mm experts either
        return lambda: None
    if not hasattr(torch.ops.aten, "_grouped_mm"):
        return lambda: None

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    lib = torch.library.Library("aten", "IMPL")
    try:
        # torch 2.9-2.12 register a Python meta kernel of their own (bf16 only): replace it for
        # the pass (the undo restores it); older ones have only the C++ kernel and no override flag
        if "allow_override" in inspect.signature(lib.impl).parameters:
            lib.impl("_grouped_mm", meta, "Meta", allow_override=True)
        else:
            lib.impl("_grouped_mm", meta, "Meta")
    except RuntimeError:  # a kernel that cannot be replaced: torch's own stays
        lib._destroy()
        return lambda: None
    return lib._destroy
