"""Turn a ckplan Plan into the snippet or config that applies it in a training framework.

``export_plan(plan, target, chain_path=...)`` returns an :class:`Export`: the text to paste, whether
it reproduces the plan exactly, the plan it actually applies (``closest_plan``) and an honest
message. Pure Python (no torch import): the snippets are text, run by the user.

What each target can express (checked in the sources named)
-------------------------------------------------------------

None of the four can express a checkpoint that spans several layers or nests inside another: each
wraps *one module* (a chain layer) in ``torch.utils.checkpoint``. So a plan is expressible only when
every top-level item is ``Store(i)`` or ``Checkpoint(i, i + 1)`` (a *per-layer* plan), and each
target then allows these sets of checkpointed layers:

* ``fsdp`` -- PyTorch's ``apply_activation_checkpointing(model, checkpoint_wrapper_fn=
  checkpoint_wrapper, check_fn=...)`` (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py,
  torch 2.13) wraps every submodule for which ``check_fn`` is true; ``checkpoint_wrapper`` defaults
  to non-reentrant checkpointing. Any set of layers. It works on a plain module, before any
  wrapping (``fully_shard`` / ``torch.compile``), the order torchtitan uses; tests/test_export.py
  runs it under FSDP2's ``fully_shard`` (one gloo rank on CPU). DDP and FSDP1 are not run here.
* ``lightning`` -- Lightning's ``FSDPStrategy(activation_checkpointing_policy={Block})`` becomes
  ``apply_activation_checkpointing(..., auto_wrap_policy=ModuleWrapPolicy({Block}))``: every
  instance of the class (lightning/fabric/strategies/fsdp.py, ``_activation_checkpointing_kwargs``
  and ``_setup_activation_checkpointing``, Lightning-AI/pytorch-lightning 7f0c343). Any set of
  layers is expressible from the ``LightningModule.configure_model`` hook (any strategy) with the
  same ``apply_activation_checkpointing`` call as ``fsdp``; the export uses that, and names the
  class policy too when the plan checkpoints every layer.
* ``hf`` -- transformers 5.23: ``model.activation_checkpointing_enable(activation_checkpointing_kwargs,
  every_n_layers=N)`` (``gradient_checkpointing_enable`` is its deprecated alias) sets
  ``gradient_checkpointing = (index % N == 0)`` on every ``GradientCheckpointingLayer`` in
  ``model.modules()`` order, i.e. layers 0, N, 2N, ... (modeling_utils.py
  ``_set_gradient_checkpointing``); ``TrainingArguments(activation_checkpointing=True,
  activation_checkpointing_kwargs={"every_n_layers": N})`` does the same from ``Trainer.train()``.
  Each ``GradientCheckpointingLayer`` reads its own flag at call time (modeling_layers.py,
  ``forward_with_checkpointing``), so setting ``layer.gradient_checkpointing`` after enabling gives
  any set of layers. The every-N one-liner is exact only when the chain layers are the model's only
  ``GradientCheckpointingLayer``s (no vision tower or encoder before them); the per-layer form
  always is. Models whose layers do not subclass ``GradientCheckpointingLayer`` (some older
  architectures still checkpoint from the model's loop) only have every layer or none; the
  snippet checks and points to ``--export fsdp`` then.
* ``torchtitan`` -- torchtitan <= 0.2.2 (TOML job config): ``[activation_checkpoint] mode =
  "none" | "full" | "selective"`` with ``selective_ac_option = "N"`` wrapping the blocks of
  ``model.layers`` whose 1-based count is a multiple of N, i.e. layers N-1, 2N-1, ... (0-based;
  torchtitan/distributed/activation_checkpoint.py ``_apply_layer_sac``, tag v0.2.2; the counter
  is global, so several model chunks on one rank continue each other's count). Torchtitan 0.3
  removed the layer-frequency option (pytorch/torchtitan#2357, March 2026): there only no
  checkpointing, ``FullAC`` (every layer) or op-level ``SelectiveAC`` remain, and op-level
  selective recomputation is not a ckplan plan.

Closest expressible plan (when ``exact`` is False)
--------------------------------------------------

* ``fsdp``, ``lightning``, ``hf``: every layer the plan recomputes (inside any checkpoint) is
  checkpointed alone, the others stored. Same recomputed layers, each recomputed once (a nested
  plan recomputes some several times), but a multi-layer segment ``[s, t)`` keeps only its input
  and last output while per-layer checkpoints keep the inputs of layers ``s+1..t-1`` as well (more
  held for backward; the peak can still be lower, each recompute being one layer: the CLI prints
  both predicted peaks).
* ``torchtitan``: with ``c`` layers recomputed by the plan, the every-N pattern with the fewest
  checkpointed layers that is still at least ``c`` (the largest N with ``n // N >= c``; N = 1 is
  ``mode = "full"``, c = 0 is ``mode = "none"``). For similar layers that does not raise the peak
  beyond what c single-layer checkpoints give; which layers differ is stated in the message.

Selective options (``Store(i, "sac-...")``) are not expressed by any target: the export applies the
same checkpoints with those layers stored whole, says so, and is not exact.

Every message also names the exact fallback: ``ckplan.apply_plan(model, "plan.json")`` runs any
plan, nested checkpoints included, inside the user's own training loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import UsageError
from .planner.plan import STORE, Checkpoint, Plan, Store

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


def export_plan(plan: Plan, target: str, *, chain_path: str, layer_class: str | None = None,
                model_name: str = "") -> Export:
    """Render ``plan`` for ``target`` (one of :data:`TARGETS`).

    ``chain_path``: the dotted path of the layer container in the user's model (``Profile.chain``,
    e.g. ``"transformer.h"``); ``layer_class``: the chain layers' class name (``Block``), used where
    a framework selects layers by class; ``model_name``: shown in the header comment only.
    """
    plan = getattr(plan, "plan", plan)  # a PlanResult
    if not isinstance(plan, Plan):
        raise UsageError(f"export needs a Plan, got {type(plan).__name__}",
                         tip="pass PlanResult.plan or ckplan.load_plan('plan.json')")
    key = str(target).strip().lower()
    if key not in _EXPORTERS:
        raise UsageError(f"unknown export target {target!r}", tip=f"choose one of {', '.join(TARGETS)}")
    if not chain_path or not isinstance(chain_path, str):
        raise UsageError("export needs the chain path (the dotted path of the layer container), "
                         f"got {chain_path!r}", tip="take it from the profile: Profile.chain, e.g. 'transformer.h'")
    ctx = _Ctx(chain_path, layer_class, model_name)
    if not plan.uses_options:
        return _EXPORTERS[key](plan, ctx)
    # Selective options: none of the targets' one-line settings carries a per-layer SAC policy,
    # so the export applies the same checkpoints with those layers stored whole.
    opts = {i: o for i, o in enumerate(plan.options()) if o != STORE}
    plain = _EXPORTERS[key](plan.with_options({}), ctx)
    used = ", ".join(f"{i}: {o}" for i, o in opts.items())
    line = (f"# Not exact: the plan stores layers with selective options ({used}); {key} "
            "stores them whole here, which keeps more memory than planned.")
    # the plain export's message speaks of the plan without its options
    rest = plain.message.replace("applies this plan exactly", "applies the plan without its options exactly")
    msg = (f"{key} cannot express selective options (layer: option {used}); the closest it applies "
           "stores those layers whole, which keeps more for backward than planned. " + rest)
    text = plain.text.split("\n")
    text[0:1] = [*_header(plan, ctx), line]
    return Export(plain.target, "\n".join(text), False, plain.closest_plan, msg)


# ---- what a plan does, in the terms the targets speak ---------------------------------------
@dataclass(frozen=True)
class _Ctx:
    chain_path: str
    layer_class: str | None
    model_name: str


def recomputed_layers(plan: Plan) -> tuple[int, ...]:
    """Layers inside at least one checkpoint (recomputed during backward)."""
    return tuple(d.layer for d in plan.per_layer() if d.depth > 0)


def per_layer_set(plan: Plan) -> tuple[int, ...] | None:
    """The checkpointed layers when every checkpoint holds exactly one layer, else None."""
    out = []
    for it in plan.items:
        if isinstance(it, Checkpoint):
            if it.stop - it.start != 1:
                return None
            out.append(it.start)
    return tuple(out)


def per_layer_plan(n_layers: int, layers: tuple[int, ...] | list[int], *, strategy: str = "per-layer",
                   **params: Any) -> Plan:
    """Layers in ``layers`` checkpointed one by one, the rest stored."""
    chosen = set(layers)
    items = tuple(Checkpoint(i, i + 1, (Store(i),)) if i in chosen else Store(i) for i in range(n_layers))
    return Plan(strategy, n_layers, items, {"layers": sorted(chosen), **params})


def hf_every_n(n_layers: int, n: int) -> tuple[int, ...]:
    """Layers transformers' ``every_n_layers=n`` checkpoints: 0, n, 2n, ..."""
    return tuple(range(0, n_layers, n))


