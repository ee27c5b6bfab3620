"""ckplan's selective options as checkpoint regions inside a whole-model torch.compile, against
torch.compile's own activation memory budget: peak, bytes held for backward, step time, gradients.

Each variant is a copy of the model sharing its weights, compiled whole with TorchInductor:

- ``nobudget``: torch.compile as it is (the partitioner's default recomputation only);
- ``bF``: torch.compile with ``torch._functorch.config.activation_memory_budget = F``;
- ``OPTION@LAYERS``: the chain layers LAYERS (``all``, or indices ``0,1,2``) each run as
  ``checkpoint(layer.forward, use_reentrant=False, context_fn=OPTION's SAC contexts)`` (``ckpt``:
  plain checkpoint, everything recomputed), which Dynamo traces as tagged regions that the
  partitioner honours; joined with ``+`` (``sac-linear@0,1+ckpt@2``, ``sac-compute@all+b0.9``).

The gradients of one step of each variant are compared with eager PyTorch's from the same weights
and seed; then one step's memory (CUDA: ``max_memory_allocated``; CPU: the PyTorch profiler's
allocator events, above what was allocated when the step began) and ``--steps`` timed steps,
interleaved across variants round by round. SGD, so that the optimizer adds no state. Beside the
measured bytes held after the forward, each row gives what the partitioned forward graph saves for
the backward (``ckplan.measure.compiled_graph``), in all and by chain layer, and, where the run has
a row with each option on every layer (``nobudget`` standing for store), that sum predicted layer by
layer from those rows.

    python scripts/compiled_regions.py configs/gpt2-small.yaml \\
        --variants "nobudget;b0.71;sac-compute@all;sac-linear@all;ckpt@0,1,2" --out report.md
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import sys
import time
from datetime import date

import torch
from torch.utils.checkpoint import checkpoint

from ckplan.bench.memory import profiled_step_memory
from ckplan.chainfind import resolve_chain
from ckplan.errors import CkplanError
from ckplan.measure.compiled_graph import SavedForBackward
from ckplan.peers import eager_random_ops, shared_copy
from ckplan.sac import POLICIES, context_fn
from ckplan.spec import build_model, load_spec, make_batch, to_loss
from ckplan.training import autocast_ctx


def _regions(model: torch.nn.Module, chain: str | None, part: str) -> None:
    option, _, where = part.partition("@")
    _, layers, _ = resolve_chain(model, chain)
    layers = list(layers)
    idx = range(len(layers)) if where == "all" else [int(i) for i in where.split(",")]
    for i in idx:
        fwd = layers[i].forward
        ctx = {} if option == "ckpt" else {"context_fn": context_fn(option)}
        layers[i].forward = functools.partial(checkpoint, fwd, use_reentrant=False, **ctx)


class Variant:
    def __init__(self, name: str, model: torch.nn.Module, chain: str | None, precision: str, n_layers: int = 0):
        self.name, self.budget, self.precision = name, 1.0, precision
        copy = shared_copy(model)
        for part in name.split("+"):
            if part == "nobudget":
                continue
            if part.startswith("b") and "@" not in part:
                self.budget = float(part[1:])
            else:
                _regions(copy, chain, part)
        self.module = torch.compile(copy, backend=self._backend)
        self.times: list[float] = []
        path = resolve_chain(model, chain)[0]
        self.saved = SavedForBackward([f"{path}.{i}" for i in range(n_layers)])  # by chain layer
        self.layers = _layer_options(name, n_layers) if n_layers else {}

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        with self.settings(), self.saved:
            return compile_fx(gm, example_inputs)

    def settings(self) -> contextlib.ExitStack:
        import torch._functorch.config as functorch_config
        stack = contextlib.ExitStack()
        stack.enter_context(functorch_config.patch(activation_memory_budget=self.budget))
        stack.enter_context(eager_random_ops())
        return stack


def _layer_options(name: str, n_layers: int) -> dict[int, str]:
    """The option each chain layer runs with in variant ``name`` ('store' where no region), or
    {} when a budget below 1 decides (no per-layer prediction then)."""
    opts = {i: "store" for i in range(n_layers)}
    for part in name.split("+"):
        if part == "nobudget":
            continue
        if "@" not in part:
            return {} if float(part[1:]) < 1.0 else opts
        option, _, where = part.partition("@")
        for i in (range(n_layers) if where == "all" else [int(i) for i in where.split(",")]):
            opts[i] = option
    return opts


def additive_held(rows) -> dict[str, int]:
    """Each variant's saved bytes predicted from the variants that run one option on every layer
    (``nobudget``: every layer stored): per layer, that option's bytes in the uniform variant, plus
    the uniform store variant's inputs and other bytes. Empty where a needed uniform row is missing."""
    uniform = {}
    for v, *_ in rows:
        if v.layers and len(set(v.layers.values())) == 1:
            uniform.setdefault(next(iter(v.layers.values())), v)
    if "store" not in uniform:
        return {}
    base = uniform["store"].saved.bytes
    out = {}
    for v, *_ in rows:
        if not v.layers or any(o not in uniform for o in v.layers.values()):
            continue
        out[v.name] = (base.get("other", 0) +
                       sum(uniform[o].saved.bytes.get(f"L{i}", 0) for i, o in v.layers.items()))
    return out


