"""Device models: what one op costs on a device ckplan does not run on (``--device meta``).

A profile on fake tensors knows every op's FLOPs and the bytes it reads and writes, but not its
time. A device model prices each op as a roofline,

    time = max(FLOPs / (rate x matmul efficiency), bytes / (bandwidth x memory efficiency), dispatch)

where ``rate`` is the device's matrix rate for the op's dtype when the op is a matrix product
(matmul, convolution, attention kernel) and its vector rate otherwise, and ``dispatch`` is what
eager PyTorch spends per op on the host: a kernel shorter than that leaves the device waiting, so
small layers cost their op count, not their FLOPs. View ops (``view``, ``transpose``, ``split``...)
launch no kernel but still pass through the dispatcher and autograd: each costs the host
``view_ms``. A layer stored with a selective option (SAC) pays ``sac_dispatch_ms`` more per op,
views included, of its forward and of its recompute (the policy runs in Python for each op, and
the recompute replays every op of the forward through it, the ones it kept included).

The built-in models carry the vendors' data-sheet figures (dense rates, no sparsity) and efficiency
factors typical of eager PyTorch; ``ckplan calibrate`` measures the same fields on the machine it runs
on and saves them as JSON, which ``--target FILE`` reads back. Rates are FLOP/s, bandwidths bytes/s,
times milliseconds. Pure Python: nothing here imports torch.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import SpecError
from .units import GB, TFLOP, MiB

DEVICE_FORMAT = "ckplan.device/1"
MATMUL, ATTENTION, VECTOR, VIEW = "matmul", "attention", "vector", "view"


@dataclass(frozen=True)
class DeviceModel:
    name: str
    kind: str  # "cuda" or "cpu": which kernels a meta profile for it follows (attention, optimizer)
    matmul_flops: Mapping[str, float]  # dtype name (torch's, e.g. "float32") -> FLOP/s of matrix products
    vector_flops: Mapping[str, float]  # dtype name -> FLOP/s of everything else
    memory_bw: float  # bytes/s between the device's memory and its cores
    dispatch_ms: float  # host time per eager op; an op never takes less
    matmul_eff: float = 0.75  # share of the matrix rate a large eager matmul reaches
    attention_eff: float = 0.75  # share of the matrix rate a fused attention kernel reaches
    memory_eff: float = 0.8  # share of the bandwidth a large elementwise op reaches
    sac_dispatch_ms: float = 0.0  # extra host time per op (views included) under a selective-checkpoint policy
    view_ms: float = 0.0  # host time per view op (no kernel); 0: views not priced
    # host time of one saved tensor's hook under a non-reentrant checkpoint, per call (packed in the
    # first forward, packed again in the recompute, unpacked in the backward)
    ckpt_hook_ms: float = 0.0
    link_bw: float = 0.0  # bytes/s per device to its peers in one node (NVLink); 0: unknown
    network_bw: float = 0.0  # bytes/s per device across nodes (InfiniBand); 0: unknown
    host_bw: float = 0.0  # bytes/s each way between device and pinned host memory; 0: unknown
    # device memory the runtime holds outside any tensor once a step has run, part of every peak:
    # on CUDA the cuBLAS and cuBLASLt workspaces of the two threads that run matmuls (the forward's
    # and autograd's backward thread); a meta profile for this device counts it; 0: none or unknown
    runtime_bytes: int = 0
    source: str = ""  # where the figures come from
    extra: Mapping[str, Any] = field(default_factory=dict)  # what a calibration measured beside them

    def rate(self, op_kind: str, dtype: str) -> float:
        """FLOP/s for ``op_kind`` (MATMUL, ATTENTION or VECTOR) in ``dtype`` (float32 when unknown)."""
        table = self.vector_flops if op_kind == VECTOR else self.matmul_flops
        return table.get(dtype) or table.get("float32") or max(table.values())

    def op_ms(self, op_kind: str, dtype: str, flops: float, nbytes: float) -> float:
        """Milliseconds of one op on the device: its roofline time, at least one dispatch
        (module doc); a view launches nothing (0)."""
        if op_kind == VIEW:
            return 0.0
        eff = {MATMUL: self.matmul_eff, ATTENTION: self.attention_eff}.get(op_kind, 1.0)
        compute = flops / (self.rate(op_kind, dtype) * eff) if flops else 0.0
        memory = nbytes / (self.memory_bw * self.memory_eff) if nbytes else 0.0
        return max(compute * 1e3, memory * 1e3, self.dispatch_ms)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("matmul_flops", "vector_flops", "extra"):
            d[key] = dict(d[key])
        return {"format": DEVICE_FORMAT, **d}


@dataclass(frozen=True)
class OpCost:
    """One op of a profiled pass, as a device model prices it."""
    kind: str  # MATMUL, ATTENTION (a fused attention kernel), VECTOR or VIEW (no kernel, no bytes)
    dtype: str
    flops: int
    nbytes: int  # bytes its inputs and outputs occupy (read once, written once)


def host_ms(device: DeviceModel, ops: Iterable[OpCost]) -> float:
    """What the host spends dispatching ``ops``: a dispatch per kernel, ``view_ms`` per view."""
    return sum(device.view_ms if o.kind == VIEW else device.dispatch_ms for o in ops)


def ops_ms(device: DeviceModel, ops: Iterable[OpCost], *, sac: bool = False, sac_ops: int = 0,
           host_extra_ms: float = 0.0) -> float:
    """Milliseconds of ``ops`` run one after another on ``device``: the host dispatches them while
    the device runs the ones before, so the slower of the two sets the time: max(sum of the ops'
    roofline times, the host's: their dispatch (:func:`host_ms`), SAC's per-op cost for each of
    them when ``sac`` (run under a policy) and for ``sac_ops`` more (ops a recompute replays
    through the policy without running them: the ones it kept), and ``host_extra_ms``, what else
    the host does meanwhile: a checkpoint's hooks)."""
    ops = list(ops)
    policy = (len(ops) if sac else 0) + sac_ops
    host = host_ms(device, ops) + policy * device.sac_dispatch_ms + host_extra_ms
    work = sum(device.op_ms(o.kind, o.dtype, o.flops, o.nbytes) for o in ops)
    return max(work, host)


def allreduce_ms(device: DeviceModel, nbytes: int, world_size: int, *, nodes: int = 1) -> float:
    """A ring all-reduce of ``nbytes`` over ``world_size`` devices: each sends and receives
    2 (n-1)/n of the bytes, at the link bandwidth within a node and the network's across nodes
    (0 when the bandwidth is unknown or one device)."""
    bw = device.network_bw if nodes > 1 else device.link_bw
    if world_size <= 1 or bw <= 0:
        return 0.0
    return 2 * (world_size - 1) / world_size * nbytes / bw * 1e3


def gather_ms(device: DeviceModel, nbytes: int, world_size: int, *, nodes: int = 1) -> float:
    """An all-gather (or a reduce-scatter) whose full result is ``nbytes``: (n-1)/n of it moves."""
    bw = device.network_bw if nodes > 1 else device.link_bw
    if world_size <= 1 or bw <= 0:
        return 0.0
    return (world_size - 1) / world_size * nbytes / bw * 1e3


# Host time per eager op that launches a kernel, per view op, what a SAC policy adds per op, and a
# checkpoint's hook per saved tensor and call, on the host of an H200 with torch 2.11; and the share
# of the matrix rate PyTorch's attention kernels reach (in fp32 they do not use the tensor cores; in
# bf16 a FlashAttention-2-class kernel reaches about as much of the bf16 rate). Chosen from a
# sweep against the H200 benches in reports/cuda (scripts/meta_vs_gpu.py;
# gpt2-small at 2 x 512 is bound by the host). Other GPUs' hosts differ; `ckplan calibrate`
# measures yours.
HOST_DISPATCH_MS = 0.022
HOST_VIEW_MS = 0.003
HOST_SAC_DISPATCH_MS = 0.025
HOST_CKPT_HOOK_MS = 0.0035
ATTENTION_EFF = 0.35


# The CUDA runtime's blocks in a training step (DeviceModel.runtime_bytes): a cuBLAS workspace and
# a cuBLASLt workspace per thread that runs matmuls, two threads. torch's defaults: a 32 MiB cuBLAS
# workspace on Hopper and later, :4096:2:16:8 (8.1 MiB) before, and 1 MiB for cuBLASLt. A CUDA profile
# measured 2 x (32 + 1) MiB on an H200 with torch 2.11 (totals.runtime_bytes, reports/cuda/logs);
# CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE change them, `ckplan calibrate` measures them.
HOPPER_RUNTIME_BYTES = 2 * (32 * MiB + 1 * MiB)
AMPERE_RUNTIME_BYTES = 2 * (2 * 4096 * 1024 + 8 * 16 * 1024 + 1 * MiB)


def _gpu(name: str, *, fp32: float, tf32: float, bf16: float, bw: float, link: float, net: float,
         host: float, runtime: int, sheet: str) -> DeviceModel:
    # fp32 matmuls run on CUDA cores unless the user allows TF32 (torch's default does not);
    # elementwise work runs at the fp32 vector rate whatever the dtype (it is bandwidth-bound).
    mm = {"float32": fp32 * TFLOP, "tf32": tf32 * TFLOP, "bfloat16": bf16 * TFLOP, "float16": bf16 * TFLOP,
          "float64": fp32 / 2 * TFLOP}
    vec = {"float32": fp32 * TFLOP, "bfloat16": fp32 * TFLOP, "float16": fp32 * TFLOP, "float64": fp32 / 2 * TFLOP}
    return DeviceModel(name=name, kind="cuda", matmul_flops=mm,
                       vector_flops=vec, memory_bw=bw * GB, dispatch_ms=HOST_DISPATCH_MS,
                       sac_dispatch_ms=HOST_SAC_DISPATCH_MS, view_ms=HOST_VIEW_MS, ckpt_hook_ms=HOST_CKPT_HOOK_MS,
                       attention_eff=ATTENTION_EFF, link_bw=link * GB,
                       network_bw=net * GB, host_bw=host * GB, runtime_bytes=runtime,
                       source=f"vendor data sheet ({sheet}); host costs and attention share fitted to H200 runs "
                              "(reports/cuda)")


BUILTIN: Mapping[str, DeviceModel] = MappingProxyType({
    "h100": _gpu("h100", fp32=67, tf32=494.7, bf16=989.4, bw=3350, link=450, net=50, host=55,
                 runtime=HOPPER_RUNTIME_BYTES,
                 sheet="NVIDIA H100 SXM5: 989 TFLOP/s bf16 dense, 67 fp32, HBM3 3.35 TB/s, NVLink 900 GB/s"),
    "h200": _gpu("h200", fp32=67, tf32=494.7, bf16=989.4, bw=4800, link=450, net=50, host=55,
                 runtime=HOPPER_RUNTIME_BYTES,
                 sheet="NVIDIA H200 SXM: 989 TFLOP/s bf16 dense, 67 fp32, HBM3e 4.8 TB/s, NVLink 900 GB/s"),
    "a100": _gpu("a100", fp32=19.5, tf32=156, bf16=312, bw=2039, link=300, net=25, host=25,
                 runtime=AMPERE_RUNTIME_BYTES,
                 sheet="NVIDIA A100 SXM4 80GB: 312 TFLOP/s bf16 dense, 19.5 fp32, HBM2e 2.04 TB/s, NVLink 600 GB/s"),
    "l4": _gpu("l4", fp32=30.3, tf32=60, bf16=121, bw=300, link=0, net=0, host=25,
               runtime=AMPERE_RUNTIME_BYTES,
               sheet="NVIDIA L4: 121 TFLOP/s bf16 dense, 30.3 fp32, GDDR6 300 GB/s, PCIe Gen4"),
})
# The generic kinds a meta profile already knew: `cuda` prices as an H100, `cpu` needs a calibration.
DEFAULT_FOR_KIND = {"cuda": "h100"}


def device_from_dict(d: Any, *, where: str = "device profile") -> DeviceModel:
    """A :class:`DeviceModel` from its JSON object, every field checked."""
    if not isinstance(d, dict):
        raise SpecError(f"{where} must be a JSON object, not {type(d).__name__}",
                        tip="write one with `ckplan calibrate -o device.json`")
    fmt = d.get("format", DEVICE_FORMAT)
    if fmt != DEVICE_FORMAT:
        raise SpecError(f"{where} format {str(fmt)[:60]!r} is not {DEVICE_FORMAT!r}",
                        tip="write it again with this ckplan: `ckplan calibrate -o device.json`")
    names = {f for f in DeviceModel.__dataclass_fields__}
    unknown = sorted(set(d) - names - {"format"})
    if unknown:
        raise SpecError(f"{where} key {unknown[0]!r} is not one of {', '.join(sorted(names))}")
    missing = [k for k in ("name", "kind", "matmul_flops", "vector_flops", "memory_bw", "dispatch_ms") if k not in d]
    if missing:
        raise SpecError(f"{where} lacks {missing[0]!r}", tip="write one with `ckplan calibrate -o device.json`")
    if d["kind"] not in ("cuda", "cpu"):
        raise SpecError(f"{where} kind {d['kind']!r} is not cuda or cpu")
    for key in ("matmul_flops", "vector_flops"):
        table = d[key]
        if not isinstance(table, dict) or not table or not all(_positive(v) for v in table.values()):
            raise SpecError(f"{where} {key} must map dtype names to positive FLOP/s, got {str(table)[:80]}")
    for key in ("memory_bw", "dispatch_ms", "matmul_eff", "attention_eff", "memory_eff", "sac_dispatch_ms",
                "view_ms", "ckpt_hook_ms", "link_bw", "network_bw", "host_bw"):
        if key in d and not (_number(d[key]) and d[key] >= 0 and (key != "memory_bw" or d[key] > 0)):
            raise SpecError(f"{where} {key} must be a non-negative number, got {str(d[key])[:40]}")
    if "runtime_bytes" in d and not (isinstance(d["runtime_bytes"], int) and not isinstance(d["runtime_bytes"], bool)
                                     and d["runtime_bytes"] >= 0):
        raise SpecError(f"{where} runtime_bytes must be a non-negative integer (bytes), got "
                        f"{str(d['runtime_bytes'])[:40]}", tip="write it again with `ckplan calibrate -o device.json`")
    for key in ("matmul_eff", "attention_eff", "memory_eff"):
        if key in d and not 0 < d[key] <= 1:
            raise SpecError(f"{where} {key} must be in (0, 1], got {d[key]}")
    body = {k: v for k, v in d.items() if k != "format"}
    body["matmul_flops"] = {str(k): float(v) for k, v in body["matmul_flops"].items()}
    body["vector_flops"] = {str(k): float(v) for k, v in body["vector_flops"].items()}
    return DeviceModel(**body)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v: Any) -> bool:
    return _number(v) and v > 0


