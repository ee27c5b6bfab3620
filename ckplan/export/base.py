"""What an export is: the targets, the result (:class:`Export`) and what every exporter is given."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..planner.plan import Plan

TARGETS = ("hf", "torchtitan", "lightning", "fsdp")


FALLBACK = ('Exact in your own training loop: ckplan.apply_plan(model, "plan.json") '
            "(write it with `ckplan plan ... -o plan.json`); it runs any plan, nested checkpoints included.")


@dataclass(frozen=True)
class Export:
    """A plan rendered for one framework."""

    target: str
    text: str  # the snippet or config, ready to paste
    exact: bool  # the text applies exactly the input plan
    closest_plan: Plan  # what the text applies (the input plan itself when exact)
    message: str  # what differs and why, and the exact fallback

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "exact": self.exact, "text": self.text,
                "message": self.message, "closest_plan": self.closest_plan.to_dict()}


@dataclass(frozen=True)
class Ctx:
    """What every exporter is given besides the plan: where the chain is, its layer class, the name."""

    chain_path: str
    layer_class: str | None
    model_name: str
    # FSDP2's MixedPrecisionPolicy the plan was made under: (param dtype, reduce dtype), as
    # ckplan names them ("bf16", "fp32"); None: no policy
    policy: tuple[str, str] | None = None
    # whether a plan fits the budget the plan was made for (None: no budget to meet); a target
    # that can express several plans near it takes one that fits
    fits: Callable[[Plan], bool] | None = None
