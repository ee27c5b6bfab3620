"""One function per command; the CLI and Python users call these.

Each returns frozen records (ckplan.records, ckplan.planner, ckplan.bench); nothing here prints.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .errors import SpecError, UsageError
from .records import Profile, Totals
from .spec import Spec, batch_bytes, build_model, load_spec, make_batch, to_loss

DEVICES = ("auto", "cpu", "cuda", "meta")


def resolve_device(device: str):
    import torch
    if device not in DEVICES:
        raise UsageError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but PyTorch sees no CUDA GPU on this machine",
                         tip="use --device cpu, or --device meta to profile without allocating")
    return torch.device(device)


def load(spec_or_path: Spec | str | Path, **overrides) -> Spec:
    spec = spec_or_path if isinstance(spec_or_path, Spec) else load_spec(spec_or_path)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return spec.with_overrides(**overrides) if overrides else spec


def profile(spec: Spec, *, device: str = "auto", repeats: int = 3, warmup: int = 1) -> Profile:
    """Build the spec's model and batch on ``device`` and profile one training step."""
    dev = resolve_device(device)
    model = build_model(spec, str(dev))
    args, kwargs = make_batch(spec, str(dev))
    return profile_model(model, args, kwargs, name=spec.name or type(model).__name__, chain=spec.chain,
                         device=dev, optimizer=spec.train.optimizer, precision=spec.train.precision,
                         accum=spec.train.accum, lr=spec.train.lr, repeats=repeats, warmup=warmup,
                         spec=spec.model_dump(mode="json"))


def profile_model(model, args, kwargs, *, name: str, chain: str | None, device, optimizer: str = "adamw",
                  precision: str = "fp32", accum: int = 1, lr: float = 1e-4, repeats: int = 3,
                  warmup: int = 1, spec: dict | None = None, loss_fn=to_loss) -> Profile:
    """Profile any model on a sample batch; the model is not changed."""
    import torch

    from .measure import device_info
    from .profiler import measure_step
    from .training import optimizer_memory

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    m = measure_step(model, args, kwargs, loss_fn, chain=chain, device=dev, precision=precision,
                     repeats=repeats, warmup=warmup, accum=accum)
    params = list(dict.fromkeys(model.parameters()))
    trainable = [p for p in params if p.requires_grad]
    opt_state, opt_tmp = optimizer_memory(trainable, optimizer, lr, dev.type)
    info = device_info(dev)
    param_bytes = sum(p.untyped_storage().nbytes() for p in params)
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in dict.fromkeys(model.buffers()))
    inputs = batch_bytes(args, kwargs)
    notes = []
    if dev.type == "meta":
        notes.append("meta device: sizes and FLOPs are exact; times are estimated from FLOPs "
                     "at an assumed 100 TFLOP/s, not measured")
        if precision != "fp32":
            notes.append(f"meta device: autocast ({precision}) is not modelled; sizes are for fp32")
    totals = Totals(
        param_bytes=param_bytes, buffer_bytes=buffer_bytes,
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        grad_bytes=m.grad_bytes, optimizer_bytes=opt_state, optimizer_tmp_bytes=opt_tmp,
        input_bytes=inputs, activation_bytes=sum(r.saved_bytes for r in m.rows),
        predicted_peak_bytes=0,
        measured_peak_bytes=None if dev.type == "meta" else
        param_bytes + buffer_bytes + inputs + opt_state + m.measured_peak_rel,
    )
    prof = Profile(
        model=name, device=dev.type, device_name=info.name, chain=m.chain_path,
        chain_detected=m.chain_detected, batch_size=_batch_size(args, kwargs), precision=precision,
        optimizer=optimizer, accum=accum, input_requires_grad=m.input_requires_grad,
        times_estimated=dev.type == "meta", layers=m.rows, totals=totals,
        device_total_bytes=info.total_bytes, device_free_bytes=info.free_bytes,
        notes=tuple(notes), spec=spec or {},
    )
    return replace(prof, totals=replace(totals, predicted_peak_bytes=predicted_peak_none(prof)))


def predicted_peak_none(prof: Profile) -> int:
    """Peak of one step without checkpointing, by the planner's memory model (README)."""
    from .planner import predicted_peak_none as _pp
    return _pp(prof)


def _batch_size(args, kwargs) -> int:
    import torch
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


