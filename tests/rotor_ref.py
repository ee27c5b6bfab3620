"""A clean-room reference of rotor: its chain, its sequence simulator and its "persistent" dynamic
program, from the model of Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited memory"
(arXiv:1911.13214, 2019; ACM TOMS 2024). Written from the paper's operations and recursion, not
from rotor's code; independent of ckplan's planner (only the mapping at the end imports ckplan).
It is the oracle ``tests/test_planner_rotor.py`` checks ckplan's ``dp`` against, at chain lengths
where brute force is out of reach.

The model (close to the paper's notation: u_f, u_b, omega_x, omega_xbar, o_f, o_b; stages from 1):

* stages ``1..L`` form the chain and stage ``L + 1`` is the loss. Stage ``l`` reads ``x[l-1]``
  and makes ``x[l]``; ``x[0]`` is the input. Its gradient ``d[l]`` (the paper's delta) is as large
  as ``x[l]``. Per stage: forward and backward times ``uf[l]``, ``ub[l]``; the size ``wx[l]`` of
  ``x[l]``; the size ``wxb[l]`` of ``xbar[l]``, everything ``F_all`` keeps for the backward,
  ``x[l]`` included; forward and backward transients ``of[l]``, ``ob[l]``. The loss keeps and
  makes nothing a later stage reads: ``wx[L+1] = wxb[L+1] = 0`` (``d[L+1]`` is empty).
* operations, with the memory each holds while it runs (*during*) over the bytes already live:

  ====================  ======================  =========================================
  op                    during                  after
  ====================  ======================  =========================================
  ``F_all(l)``          ``+ wxb[l] + of[l]``    keeps ``xbar[l]``
  ``F_ck(l)``           ``+ wx[l] + of[l]``     keeps ``x[l]`` (and its input ``x[l-1]``)
  ``F_n(l)``            ``+ wx[l] + of[l]``     keeps ``x[l]``, frees ``x[l-1]``
  ``B(l)``              ``+ wx[l-1] + ob[l]``   makes ``d[l-1]``; frees ``d[l]``, ``xbar[l]``,
                                                and ``x[l-1]`` when it is a checkpoint (no
                                                later op reads it)
  ====================  ======================  =========================================

  ``F_all`` and ``F_ck`` need ``x[l-1]`` (alone or inside ``xbar[l-1]``), ``F_n`` needs it alone
  (the output of the op before), ``B(l)`` needs ``xbar[l]``, ``x[l-1]`` and ``d[l]``. The peak of
  a sequence is the largest *during*; ``x[0]`` is live from the start.
* persistent sequences for the sub-chain ``[s, t]``, run with ``x[s-1]`` live (not counted in
  the memory ``m`` the sub-chain may use) and ``d[t]`` live (counted in it):

  - ``F_all(s)``, then a sequence for ``[s+1, t]`` within ``m - wxb[s]``, then ``B(s)``;
  - ``F_ck(s) F_n(s+1) .. F_n(s'-1)`` for some ``s < s' <= t``, then a sequence for ``[s', t]``
    within ``m - wx[s'-1]`` (``x[s'-1]``, the checkpoint, is its input), then one for
    ``[s, s'-1]`` within ``m`` (``x[s'-1]`` is gone, ``d[s'-1]`` has come).

  So, with ``Opt(s, t, m)`` the least *recompute* time (the paper minimises the makespan, which is
  this plus every stage's ``uf + ub`` once, the same argmin):

  - ``Opt(s, s, m) = 0`` iff ``m >= max(wx[s] + wxb[s] + of[s], wx[s] + wxb[s] + wx[s-1] + ob[s])``;
  - the ``F_all`` branch: ``Opt(s+1, t, m - wxb[s])``, feasible when also
    ``m >= wx[t] + wxb[s] + of[s]`` (its forward runs beside ``d[t]``) and
    ``m >= wx[s] + wxb[s] + wx[s-1] + ob[s]`` (its backward);
  - the checkpoint branch at ``s'``: ``uf[s] + .. + uf[s'-1] + Opt(s', t, m - wx[s'-1]) +
    Opt(s, s'-1, m)``, feasible when its forwards fit beside ``d[t]``:
    ``m >= wx[t] + wx[s] + of[s]`` and ``m >= wx[t] + wx[k-1] + wx[k] + of[k]`` for ``s < k < s'``.

  The whole step is ``Opt(1, L+1, M - wx[0])`` for a memory limit ``M`` (``x[0]`` included).

Memory is exact integer bytes (one slot per byte): the table is ``Opt[s][t]`` as an array over
``m = 0..mmax``, so there is no rounding.

Where rotor's published code differs (read for understanding only: the C kernel of the rotor
package as vendored in ``remiDInria/pytorch``, ``torch/utils/rotor/algorithms/dynamic_programs.c``,
and ColossalAI's Python port of rotor's table, ``ckpt_solver_rotor.py``): its ``F_all`` branch
checks the forward of ``s`` beside ``d[s]`` (it reuses the one-stage case ``Opt(s, s, m)``), but
the gradient live while that forward runs is ``d[t]``; and the C kernel bounds the no-grad
forwards of a checkpoint by those of stages ``s`` and ``t-1`` only (ColossalAI's port by every
stage). Both can accept a sequence whose simulated peak is over the limit: with the C kernel's
checks, on 58 of 3,000 random 3-6-stage chains with large forward transients (2 of them through
the second alone). ``compute_table(..., published=True)`` reproduces the first
(``test_planner_rotor.py`` shows it on 2 stages); the default is the recursion above, which
brute force checks (every sequence of up to 6 stages).
ColossalAI's port also counts a backward as ``wx[s] + wxb[s] + ob[s]``, without ``d[s-1]``: its
``ob`` must then include that gradient, as ckplan's ``bwd_tmp_bytes`` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

INF = float("inf")

# one op of a sequence: (kind, stage) with kind in FALL, FCK, FN, B; stages 1..L+1 (L+1: the loss)
FALL, FCK, FN, B = "Fall", "Fck", "Fn", "B"
Op = tuple[str, int]


@dataclass(frozen=True)
class RotorChain:
    """Rotor's chain. Per-stage tuples are indexed by stage ``l`` = 1..L+1 (index 0 unused, 0.0 or
    0); ``wx`` by tensor: ``wx[0]`` the input, ``wx[l]`` stage l's output, ``wx[L+1] = 0``."""

    uf: tuple[float, ...]
    ub: tuple[float, ...]
    wx: tuple[int, ...]
    wxb: tuple[int, ...]
    of: tuple[int, ...]
    ob: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.uf)
        assert n >= 2 and all(len(v) == n for v in (self.ub, self.wx, self.wxb, self.of, self.ob))
        assert self.wx[-1] == 0 and self.wxb[-1] == 0, "the loss stage keeps and makes nothing"
        assert all(self.wxb[k] >= self.wx[k] for k in range(1, n)), "xbar includes x"
        assert all(isinstance(v, int) and v >= 0 for t in (self.wx, self.wxb, self.of, self.ob) for v in t)

    @property
    def L(self) -> int:
        """Chain stages (the loss, stage L + 1, aside)."""
        return len(self.uf) - 2

    @cached_property
    def base_ms(self) -> float:
        """Every stage's forward and backward once: the makespan without recompute."""
        return float(sum(self.uf[1:]) + sum(self.ub[1:]))