def check_variant(name: str, n_layers: int) -> str:
    """Why variant ``name`` cannot run on a chain of ``n_layers`` ('' when it can)."""
    for part in name.split("+"):
        if part == "nobudget":
            continue
        if "@" not in part:
            try:
                budget = float(part[1:]) if part.startswith("b") else None
            except ValueError:
                budget = None
            if budget is None or not 0.0 <= budget <= 1.0:
                return f"{part!r} is not a budget b0.0 to b1.0, 'nobudget' or OPTION@LAYERS"
            continue
        option, _, where = part.partition("@")
        if option != "ckpt" and option not in POLICIES:
            return f"option {option!r} is not ckpt or one of {', '.join(POLICIES)}"
        if where != "all":
            try:
                idx = [int(i) for i in where.split(",")]
            except ValueError:
                return f"layers {where!r} are not 'all' or indices like 0,1,2"
            bad = [i for i in idx if not 0 <= i < n_layers]
            if bad:
                return f"layer {bad[0]} is outside the chain's {n_layers} layers (0 to {n_layers - 1})"
    return ""


def _loss(module, batch, precision: str):
    args, kwargs = batch
    device_type = next(module.parameters()).device.type
    with autocast_ctx(precision, device_type):
        return to_loss(module(*args, **kwargs))


def _grads(module, batch, precision: str, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    loss = _loss(module, batch, precision)
    loss.backward()
    params = dict(module.named_parameters())
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
    for p in params.values():
        p.grad = None
    return loss.item(), grads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--variants", default="nobudget;sac-compute@all;sac-linear@all")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="also write the table as markdown here")
    a = ap.parse_args(argv)
    try:
        spec = load_spec(a.spec)
    except CkplanError as e:
        ap.error(str(e))
    if a.batch_size:
        spec = spec.model_copy(update={"input": spec.input.model_copy(update={"batch_size": a.batch_size})})
    dev = torch.device(a.device)
    torch.manual_seed(spec.seed)
    model = build_model(spec, a.device)
    batch = make_batch(spec, a.device)
    chain = spec.chain
    n_layers = len(list(resolve_chain(model, chain)[1]))
    for name in a.variants.split(";"):
        why = check_variant(name, n_layers)
        if why:
            ap.error(f"--variants {name!r}: {why}")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    prec = spec.train.precision
    ref_loss, ref = _grads(model, batch, prec, 0)
    # Every variant's gradients first, from the same weights (the memory steps below update them).
    checked: list[tuple[Variant, float, float, float]] = []
    for name in a.variants.split(";"):
        v = Variant(name, model, chain, prec, n_layers)
        t = time.perf_counter()
        with v.settings():
            loss, grads = _grads(v.module, batch, prec, 0)
        diff = max((g - ref[n]).abs().max().item() for n, g in grads.items())
        checked.append((v, time.perf_counter() - t, loss, diff))
        del grads
    rows: list[tuple[Variant, float, float, int, int]] = []
    for v, compile_s, loss, diff in checked:
        gc.collect()
        peak, held = _memory(v, batch, opt, dev)
        rows.append((v, compile_s, diff, peak, held))
        print(f"{v.name}: compiled in {compile_s:.0f} s, loss {loss:.4f} (eager {ref_loss:.4f}), "
              f"max |grad diff| {diff:.1e}, peak {peak:,} B, held for backward {held:,} B",
              file=sys.stderr, flush=True)
    for _ in range(a.steps):
        for v, *_ in rows:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            _step(v, batch, opt)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            v.times.append(time.perf_counter() - t)
    table = _table(rows, a, dev, spec)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    return 0


def _step(v: Variant, batch, opt, after_forward=None, after_backward=None) -> None:
    with v.settings():
        loss = _loss(v.module, batch, v.precision)
        if after_forward:
            after_forward()
        loss.backward()
        if after_backward:
            after_backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _memory(v: Variant, batch, opt, dev: torch.device) -> tuple[int, int]:
    """Peak and bytes alive after the forward, above what was allocated when the step began."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        held = []
        _step(v, batch, opt, after_forward=lambda: held.append(torch.cuda.memory_allocated() - base))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, held[0]
    m = profiled_step_memory(lambda fwd, bwd: _step(v, batch, opt, fwd, bwd))
    return m.peak, m.after_forward


def _table(rows, a, dev: torch.device, spec) -> str:
    base = statistics.median(rows[0][0].times)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    head = (f"`python scripts/compiled_regions.py {a.spec}"
            f"{f' --batch-size {a.batch_size}' if a.batch_size else ''} --variants \"{a.variants}\" "
            f"--steps {a.steps}` on {name}, torch {torch.__version__}, {date.today().isoformat()}; "
            f"batch {spec.input.batch_size} x {spec.input.shape}, SGD, {spec.train.precision}; peaks and held "
            "bytes above what was allocated when the step began (weights excluded, gradients included)\n")
    lines = [head, "| variant | peak (bytes) | held for backward (bytes) | saved by the graph, less its inputs (bytes) | "
                   "saved, from the uniform rows | step (median) | min-max | "
                   f"vs {rows[0][0].name} | max grad diff vs eager | compile |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    predicted = additive_held(rows)
    for v, compile_s, diff, peak, held in rows:
        med = statistics.median(v.times)
        pred = f"{predicted[v.name]:,}" if v.name in predicted else "-"
        graph = v.saved.activations()
        lines.append(f"| {v.name} | {peak:,} | {held:,} | {graph:,} | {pred} | {med:.3f} s | "
                     f"{min(v.times):.2f}-{max(v.times):.2f} s | {med / base:.3f}x | {diff:.1e} | {compile_s:.0f} s |")
    layers = [f"- {v.name}: " + ", ".join(f"{k} {b:,}" for k, b in sorted(v.saved.bytes.items())) for v, *_ in rows]
    return "\n".join(lines) + "\n\nSaved by the partitioned forward graph, by chain layer (the layer whose op " \
        "made the value; inputs: the graph's own inputs; other: outside the chain):\n\n" + "\n".join(layers)


if __name__ == "__main__":
    sys.exit(main())
