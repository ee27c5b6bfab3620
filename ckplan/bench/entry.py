"""A bench row while it runs: its plan, its predictions and what was measured."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..bench_records import OK
from ..peers import CompiledPeer
from ..planner import Plan


@dataclass
class Entry:
    name: str
    plan: Plan | None
    predicted_peak: int | None = None
    predicted_fb_peak: int | None = None
    predicted_act: int | None = None
    predicted_overhead: float | None = None
    status: str = OK
    message: str = ""
    loss: float | None = None
    final_loss: float | None = None
    grad_diff: float | None = None
    grad_tol: float | None = None
    mem: dict = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    kind: str = "ckplan"  # or "peer" (ckplan.peers)
    compiled: CompiledPeer | None = None  # the torch-compile peers
    plan_text: str = ""  # the plan column when there is no ckplan plan
    warm_graphs: int = 0  # graphs the compiled peer had compiled when the warm-up ended
    mem_source: str = ""  # "profiler" when the CPU memory step was read from the PyTorch profiler

    @property
    def runnable(self) -> bool:
        return self.plan is not None or self.compiled is not None

    @property
    def is_reference(self) -> bool:
        """Eager and without checkpoints: what the gradient check may judge the others against."""
        return self.compiled is None and self.plan is not None and self.plan.n_checkpoints == 0