def load_device(name_or_path: str | Path) -> DeviceModel:
    """A built-in device model by name (``h100``, ``h200``, ``a100``, ``l4``), or one saved as JSON."""
    key = str(name_or_path).lower()
    if key in BUILTIN:
        return BUILTIN[key]
    if key in DEFAULT_FOR_KIND:
        return BUILTIN[DEFAULT_FOR_KIND[key]]
    path = Path(name_or_path)
    if not path.is_file():
        raise SpecError(f"device {str(name_or_path)[:80]!r} is neither a built-in device model "
                        f"({', '.join(BUILTIN)}) nor a device profile file",
                        tip="measure yours with `ckplan calibrate -o device.json` and pass --target device.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(f"device profile {path} cannot be read: {e}") from None
    return device_from_dict(data, where=f"device profile {path}")


def save_device(device: DeviceModel, path: str | Path) -> None:
    Path(path).write_text(json.dumps(device.to_dict(), indent=2) + "\n")


def target_device(meta_target: str | None, default_kind: str) -> tuple[str, DeviceModel | None]:
    """What a meta profile stands for: the kind of device whose kernels it follows ("cpu" or
    "cuda") and the device model that prices its time (None: FLOPs at an assumed rate, for a CPU
    with no calibration). ``meta_target``: "cpu", "cuda" (priced as an H100), a built-in device
    name, or a device profile file; None: ``default_kind``."""
    name = default_kind if meta_target is None else str(meta_target)
    if name == "cpu":
        return "cpu", None
    device = load_device(name)
    return device.kind, device
