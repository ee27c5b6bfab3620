"""``export_plan``: the plan checked, its target's exporter run, selective options stored whole."""
from __future__ import annotations

from collections.abc import Callable

from ..errors import UsageError
from ..planner.plan import STORE, Plan
from .base import TARGETS, Ctx, Export
from .layers import header
from .targets import EXPORTERS


def export_plan(plan: Plan, target: str, *, chain_path: str, layer_class: str | None = None,
                model_name: str = "", policy: tuple[str, str] | None = None,
                fits: Callable[[Plan], bool] | None = None) -> Export:
    """Render ``plan`` for ``target`` (one of :data:`TARGETS`).

    ``chain_path``: the dotted path of the layer container in the user's model (``Profile.chain``,
    e.g. ``"transformer.h"``); ``layer_class``: the chain layers' class name (``Block``), used where
    a framework selects layers by class; ``model_name``: shown in the header comment only;
    ``policy``: FSDP2's MixedPrecisionPolicy the plan is for, ``(param dtype, reduce dtype)``
    (``("bf16", "fp32")``), written into the fsdp and torchtitan snippets; ``fits``: whether a
    plan fits the budget ``plan`` was made for, so that a target that cannot express ``plan`` takes
    the nearest plan it can express that fits (torchtitan's every-N), not merely the nearest.
    """
    plan = getattr(plan, "plan", plan)  # a PlanResult
    if not isinstance(plan, Plan):
        raise UsageError(f"export needs a Plan, got {type(plan).__name__}",
                         tip="pass PlanResult.plan or ckplan.load_plan('plan.json')")
    key = str(target).strip().lower()
    if key not in EXPORTERS:
        raise UsageError(f"unknown export target {target!r}", tip=f"choose one of {', '.join(TARGETS)}")
    if not chain_path or not isinstance(chain_path, str):
        raise UsageError("export needs the chain path (the dotted path of the layer container), "
                         f"got {chain_path!r}", tip="take it from the profile: Profile.chain, e.g. 'transformer.h'")
    ctx = Ctx(chain_path, layer_class, model_name, policy, fits)
    return _copies_said(plan, _export(plan, key, ctx))


def _export(plan: Plan, key: str, ctx: Ctx) -> Export:
    if not plan.uses_options:
        return EXPORTERS[key](plan, ctx)
    # Options: none of the targets' one-line settings carries a per-layer SAC policy or offload,
    # so the export applies the same checkpoints with those layers stored whole.
    opts = {i: o for i, o in enumerate(plan.options()) if o != STORE}
    plain = EXPORTERS[key](plan.with_options({}), ctx)
    used = ", ".join(f"{i}: {o}" for i, o in opts.items())
    what = "per-layer options (selective checkpointing, offload to host memory)"
    line = (f"# Not exact: the plan stores layers with {what} ({used}); {key} "
            "stores them whole here, which keeps more memory than planned.")
    # the plain export's message speaks of the plan without its options
    rest = plain.message.replace("applies this plan exactly", "applies the plan without its options exactly")
    msg = (f"{key} cannot express {what} (layer: option {used}); the closest it applies "
           "stores those layers whole, which keeps more for backward than planned. " + rest)
    text = plain.text.split("\n")
    text[0:1] = [*header(plan, ctx), line]
    return Export(plain.target, "\n".join(text), False, plain.closest_plan, msg)



def _copies_said(plan: Plan, out: Export) -> Export:
    """Where a checkpoint starts at a layer that changes its input in place (``copy_inputs``),
    ``apply_plan`` gives it a copy and a framework's checkpointing does not: said in the snippet
    and the message."""
    starts = {r.start for r in plan.recomputed_ranges()} & {int(i) for i in plan.params.get("copy_inputs", ())}
    if not starts:
        return out
    layers = ", ".join(str(i) for i in sorted(starts))
    why = (f"layers {layers} change their input in place and a checkpoint starts at them: ckplan.apply_plan gives "
           f"them a copy, {out.target} does not (its checkpoint would recompute from the changed input); use "
           "ckplan.apply_plan, or make those ops out of place")
    lines = out.text.split("\n")
    lines.insert(1, f"# Not exact: {why}.")
    return Export(out.target, "\n".join(lines), False, out.closest_plan, f"{why}. {out.message}")