def load_profile(path: str | Path) -> Profile:
    import json
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"profile file {str(p)!r} does not exist",
                        tip="save one with: ckplan profile SPEC --format json -o profile.json")
    try:
        return Profile.from_dict(json.loads(p.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{p}: not a ckplan profile ({type(e).__name__}: {e})",
                        tip="save one with: ckplan profile SPEC --format json -o profile.json") from None


def bench(spec: Spec, *, strategies: list[str], budget: str | int | None = None, k: int = 2,
          steps: int = 5, warmup: int = 1, device: str = "auto", plan_path: str | Path | None = None,
          memory_limit: str | int | None = None, progress=None):
    """Profile the spec's model, plan every strategy, and run measured training steps."""
    from .bench import run_bench
    from .execute import load_plan

    dev = resolve_device(device)
    if dev.type == "meta":
        raise UsageError("bench runs real training steps; --device meta cannot run them",
                         tip="use --device cpu or cuda (meta is for profile and plan)")
    extra = {}
    if plan_path is not None:  # a bad plan file fails before the (long) profile, not after
        p = load_plan(plan_path)
        extra[f"plan:{p.strategy}"] = p
    model = build_model(spec, str(dev))
    batch = make_batch(spec, str(dev))
    prof = profile_model(model, *batch, name=spec.name or type(model).__name__, chain=spec.chain,
                         device=dev, optimizer=spec.train.optimizer, precision=spec.train.precision,
                         accum=spec.train.accum, lr=spec.train.lr, spec=spec.model_dump(mode="json"))
    budget_bytes = resolve_budget(budget, prof) if budget is not None else None
    limit = None
    if memory_limit is not None:
        from .units import parse_size
        limit = parse_size(memory_limit, what="--memory-limit")
    return run_bench(model, batch, to_loss, prof, strategies=strategies, budget_bytes=budget_bytes,
                     k=k, steps=steps, warmup=warmup, device=dev, lr=spec.train.lr,
                     extra_plans=extra, memory_limit_bytes=limit, progress=progress)


def resolve_budget(budget: str | int, prof: Profile) -> int:
    """``12GB``, ``12GiB``, plain bytes, or ``40%`` of the predicted peak without checkpointing."""
    from .units import ACCEPTED_SIZES, parse_size
    text = str(budget).strip()
    if text.endswith("%"):
        try:
            frac = float(text[:-1]) / 100
        except ValueError:
            frac = -1
        if not 0 < frac <= 10:
            raise UsageError(f"--budget {text!r} is not a percentage above 0%",
                             tip=f"use {ACCEPTED_SIZES}, or a share of the no-checkpoint peak like 40%")
        return int(prof.totals.predicted_peak_bytes * frac)
    return parse_size(text, what="--budget")


def plan(spec: Spec | None = None, *, profile_path: str | Path | None = None, budget: str | int | None = None,
         strategy: str = "dp", k: int = 2, device: str = "auto"):
    """Profile (or load a saved profile), then plan one strategy or all of them at one budget."""
    from .plan_report import PlanReport
    from .planner import STRATEGIES, chain_from_profile, compare, plan_chain

    prof = _profile_for_plan(spec, profile_path, device)
    budget_bytes, source = _budget_for_plan(budget, prof)
    chain = chain_from_profile(prof)
    if strategy == "all":
        results = compare(chain, list(STRATEGIES), budget_bytes, k)
        chosen = next(r for r in results if r.strategy == "dp")
    else:
        if strategy not in STRATEGIES:
            raise UsageError(f"--strategy {strategy!r} is not one of {', '.join(STRATEGIES)}, all")
        chosen = plan_chain(chain, strategy, budget_bytes, k)
        results = (chosen,)
    none = plan_chain(chain, "none")
    return PlanReport(profile=prof, budget_bytes=budget_bytes, budget_source=source, strategy=strategy,
                      k=k, results=tuple(results), chosen=chosen, none_peak_bytes=none.score.peak_bytes,
                      none_step_ms=none.score.step_ms)


def sweep(spec: Spec | None = None, *, profile_path: str | Path | None = None, device: str = "auto",
          points: int = 20, strategies: tuple[str, ...] | None = None):
    from .planner import STRATEGIES, chain_from_profile
    from .planner import sweep as _sweep
    prof = _profile_for_plan(spec, profile_path, device)
    return prof, _sweep(chain_from_profile(prof), list(strategies or STRATEGIES), points)


def _profile_for_plan(spec, profile_path, device) -> Profile:
    if profile_path is not None:
        return load_profile(profile_path)
    if spec is None:
        raise UsageError("plan needs a SPEC or --profile saved.json",
                         tip="e.g. ckplan plan configs/gpt2-small.yaml --budget 4GB")
    return profile(spec, device=device)


def _budget_for_plan(budget, prof: Profile) -> tuple[int | None, str]:
    if budget is not None:
        return resolve_budget(budget, prof), "--budget"
    if prof.device == "cuda":
        from .measure import nvml_memory
        info = nvml_memory(0)
        if info is not None and info.free_bytes:
            # The model's own resident memory is already counted in the plan's peak.
            return info.free_bytes, "free GPU memory reported by NVML"
    return None, "none given: planned for the smallest feasible peak"
