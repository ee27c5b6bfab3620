"""The names users choose from (strategies, devices, precisions, optimizers), defined once.

Pure Python, no torch and no typer: the CLI (typer validates these enums), the Python API and the
spec all read them from here. Each enum's members are ``str`` subclasses, so ``Precision.bf16 ==
"bf16"`` and a member can go wherever a plain name went (``enum.StrEnum`` semantics; written as
``str, Enum`` with ``__str__`` so it also runs on Python 3.10, which the package still supports).
"""
from __future__ import annotations

from enum import Enum

from .errors import UsageError


class _Names(str, Enum):
    def __str__(self) -> str:  # "bf16", not "Precision.bf16", in messages and f-strings
        return self.value

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value, *, what: str):
        """The member named ``value``, or a :class:`UsageError` naming ``what`` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise UsageError(f"{what}={value!r} is not one of {', '.join(cls.names())}") from None


class Strategy(_Names):
    none = "none"
    every_k = "every-k"
    sqrtn = "sqrtn"
    chen = "chen"
    dp = "dp"
    selective = "selective"  # every layer stored with one selective policy (needs options)
    dp_layer = "dp-layer"  # dp without selective options: whole layers stored or recomputed


class StrategyOrAll(_Names):
    """What ``plan --strategy`` accepts: one strategy, or ``all`` to compare them."""

    none = "none"
    every_k = "every-k"
    sqrtn = "sqrtn"
    chen = "chen"
    dp = "dp"
    selective = "selective"
    dp_layer = "dp-layer"
    all = "all"


class Device(_Names):
    auto = "auto"  # cuda when PyTorch sees a GPU, else cpu
    cpu = "cpu"
    cuda = "cuda"
    meta = "meta"  # fake tensors: sizes and FLOPs, nothing allocated


class Precision(_Names):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Optimizer(_Names):
    adamw = "adamw"
    sgd_momentum = "sgd-momentum"
    sgd = "sgd"


# Spellings accepted in specs and the API besides the canonical names above.
OPTIMIZER_ALIASES = {"sgd_momentum": "sgd-momentum", "momentum": "sgd-momentum", "adam": "adamw"}


class Parallel(_Names):
    """How the ranks hold the model (``--parallel``)."""

    fsdp = "fsdp"
    ddp = "ddp"


class CompileScope(_Names):
    """What ``--compile`` compiles for ckplan's rows (``--compile-scope``)."""

    layers = "layers"
    model = "model"


class ExportTarget(_Names):
    """Frameworks ``ckplan plan --export`` writes a snippet for (ckplan.export)."""

    hf = "hf"
    torchtitan = "torchtitan"
    lightning = "lightning"
    fsdp = "fsdp"


class Fmt(_Names):
    """What a command writes to stdout."""

    table = "table"
    json = "json"
    csv = "csv"


class DocFmt(_Names):
    """What a command with no rows to tabulate (``calibrate``) writes to stdout."""

    table = "table"
    json = "json"


STRATEGIES = Strategy.names()
DEVICES = Device.names()
PRECISIONS = Precision.names()
OPTIMIZERS = Optimizer.names()

# Selective recompute options a plan may give a layer besides ``store``, named here and nowhere
# else: ckplan.sac runs them, and a plan file is checked against them without torch.
# A SAC policy for any layer: option name -> what it keeps (ckplan.sac has the ops).
SAC_POLICIES: dict[str, str] = {
    "sac-compute": "keep matmul/attention/conv outputs, recompute pointwise, norms, activations",
    "sac-linear": "keep linear/conv outputs, recompute the attention core and pointwise ops",
    "sac-attn": "keep linear, norm and activation outputs; recompute the attention core",
}
# Compiled layers only: option name -> torch._functorch.config.activation_memory_budget.
MINCUT_BUDGETS: dict[str, float] = {"mincut-80": 0.8, "mincut-50": 0.5, "mincut-20": 0.2}
SELECTIVE_OPTIONS: tuple[str, ...] = (*SAC_POLICIES, *MINCUT_BUDGETS)
# Every option a plan file may name besides "store": the selective ones, "offload" (a layer
# stored at the top level with its saved tensors in pinned host memory; ckplan.planner.plan_items),
# and a SAC policy with what it keeps offloaded ("sac-compute+offload"; eager layers, torch >= 2.14).
PLAN_OPTIONS: tuple[str, ...] = (*SELECTIVE_OPTIONS, "offload", *(f"{p}+offload" for p in SAC_POLICIES))

# Rows `bench --compare` can run beside ckplan's strategies (ckplan.peers): Hugging Face's per-layer
# checkpointing, PyTorch's selective activation checkpointing, torch.compile's memory budget.
PEERS = ("hf", "sac-policy", "offload-all", "offload-attn", "torch-compile", "torch-compile-nobudget")
OFFLOAD_PEERS = ("offload-all", "offload-attn")  # CUDA only: a CPU's activations are in host memory already
