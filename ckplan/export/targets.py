"""One mapping per target: the snippet or config for fsdp, lightning, hf and torchtitan."""
from __future__ import annotations

from ..planner.plan import Plan
from .base import FALLBACK, Ctx, Export
from .layers import (
    closest_per_layer,
    find_every_n,
    header,
    hf_every_n,
    per_layer_plan,
    per_layer_set,
    recomputed_layers,
    span_text,
    torchtitan_every_n,
    why_not_per_layer,
)


def _wrap_function(chain_path: str, layers: tuple[int, ...]) -> list[str]:
    """A torch-only function that checkpoints ``layers`` of the chain, each alone (idempotent)."""
    return [
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
        "    CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper)",
        "",
        "",
        "def ckplan_checkpoint(model):",
        f'    """Checkpoint layers {span_text(layers)} of model.{chain_path}, each alone '
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


def _per_layer_start(plan: Plan, ctx: Ctx, target: str):
    """(closest plan, exact, message, its checkpointed layers, the snippet's first lines) for a
    target that wraps one layer at a time; the lines already say so when no layer is wrapped."""
    closest, exact, note, msg = closest_per_layer(plan, target)
    layers = per_layer_set(closest) or ()
    lines = header(plan, ctx) + ([note] if note else [])
    if not layers:
        lines.append("# The plan checkpoints no layer: train as usual, nothing to apply.")
    return closest, exact, msg, layers, lines


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _policy_lines(ctx: Ctx) -> list[str]:
    """The FSDP2 wrapping the plan was made for, under its MixedPrecisionPolicy (commented)."""
    if ctx.policy is None:
        return []
    param, reduce = (_TORCH_DTYPES[d] for d in ctx.policy)
    return ["# Planned per rank for FSDP2 with this MixedPrecisionPolicy on every unit (each chain layer,",
            "# then the model); a plan for another policy holds other buffers:",
            "#   from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
            f"#   policy = MixedPrecisionPolicy(param_dtype=torch.{param}, reduce_dtype=torch.{reduce})",
            f"#   for layer in model.{ctx.chain_path}:",
            "#       fully_shard(layer, mp_policy=policy)",
            "#   fully_shard(model, mp_policy=policy)"]


def _export_fsdp(plan: Plan, ctx: Ctx) -> Export:
    closest, exact, msg, layers, lines = _per_layer_start(plan, ctx, "fsdp")
    if layers:
        lines += ["# PyTorch (plain, DDP, FSDP2): call on the plain model, before fully_shard(...),",
                  "# DistributedDataParallel(...) and torch.compile (the order torchtitan uses).", ""]
        lines += _wrap_function(ctx.chain_path, layers)
        lines += ["", "", "ckplan_checkpoint(model)"]
        if len(layers) == plan.n_layers and ctx.layer_class:
            lines.append(f"# (every layer: the same as check_fn=lambda m: isinstance(m, {ctx.layer_class}))")
    lines += _policy_lines(ctx)
    return Export("fsdp", "\n".join(lines) + "\n", exact, closest, msg)


def _export_lightning(plan: Plan, ctx: Ctx) -> Export:
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


def _export_hf(plan: Plan, ctx: Ctx) -> Export:
    closest, exact, note, msg = closest_per_layer(plan, "hf")
    layers = per_layer_set(closest) or ()
    n = find_every_n(layers, plan.n_layers, hf_every_n) if layers else None
    lines = header(plan, ctx) + ([note] if note else [])
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
            lines += ["# transformers 4.x has no every_n_layers: the snippet of `ckplan plan --export fsdp` "
                      "checkpoints these layers"]
    else:
        lines += [
            "# Each GradientCheckpointingLayer reads its own `gradient_checkpointing` flag (transformers 4.5x and 5).",
            "# With Trainer: call this before Trainer(...) and keep TrainingArguments(activation_checkpointing=False)",
            "# (4.x: gradient_checkpointing=False; the default); with True, Trainer.train() re-enables every layer.",
            "from transformers.modeling_layers import GradientCheckpointingLayer",
            "",
            "",
            "def ckplan_checkpoint(model):",
            f'    """Checkpoint layers {span_text(layers)} of model.{ctx.chain_path}, each alone."""',
            f'    layers = model.get_submodule("{ctx.chain_path}")',
            "    if not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):",
            "        raise TypeError(f\"{type(layers[0]).__name__} is not a GradientCheckpointingLayer: \"",
            "                        \"use the snippet of `ckplan plan --export fsdp`\")",
            f"    chosen = {{layers[i] for i in {_tuple_text(layers)}}}",
            '    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5',
            f"        model.activation_checkpointing_enable(activation_checkpointing_kwargs={kw})",
            "    else:  # transformers 4.x",
            f"        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={kw})",
            "    for m in model.modules():",
            "        if isinstance(m, GradientCheckpointingLayer):",
            "            m.gradient_checkpointing = m in chosen",
            "",
            "",
            "ckplan_checkpoint(model)",
        ]
    return Export("hf", "\n".join(lines) + "\n", exact, closest, msg)


def _tt_what(n: int, n_layers: int) -> str:
    if n == 0:
        return 'mode = "none" (no block checkpointed)'
    if n == 1:
        return f'mode = "full" (all {n_layers} blocks checkpointed)'
    chosen = torchtitan_every_n(n_layers, n)
    return (f'mode = "selective", selective_ac_option = "{n}" (blocks {span_text(chosen)} checkpointed, '
            f"{len(chosen)} of {n_layers})")


def _export_torchtitan(plan: Plan, ctx: Ctx) -> Export:
    n_layers = plan.n_layers
    layers = per_layer_set(plan)
    n = None if layers is None else (0 if not layers else find_every_n(layers, n_layers, torchtitan_every_n))
    rule = ('torchtitan checkpoints whole blocks of model.layers: none, all (mode = "full") or every N-th '
            '(selective_ac_option = "N": blocks N-1, 2N-1, ...)')
    if n is not None:
        exact, closest = True, plan
        msg = f"torchtitan applies this plan exactly: {_tt_what(n, n_layers)}."
    else:
        exact = False
        c = len(recomputed_layers(plan))
        nearest = max(k for k in range(1, n_layers + 1) if n_layers // k >= c)  # c >= 1 here

        def every(k: int) -> Plan:
            return per_layer_plan(n_layers, torchtitan_every_n(n_layers, k), source=plan.strategy,
                                  target="torchtitan", every_n=k)
        # more blocks checkpointed (a smaller N) until the budget is met; the nearest if none meets it
        n = next((k for k in range(nearest, 0, -1) if ctx.fits is None or ctx.fits(every(k))), nearest)
        closest = every(n)
        why = why_not_per_layer(plan) or f"checkpoints layers {span_text(layers or ())}, not an every-N pattern"
        if plan.strategy == "every-k":
            why += ("; ckplan's every-k checkpoints segments of k layers and recomputes all of them, while "
                    "torchtitan's every-N checkpoints one block in N")
        msg = (f"{rule}, so it cannot express this {plan.strategy} plan: it {why}. It recomputes {c} of "
               f"{n_layers} layers ({span_text(recomputed_layers(plan))}); closest torchtitan can express: "
               f"{_tt_what(n, n_layers)}, " + (f"the fewest checkpointed blocks that are at least {c}." if n == nearest
                                                else f"the fewest checkpointed blocks that fit the budget "
                                                     f"(selective_ac_option = \"{nearest}\" does not)."))
        if ctx.fits is not None and not ctx.fits(closest):
            msg += " No every-N pattern fits the budget, full included: use ckplan.apply_plan."
    if ctx.chain_path != "layers":
        msg += (f" torchtitan always checkpoints `model.layers`; this plan was made for `{ctx.chain_path}`, so "
                "check that both count the same blocks.")
    if n > 1:
        msg += (" Torchtitan >= 0.3 has no layer-frequency option (pytorch/torchtitan#2357): there only FullAC "
                "(every layer) or none.")
    msg += " " + FALLBACK
    lines = header(plan, ctx)
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
    if ctx.policy is not None:
        param, reduce = (_TORCH_DTYPES[d] for d in ctx.policy)
        lines += ["", "# the MixedPrecisionPolicy the plan was made for (torchtitan's FSDP2 wrapping)", "[training]",
                  f'mixed_precision_param = "{param}"', f'mixed_precision_reduce = "{reduce}"']
        if reduce != "float32":
            msg += (f" The plan is for a {reduce} reduce-scatter; torchtitan reduces in float32 "
                    "(mixed_precision_reduce), whose buffers are twice as large: plan with reduce_dtype: fp32.")
    return Export("torchtitan", "\n".join(lines) + "\n", exact, closest, msg)


EXPORTERS = {"hf": _export_hf, "torchtitan": _export_torchtitan, "lightning": _export_lightning,
              "fsdp": _export_fsdp}