def torchtitan_every_n(n_layers: int, n: int) -> tuple[int, ...]:
    """Layers torchtitan's ``selective_ac_option=n`` checkpoints: n-1, 2n-1, ... (1-based count % n == 0)."""
    return tuple(range(n - 1, n_layers, n))


def _find_every_n(layers: tuple[int, ...], n_layers: int, pattern) -> int | None:
    """The smallest N whose pattern is exactly ``layers`` (None when no N gives it)."""
    for n in range(1, n_layers + 1):
        if pattern(n_layers, n) == layers:
            return n
    return None


def _span_text(layers: tuple[int, ...] | list[int]) -> str:
    """``(1, 2, 3, 7)`` -> ``"1-3, 7"``."""
    if not layers:
        return "none"
    parts, start, prev = [], layers[0], layers[0]
    for i in list(layers[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def _why_not_per_layer(plan: Plan) -> str:
    """What the plan does that a one-module wrapper cannot: multi-layer segments, nesting."""
    multi = [f"[{it.start},{it.stop})" for it in plan.items if isinstance(it, Checkpoint) and it.stop - it.start > 1]
    nested = [f"[{it.start},{it.stop})" for it in plan.items
              if isinstance(it, Checkpoint) and any(isinstance(x, Checkpoint) for x in it.inner)]
    bits = []
    if multi:
        bits.append(f"checkpoints multi-layer segments {' '.join(multi)} (each keeps only its input and last output)")
    if nested:
        bits.append(f"nests checkpoints inside {' '.join(nested)}")
    return " and ".join(bits)


def _per_layer_difference(plan: Plan) -> str:
    """How checkpointing the recomputed layers one by one differs from ``plan``."""
    extra = [i for it in plan.items if isinstance(it, Checkpoint) for i in range(it.start + 1, it.stop)]
    multi = [d.layer for d in plan.per_layer() if d.depth > 1]
    out = f"the same {len(recomputed_layers(plan))} layers recomputed"
    if multi:
        out += f", each once where the plan recomputes layers {_span_text(multi)} more than once"
    if extra:
        out += (f", but the inputs of layers {_span_text(extra)} are kept too (more held for backward; the "
                "peak can go either way: compare the predicted peaks)")
    return out


def _header(plan: Plan, ctx: _Ctx) -> list[str]:
    name = f" for {ctx.model_name}" if ctx.model_name else ""
    what = plan.describe()
    if len(what) > 160:  # long chains: the summary, not every item
        what = f"{plan.n_checkpoints} checkpoints, recomputing layers {_span_text(recomputed_layers(plan))}"
    return [f"# ckplan {plan.strategy} plan{name}, {plan.n_layers} layers of `{ctx.chain_path}`: {what}"]


def _closest_per_layer(plan: Plan, target: str) -> tuple[Plan, bool, str, str]:
    """(closest plan, exact, comment line for the text, message) for the any-subset targets."""
    layers = per_layer_set(plan)
    if layers is not None:
        msg = (f"{target} applies this plan exactly: checkpoint layers {_span_text(layers)} one by one. "
               + FALLBACK)
        return plan, True, "", msg
    layers = recomputed_layers(plan)
    closest = per_layer_plan(plan.n_layers, layers, source=plan.strategy, target=target)
    line = (f"# Not exact: {target} wraps one layer at a time; this applies the closest plan, "
            f"layers {_span_text(layers)} checkpointed one by one.")
    msg = (f"{target} wraps one module per checkpoint, so it cannot express this {plan.strategy} plan: it "
           f"{_why_not_per_layer(plan)}. Closest {target} can express: layers {_span_text(layers)} checkpointed "
           f"one by one ({_per_layer_difference(plan)}). " + FALLBACK)
    return closest, False, line, msg


# ---- one mapping per target ----------------------------------------------------------------
def _wrap_function(chain_path: str, layers: tuple[int, ...]) -> list[str]:
    """A torch-only function that checkpoints ``layers`` of the chain, each alone (idempotent)."""
    return [
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
        "    CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper)",
        "",
        "",
        "def ckplan_checkpoint(model):",
        f'    """Checkpoint layers {_span_text(layers)} of model.{chain_path}, each alone '
        '(non-reentrant, RNG preserved)."""',
        f'    layers = model.get_submodule("{chain_path}")',
        "    if any(isinstance(layer, CheckpointWrapper) for layer in layers):",
        "        return  # already applied (Lightning may call configure_model more than once)",
        f"    chosen = {{layers[i] for i in {_tuple_text(layers)}}}",
        "    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,",
        "                                   check_fn=lambda m: m in chosen)",
    ]


def _tuple_text(layers: tuple[int, ...]) -> str:
    return f"({layers[0]},)" if len(layers) == 1 else f"({', '.join(map(str, layers))})"


def _per_layer_start(plan: Plan, ctx: _Ctx, target: str):
    """(closest plan, exact, message, its checkpointed layers, the snippet's first lines) for a
    target that wraps one layer at a time; the lines already say so when no layer is wrapped."""
    closest, exact, note, msg = _closest_per_layer(plan, target)
    layers = per_layer_set(closest) or ()
    lines = _header(plan, ctx) + ([note] if note else [])
    if not layers:
        lines.append("# The plan checkpoints no layer: train as usual, nothing to apply.")
    return closest, exact, msg, layers, lines


def _export_fsdp(plan: Plan, ctx: _Ctx) -> Export:
    closest, exact, msg, layers, lines = _per_layer_start(plan, ctx, "fsdp")
    if layers:
        lines += ["# PyTorch (plain, DDP, FSDP2): call on the plain model, before fully_shard(...),",
                  "# DistributedDataParallel(...) and torch.compile (the order torchtitan uses).", ""]
        lines += _wrap_function(ctx.chain_path, layers)
        lines += ["", "", "ckplan_checkpoint(model)"]
        if len(layers) == plan.n_layers and ctx.layer_class:
            lines.append(f"# (every layer: the same as check_fn=lambda m: isinstance(m, {ctx.layer_class}))")
    return Export("fsdp", "\n".join(lines) + "\n", exact, closest, msg)


def _export_lightning(plan: Plan, ctx: _Ctx) -> Export:
    closest, exact, msg, layers, lines = _per_layer_start(plan, ctx, "lightning")
    if layers:
        lines += ["# Lightning (any strategy): wrap the chosen layers in LightningModule.configure_model;",
                  "# with Fabric, call ckplan_checkpoint(model) before fabric.setup(model).", ""]
        lines += _wrap_function(ctx.chain_path, layers)
        lines += ["", "",
                  "# class LitModel(L.LightningModule):",
                  "#     def configure_model(self):",
                  f"#         ckplan_checkpoint(self.model)  # the module whose `{ctx.chain_path}` is the chain"]
        if len(layers) == plan.n_layers:
            cls = ctx.layer_class or "YourLayerClass"
            lines += ["#",
                      "# Every layer is checkpointed, so with FSDP the class policy does the same (use one, not both):",
                      f"# L.Trainer(strategy=FSDPStrategy(activation_checkpointing_policy={{{cls}}}))"]
    return Export("lightning", "\n".join(lines) + "\n", exact, closest, msg)


def _export_hf(plan: Plan, ctx: _Ctx) -> Export:
    closest, exact, note, msg = _closest_per_layer(plan, "hf")
    layers = per_layer_set(closest) or ()
    n = _find_every_n(layers, plan.n_layers, hf_every_n) if layers else None
    lines = _header(plan, ctx) + ([note] if note else [])
    kw = '{"use_reentrant": False}'
    if not layers:
        lines += ["# The plan checkpoints no layer: leave activation checkpointing off "
                  "(TrainingArguments(activation_checkpointing=False), the default)."]
    elif n is not None:
        every = "" if n == 1 else f", every_n_layers={n}"
        what = "every layer" if n == 1 else f"layers 0, {n}, {2 * n}, ..."
        lines += [f"# transformers >= 5: checkpoints {what} (counting every GradientCheckpointingLayer of the",
                  "# model: exact when these are its only ones, otherwise use `ckplan plan --export fsdp`).",
                  f"model.activation_checkpointing_enable(activation_checkpointing_kwargs={kw}{every})",
                  "",
                  "# or with Trainer:",
                  "# TrainingArguments(..., activation_checkpointing=True,",
                  f'#                   activation_checkpointing_kwargs={{"use_reentrant": False'
                  f'{"" if n == 1 else f", {chr(34)}every_n_layers{chr(34)}: {n}"}}})']
        if n == 1:
            lines += ["# transformers 4.x: model.gradient_checkpointing_enable("
                      f"gradient_checkpointing_kwargs={kw})"]
    else:
        lines += [
            "# transformers >= 5: each GradientCheckpointingLayer reads its own `gradient_checkpointing` flag.",
            "# With Trainer: call this before Trainer(...) and keep TrainingArguments(activation_checkpointing=False)",
            "# (the default); with True, Trainer.train() re-enables checkpointing on every layer.",
            "from transformers.modeling_layers import GradientCheckpointingLayer",
            "",
            "",
            "def ckplan_checkpoint(model):",
            f'    """Checkpoint layers {_span_text(layers)} of model.{ctx.chain_path}, each alone."""',
            f'    layers = model.get_submodule("{ctx.chain_path}")',
            "    if not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):",
            "        raise TypeError(f\"{type(layers[0]).__name__} is not a GradientCheckpointingLayer: \"",
            "                        \"use the snippet of `ckplan plan --export fsdp`\")",
            f"    chosen = {{layers[i] for i in {_tuple_text(layers)}}}",
            f"    model.activation_checkpointing_enable(activation_checkpointing_kwargs={kw})",
            "    for m in model.modules():",
            "        if isinstance(m, GradientCheckpointingLayer):",
            "            m.gradient_checkpointing = m in chosen",
            "",
            "",
            "ckplan_checkpoint(model)",
        ]
    return Export("hf", "\n".join(lines) + "\n", exact, closest, msg)


def _export_torchtitan(plan: Plan, ctx: _Ctx) -> Export:
    n_layers = plan.n_layers
    layers = per_layer_set(plan)
    n = None if layers is None else (0 if not layers else _find_every_n(layers, n_layers, torchtitan_every_n))
    rule = ('torchtitan checkpoints whole blocks of model.layers: none, all (mode = "full") or every N-th '
            '(selective_ac_option = "N": blocks N-1, 2N-1, ...)')
    if n is not None:
        exact, closest = True, plan
        msg = f"torchtitan applies this plan exactly: {_tt_what(n, n_layers)}."
    else:
        exact = False
        c = len(recomputed_layers(plan))
        n = max(k for k in range(1, n_layers + 1) if n_layers // k >= c)  # c >= 1 here
        chosen = torchtitan_every_n(n_layers, n)
        closest = per_layer_plan(n_layers, chosen, source=plan.strategy, target="torchtitan", every_n=n)
        why = _why_not_per_layer(plan) or f"checkpoints layers {_span_text(layers or ())}, not an every-N pattern"
        if plan.strategy == "every-k":
            why += ("; ckplan's every-k checkpoints segments of k layers and recomputes all of them, while "
                    "torchtitan's every-N checkpoints one block in N")
        msg = (f"{rule}, so it cannot express this {plan.strategy} plan: it {why}. It recomputes {c} of "
               f"{n_layers} layers ({_span_text(recomputed_layers(plan))}); closest torchtitan can express: "
               f"{_tt_what(n, n_layers)}, the fewest checkpointed blocks that are at least {c}.")
    if ctx.chain_path != "layers":
        msg += (f" torchtitan always checkpoints `model.layers`; this plan was made for `{ctx.chain_path}`, so "
                "check that both count the same blocks.")
    if n > 1:
        msg += (" Torchtitan >= 0.3 has no layer-frequency option (pytorch/torchtitan#2357): there only FullAC "
                "(every layer) or none.")
    msg += " " + FALLBACK
    lines = _header(plan, ctx)
    if not exact:
        lines.append(f"# Not exact: torchtitan applies the closest plan, {_tt_what(n, n_layers)}.")
    lines += ["# torchtitan <= 0.2.2, TOML job config (--job.config_file):", "[activation_checkpoint]"]
    if n == 0:
        lines += ['mode = "none"', "# torchtitan >= 0.3 (config registry): activation_checkpoint=None"]
    elif n == 1:
        lines += ['mode = "full"',
                  "# CLI: --activation_checkpoint.mode full",
                  "# torchtitan >= 0.3 (config registry): activation_checkpoint=FullAC.Config()",
                  "#   (from torchtitan.distributed.activation_checkpoint import FullAC)"]
    else:
        lines += ['mode = "selective"', f'selective_ac_option = "{n}"  # blocks {n - 1}, {2 * n - 1}, ...',
                  f"# CLI: --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option {n}",
                  "# torchtitan >= 0.3 removed this option; use ckplan.apply_plan in a custom trainer there."]
    return Export("torchtitan", "\n".join(lines) + "\n", exact, closest, msg)


def _tt_what(n: int, n_layers: int) -> str:
    if n == 0:
        return 'mode = "none" (no block checkpointed)'
    if n == 1:
        return f'mode = "full" (all {n_layers} blocks checkpointed)'
    chosen = torchtitan_every_n(n_layers, n)
    return (f'mode = "selective", selective_ac_option = "{n}" (blocks {_span_text(chosen)} checkpointed, '
            f"{len(chosen)} of {n_layers})")


_EXPORTERS = {"hf": _export_hf, "torchtitan": _export_torchtitan, "lightning": _export_lightning,
              "fsdp": _export_fsdp}