def random_rotor_chain(L: int, seed: int, *, max_size: int = 10) -> RotorChain:
    """``L`` heterogeneous stages and a loss: integer sizes up to a few ``max_size`` and integer
    times (sums of them are exact in floating point)."""
    rng = np.random.default_rng(seed)

    def r(lo: int, hi: int) -> int:
        return int(rng.integers(lo, hi + 1))

    wx = [r(1, max_size)] + [r(1, max_size) for _ in range(L)] + [0]
    wxb = [0] + [wx[k] + r(0, 2 * max_size) for k in range(1, L + 1)] + [0]
    of = [0] + [r(0, max_size // 2) for _ in range(L + 1)]
    ob = [0] + [r(0, max_size // 2) for _ in range(L + 1)]
    uf = [0.0] + [float(r(1, 20)) for _ in range(L)] + [float(r(1, 5))]
    ub = [0.0] + [float(r(1, 40)) for _ in range(L)] + [float(r(1, 5))]
    return RotorChain(tuple(uf), tuple(ub), tuple(wx), tuple(wxb), tuple(of), tuple(ob))


# ---- the simulator ---------------------------------------------------------------------------

def simulate(rc: RotorChain, ops: list[Op] | tuple[Op, ...]) -> tuple[int, float]:
    """(peak bytes, recompute time) of an op sequence, by tracking the live tensors; raises
    ValueError on a sequence that reads a tensor it does not have or does not end with ``d[0]``."""
    last = rc.L + 1
    live: dict[tuple[str, int], int] = {("x", 0): rc.wx[0]}
    mem = rc.wx[0]
    peak = mem
    runs = [0] * (last + 1)

    def has_x(j: int) -> bool:
        return ("x", j) in live or ("xb", j) in live

    def need(cond: bool, op: Op) -> None:
        if not cond:
            raise ValueError(f"op {op} lacks its inputs (live: {sorted(live)})")

    for op in ops:
        kind, k = op
        need(1 <= k <= last, op)
        if kind in (FALL, FCK, FN):
            need(has_x(k - 1) if kind != FN else ("x", k - 1) in live, op)
            made = ("xb", k) if kind == FALL else ("x", k)
            need(made not in live, op)
            size = rc.wxb[k] if kind == FALL else rc.wx[k]
            peak = max(peak, mem + size + rc.of[k])
            live[made] = size
            mem += size
            if kind == FN:
                mem -= live.pop(("x", k - 1))
            runs[k] += 1
        elif kind == B:
            need(("xb", k) in live and has_x(k - 1) and (k == last or ("d", k) in live), op)
            peak = max(peak, mem + rc.wx[k - 1] + rc.ob[k])
            mem -= live.pop(("xb", k)) + live.pop(("d", k), 0)
            live[("d", k - 1)] = rc.wx[k - 1]
            mem += rc.wx[k - 1]
            if ("x", k - 1) in live:  # a checkpoint: its recompute, if any, starts further back
                mem -= live.pop(("x", k - 1))
        else:
            raise ValueError(f"unknown op {op}")
    if set(live) != {("d", 0)}:
        raise ValueError(f"the sequence ends with {sorted(live)} live, not the input's gradient alone")
    if any(k == 0 for k in runs[1:]):
        raise ValueError("some stage never ran forward")
    recompute = sum((runs[k] - 1) * rc.uf[k] for k in range(1, last + 1))
    return peak, float(recompute)


def no_checkpoint_ops(rc: RotorChain) -> list[Op]:
    """Every stage run with ``F_all``, then every backward."""
    last = rc.L + 1
    return [(FALL, k) for k in range(1, last + 1)] + [(B, k) for k in range(last, 0, -1)]


# ---- the dynamic program ---------------------------------------------------------------------

@dataclass
class Table:
    rc: RotorChain
    mmax: int
    opt: dict[tuple[int, int], np.ndarray]  # (s, t) -> least recompute for m = 0..mmax (inf: none)
    what: dict[tuple[int, int], np.ndarray]  # (s, t) -> 0: F_all branch, s' > s: checkpoint to s'

    def recompute(self, budget: int) -> float:
        """Least recompute of a sequence whose peak is at most ``budget`` (``x[0]`` included)."""
        m = budget - self.rc.wx[0]
        if m < 0:
            return INF
        if m > self.mmax:
            raise ValueError(f"budget {budget} above the table's {self.mmax + self.rc.wx[0]}")
        return float(self.opt[1, self.rc.L + 1][m])

    def makespan(self, budget: int) -> float:
        """The paper's objective: recompute plus every stage's forward and backward once."""
        return self.recompute(budget) + self.rc.base_ms

    def min_peak(self) -> int | None:
        """The least budget with a sequence (None: none within the table)."""
        ok = np.flatnonzero(np.isfinite(self.opt[1, self.rc.L + 1]))
        return int(ok[0]) + self.rc.wx[0] if len(ok) else None

    def sequence(self, budget: int) -> list[Op]:
        """The optimal sequence at ``budget`` (ValueError when none fits)."""
        if not np.isfinite(self.recompute(budget)):
            raise ValueError(f"no sequence fits {budget} bytes")
        out: list[Op] = []
        # an explicit stack: ("seq", s, t, m) expands, ("op", op) emits
        stack: list[tuple] = [("seq", 1, self.rc.L + 1, budget - self.rc.wx[0])]
        while stack:
            task = stack.pop()
            if task[0] == "op":
                out.append(task[1])
                continue
            _, s, t, m = task
            assert np.isfinite(self.opt[s, t][m])
            if s == t:
                out += [(FALL, s), (B, s)]
                continue
            sp = int(self.what[s, t][m])
            if sp == 0:
                out.append((FALL, s))
                stack += [("op", (B, s)), ("seq", s + 1, t, m - self.rc.wxb[s])]
            else:
                out += [(FCK, s)] + [(FN, k) for k in range(s + 1, sp)]
                stack += [("seq", s, sp - 1, m), ("seq", sp, t, m - self.rc.wx[sp - 1])]
        return out


def compute_table(rc: RotorChain, mmax: int, *, published: bool = False) -> Table:
    """``Opt(s, t, m)`` for every sub-chain and ``m = 0..mmax`` (vectorised over ``m``).
    ``published=True``: the ``F_all`` branch's forward checked beside ``d[s]`` as in rotor's code
    (see the module doc), not beside ``d[t]``."""
    last = rc.L + 1
    wx, wxb, of, ob, uf = rc.wx, rc.wxb, rc.of, rc.ob, rc.uf
    ms = np.arange(mmax + 1)
    opt: dict[tuple[int, int], np.ndarray] = {}
    what: dict[tuple[int, int], np.ndarray] = {}

    def shifted(a: np.ndarray, k: int) -> np.ndarray:
        """``a[m - k]`` at each m (inf where m < k)."""
        out = np.full(mmax + 1, INF)
        if k <= mmax:
            out[k:] = a[:mmax + 1 - k]
        return out

    for d in range(last):
        for s in range(1, last - d + 1):
            t = s + d
            need_b = wx[s] + wxb[s] + wx[s - 1] + ob[s]
            if d == 0:
                need = max(wx[s] + wxb[s] + of[s], need_b)
                opt[s, t] = np.where(ms >= need, 0.0, INF)
                what[s, t] = np.zeros(mmax + 1, dtype=np.int32)
                continue
            fwd_all = (max(wx[s] + wxb[s] + of[s], wx[t] + wx[s] + of[s]) if published
                       else wx[t] + wxb[s] + of[s])
            best = shifted(opt[s + 1, t], wxb[s])
            best[ms < max(fwd_all, need_b)] = INF
            choice = np.zeros(mmax + 1, dtype=np.int32)
            leaf = np.full(mmax + 1, INF)
            leaf_at = np.zeros(mmax + 1, dtype=np.int32)
            fwd = 0  # the checkpoint's first forward: its largest op beside d[t]
            fsum = 0.0
            for sp in range(s + 1, t + 1):
                k = sp - 1
                fwd = max(fwd, wx[k] + of[k] + (wx[k - 1] if k > s else 0))
                fsum += uf[k]
                cand = fsum + shifted(opt[sp, t], wx[sp - 1]) + opt[s, sp - 1]
                cand[ms < wx[t] + fwd] = INF
                better = cand < leaf  # the first s' among equals
                leaf[better] = cand[better]
                leaf_at[better] = sp
            use = leaf <= best  # a checkpoint where it ties (as rotor does)
            best[use] = leaf[use]
            choice[use] = leaf_at[use]
            opt[s, t] = best
            what[s, t] = choice
    return Table(rc, mmax, opt, what)


# ---- the mapping to ckplan -------------------------------------------------------------------

def to_ckplan(rc: RotorChain, persistent: int = 0):
    """The ckplan ``Chain`` whose simulator gives every plan rotor's peak plus ``persistent``.

    Layer ``k`` (0-based) is stage ``k + 1``: ``fwd_ms = uf``, ``bwd_ms = ub``, ``x_bytes = wx``,
    ``xbar_bytes = wxb``, ``fwd_tmp_bytes = of`` and ``bwd_tmp_bytes = ob + wx[k]``: ckplan's
    backward transient sits above the live bytes at the backward's start, rotor's above those plus
    the gradient ``d[k]`` the backward makes. Pre holds the input (``retained_bytes = x_in_bytes =
    wx[0]``) and the input needs a gradient (``delta_in_bytes = wx[0]``: rotor's ``B(1)`` makes
    ``d[0]``). Post is the loss stage: keeps nothing (``xbar_bytes = 0``), ``fwd_tmp_bytes = of``,
    ``bwd_tmp_bytes = ob + wx[L]`` (the gradient it makes), times ``uf``, ``ub``. ``persistent``
    is a constant offset: ``persistent_bytes`` and the optimizer step's absolute peak. Everything
    rotor does not model is neutral: no parameter gradients (``grad_bytes``, pre's and post's), no
    loss tensor (``loss_bytes``), no tails or early stops, every output kept (``x_kept``,
    ``x_kept_next``), nothing in place, no options, casts, side inputs, held layers or offload.
    """
    from ckplan.planner.chain import Chain, Layer, Post, Pre

    L = rc.L
    layers = tuple(Layer(f"stage{k + 1}", rc.uf[k + 1], rc.ub[k + 1], rc.wx[k + 1], rc.wxb[k + 1],
                         rc.of[k + 1], rc.ob[k + 1] + rc.wx[k], 0) for k in range(L))
    post = Post(0, rc.of[L + 1], rc.ob[L + 1] + rc.wx[L], 0, rc.uf[L + 1], rc.ub[L + 1])
    return Chain(layers, Pre(rc.wx[0]), post, x_in_bytes=rc.wx[0], delta_in_bytes=rc.wx[0],
                 persistent_bytes=persistent, opt_step_peak_bytes=persistent)


def to_items(ops: list[Op], L: int) -> tuple:
    """ckplan plan items of a persistent sequence (ValueError when it is not one)."""
    from ckplan.planner.plan import Checkpoint, Store

    pos = 0

    def take(kind: str, stage: int) -> None:
        nonlocal pos
        if pos >= len(ops) or ops[pos] != (kind, stage):
            raise ValueError(f"expected {(kind, stage)} at {pos}, got {ops[pos] if pos < len(ops) else None}")
        pos += 1

    def seq(s: int, t: int) -> tuple:
        """The items of the sequence for [s, t] starting at ``pos`` (the loss stage gives none)."""
        nonlocal pos
        if pos >= len(ops):
            raise ValueError("the sequence ends early")
        if ops[pos] == (FALL, s):
            pos += 1
            rest = seq(s + 1, t) if s < t else ()
            take(B, s)
            return ((Store(s - 1),) if s <= L else ()) + rest
        take(FCK, s)
        sp = s + 1
        while pos < len(ops) and ops[pos] == (FN, sp):
            pos += 1
            sp += 1
        if sp > t:
            raise ValueError(f"a checkpoint from stage {s} runs past the sub-chain's end {t}")
        rest = seq(sp, t)
        inner = seq(s, sp - 1)
        return (Checkpoint(s - 1, sp - 1, inner),) + rest

    items = seq(1, L + 1)
    if pos != len(ops):
        raise ValueError(f"ops left over from {pos}")
    return items


def to_ops(items: tuple, L: int) -> list[Op]:
    """The persistent sequence of ckplan plan items of rotor's grammar (the loss after the chain)."""
    from ckplan.planner.plan import Store

    def emit(seq: tuple, top: bool) -> list[Op]:
        if not seq:
            return [(FALL, L + 1), (B, L + 1)] if top else []
        it, rest = seq[0], seq[1:]
        if isinstance(it, Store):
            return [(FALL, it.layer + 1)] + emit(rest, top) + [(B, it.layer + 1)]
        if not rest and not top:
            raise ValueError(f"{it} ends an inner sequence: outside rotor's grammar")
        first = [(FCK, it.start + 1)] + [(FN, k + 1) for k in range(it.start + 1, it.stop)]
        return first + emit(rest, top) + emit(it.inner, False)

    return emit(tuple(items), True)
