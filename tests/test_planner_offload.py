"""Activation offload in the planner (planner/transfers.py, planner/solve/offload.py): the replay
against hand arithmetic, the offload DP against brute force over every plan with every choice of
offloaded top-level layers, and plan_dp choosing offload only when it is faster."""
import json
import math
import random

import pytest
from brute_plans import all_plans

from ckplan.errors import InfeasibleBudgetError, SpecError
from ckplan.planner import plan_chain, plan_none, simulate
from ckplan.planner.chain import Chain, Layer, Post, Pre
from ckplan.planner.plan import OFFLOAD, RELEASE, Checkpoint, Plan, Store
from ckplan.planner.simulate import peak_of, trace, with_releases
from ckplan.planner.solve import min_peak, plan_dp
from ckplan.planner.solve.offload import plan_offload


def _three(d2h: float = 45.0, h2d: float = 90.0) -> Chain:
    """Three equal layers: x 10, xbar 100 (so 90 offloadable), fwd 1 ms, bwd 2 ms; post fwd and
    bwd 1 ms."""
    layers = tuple(Layer(f"l{i}", 1.0, 2.0, 10, 100, 5, 7, 3) for i in range(3))
    return Chain(layers, Pre(10), Post(20, fwd_ms=1.0, bwd_ms=1.0, loss_bytes=1), 10, 0, 1000, 1000,
                 d2h_bytes_per_ms=d2h, h2d_bytes_per_ms=h2d)


def test_offloaded_layer_memory_and_time_by_hand():
    chain = _three()
    store = simulate(chain, plan_none(3))
    plan = Plan("x", 3, (Store(0, OFFLOAD), Store(1), Store(2)))
    sc = simulate(chain, plan)
    # 90 bytes leave the device once F(1) is over, and come back before B(1): every op after F(1)
    # and before B(1) runs 90 bytes lower. The post backward was the peak: 1332 - 90.
    assert store.peak_bytes == 1332 and sc.peak_bytes == 1242
    # out: 90 B at 45 B/ms = 2 ms beside F(1)'s 1 ms: 1 ms waited; back: 1 ms beside B(1)'s 2 ms.
    assert sc.transfer_ms == pytest.approx(1.0) and sc.recompute_ms == 0
    assert sc.step_ms == pytest.approx(store.step_ms + 1.0)
    ops = [(e.op, e.stage) for e in trace(chain, plan)]
    assert ops.index(("offloaded", 0)) == ops.index(("F", 1)) + 1
    assert ops.index(("fetch", 0)) == ops.index(("B", 1)) - 1


def test_last_layer_copy_is_waited_for_at_once_and_copied_back_on_demand():
    """The last layer's copy out is waited for right after its own forward (nothing later in the
    forward hides it), and nothing hides its copy back (made at its own backward): both count
    whole, and its bytes are off the device from before the post to its own backward."""
    chain = _three(d2h=90.0, h2d=90.0)  # 1 ms each way
    plan = Plan("x", 3, (Store(0), Store(1), Store(2, OFFLOAD)))
    assert plan.releases() == {2: 2}
    assert simulate(chain, plan).transfer_ms == pytest.approx(2.0)
    labels = [e.label for e in trace(chain, plan)]
    assert labels.index("layer 2's copy to the host done: its saved tensors leave the device") \
        == labels.index("F(layer 2)") + 1 < labels.index("post forward (loss)")
    assert labels.index("layer 2's saved tensors copied back from the host") \
        == labels.index("post backward") + 1 == labels.index("B(layer 2)") - 1


def _five(d2h: float, h2d: float = 1e6) -> Chain:
    """Five equal layers: x 10, xbar 100 (90 offloadable), fwd 1 ms, bwd 2 ms."""
    layers = tuple(Layer(f"l{i}", 1.0, 2.0, 10, 100, 5, 7, 3) for i in range(5))
    return Chain(layers, Pre(10), Post(20, fwd_ms=1.0, bwd_ms=1.0, loss_bytes=1), 10, 0, 1000, 1000,
                 d2h_bytes_per_ms=d2h, h2d_bytes_per_ms=h2d)


def test_copies_queue_behind_the_forward_and_are_released_where_done():
    """Layers 0 and 1 offloaded, each copy 2 ms (90 B at 45 B/ms), each forward 1 ms. Queued, the
    copies run 1-3 ms and 3-5 ms while layers 1-4 run forward (they end at 2, 3, 4, 5 ms): layer 0's
    bytes leave after F(2), layer 1's after F(4), and the step never waits. Released at the next
    layer (a plan's default), the step waits 1 ms after F(1) and 1 ms after F(2)."""
    chain = _five(d2h=45.0)
    items = (Store(0, OFFLOAD), Store(1, OFFLOAD), Store(2), Store(3), Store(4))
    queued = with_releases(chain, Plan("x", 5, items))
    assert queued.releases() == {0: 2, 1: 4}
    sc = simulate(chain, queued)
    assert sc.transfer_ms == pytest.approx(0.0) and sc.step_ms == pytest.approx(simulate(chain, plan_none(5)).step_ms)
    ops = [(e.op, e.stage) for e in trace(chain, queued)]
    assert ops.index(("offloaded", 0)) == ops.index(("F", 2)) + 1
    assert ops.index(("offloaded", 1)) == ops.index(("F", 4)) + 1
    # while in flight the bytes are on the device: F(2) runs with both copies' 180 B
    f2 = next(e for e in trace(chain, queued) if (e.op, e.stage) == ("F", 2))
    assert f2.live_bytes == 1000 + 10 + 10 + 10 + 90 + 90 + 100
    nxt = Plan("x", 5, items)
    assert nxt.releases() == {0: 1, 1: 2}
    assert simulate(chain, nxt).transfer_ms == pytest.approx(2.0)
    assert simulate(chain, nxt).peak_bytes <= sc.peak_bytes


def test_copies_still_in_flight_are_waited_for_after_the_last_forward():
    """Three layers offloaded with 3 ms copies beside 1 ms forwards: the queue is done at 10 ms
    (1 + 3 * 3), the last forward ends at 5 ms, so the step waits 5 ms there, and every copy is
    released by then."""
    chain = _five(d2h=30.0)
    items = (Store(0, OFFLOAD), Store(1, OFFLOAD), Store(2, OFFLOAD), Store(3), Store(4))
    plan = with_releases(chain, Plan("x", 5, items))
    assert plan.releases() == {0: 3, 1: 4, 2: 4}
    assert simulate(chain, plan).transfer_ms == pytest.approx(5.0)


def test_copies_back_wait_only_for_what_the_next_backward_does_not_hide():
    """Copy back of layer 0 (90 B at 30 B/ms: 3 ms) starts with B(1) (2 ms): 1 ms waited."""
    chain = _five(d2h=1e6, h2d=30.0)
    plan = with_releases(chain, Plan("x", 5, (Store(0, OFFLOAD), Store(1), Store(2), Store(3), Store(4))))
    assert simulate(chain, plan).transfer_ms == pytest.approx(1.0)


def test_release_points_round_trip_and_bad_ones_are_refused():
    chain = _five(d2h=45.0)
    plan = with_releases(chain, Plan("x", 5, (Store(0, OFFLOAD), Store(1, OFFLOAD), Store(2), Store(3), Store(4))))
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())), known_options=(OFFLOAD,))
    assert again.releases() == {0: 2, 1: 4}
    assert simulate(chain, again) == simulate(chain, plan)
    for bad in ({"0": 0}, {"1": 5}, {"0": "2"}, [2, 4]):
        broken = Plan("x", 5, plan.items, {RELEASE: bad})
        with pytest.raises(SpecError, match="offload_release"):
            simulate(chain, broken)


def test_held_for_backward_leaves_out_what_went_to_the_host():
    """When the forward ends, every offloaded layer's copy is done, the last one's beside the post."""
    from ckplan.planner.budget import held_for_backward_bytes
    chain = _three()
    none = held_for_backward_bytes(chain, plan_none(3))
    for items, moved in (((Store(0, OFFLOAD), Store(1), Store(2)), 90),
                         ((Store(0), Store(1), Store(2, OFFLOAD)), 90),
                         ((Store(0, OFFLOAD), Store(1, OFFLOAD), Store(2, OFFLOAD)), 270)):
        assert held_for_backward_bytes(chain, Plan("x", 3, items)) == none - moved


def test_offload_needs_a_host_link_and_the_top_level():
    chain = _three(0.0, 0.0)
    with pytest.raises(SpecError, match="no host link"):
        simulate(chain, Plan("x", 3, (Store(0, OFFLOAD), Store(1), Store(2))))
    with pytest.raises(SpecError, match="only a layer stored at the top level"):
        Plan("x", 3, (Checkpoint(0, 2, (Store(0, OFFLOAD), Store(1))), Store(2)))


def test_offload_plan_round_trips_through_json():
    plan = Plan("dp", 3, (Store(0, OFFLOAD), Checkpoint(1, 3, (Store(1), Store(2)))))
    d = plan.to_dict()
    assert d["options"] == [OFFLOAD, "store", "store"]
    assert Plan.from_dict(d, known_options=(OFFLOAD,)) == plan


def _with_offloads(items: tuple):
    """``items`` with every subset of its top-level stores offloaded."""
    tops = [k for k, it in enumerate(items) if isinstance(it, Store)]
    for mask in range(1 << len(tops)):
        out = list(items)
        for b, k in enumerate(tops):
            if mask >> b & 1:
                out[k] = Store(out[k].layer, OFFLOAD)
        yield tuple(out)


def _random_chain(rng: random.Random, n: int) -> Chain:
    layers = []
    for i in range(n):
        x = rng.randint(1, 6) * 8
        layers.append(Layer(f"l{i}", float(rng.randint(1, 5)), float(rng.randint(1, 8)), x,
                            x + rng.randint(0, 12) * 8, rng.randint(0, 4) * 8, rng.randint(0, 4) * 8,
                            rng.randint(0, 3) * 8))
    return Chain(tuple(layers), Pre(16), Post(16, fwd_ms=1.0, bwd_ms=2.0, loss_bytes=8), 16, 0, 100, 100,
                 d2h_bytes_per_ms=float(rng.choice([8, 16, 64])), h2d_bytes_per_ms=float(rng.choice([8, 16, 64])))


@pytest.mark.parametrize("seed", range(8))
def test_offload_dp_matches_brute_force(seed):
    """At every budget a brute-force plan reaches: the DP's plan fits and adds exactly the least
    time (recompute + copies not hidden) of any plan, offloaded or not, copies back starting at the
    next layer's backward (the fetch points ``lookahead`` moves are tested below)."""
    rng = random.Random(seed)
    for _ in range(4):
        chain = _random_chain(rng, rng.randint(2, 5))
        n = chain.n_layers
        scores = [(*peak_of(chain, its), its) for items in all_plans(n, True) for its in _with_offloads(items)]
        none_peak = simulate(chain, plan_none(n)).peak_bytes
        for budget in sorted({p for p, _, _ in scores} | {min(p for p, _, _ in scores) - 1}):
            fit = [t for p, t, _ in scores if p <= budget]
            want = min(fit) if fit else math.inf
            got = plan_offload(chain, budget, none_peak, lookahead=False)
            if want == math.inf:
                assert got is None
                continue
            assert got is not None, (budget, want)
            sc = simulate(chain, got)
            assert sc.peak_bytes <= budget
            assert sc.recompute_ms + sc.transfer_ms == pytest.approx(want, abs=1e-9), (budget, got.describe())


def test_plan_dp_offloads_only_when_faster():
    """plan_dp with a host link: never over budget, never slower than without one, offloading
    only where that is strictly faster (and where no plan without offload fits)."""
    rng = random.Random(11)
    offloaded_somewhere = below_floor = 0
    for _ in range(12):
        chain = _random_chain(rng, 5)
        plain = Chain(chain.layers, chain.pre, chain.post, chain.x_in_bytes, chain.delta_in_bytes,
                      chain.persistent_bytes, chain.opt_step_peak_bytes)
        none_peak = simulate(chain, plan_none(5)).peak_bytes
        floor = min_peak(plain)
        for budget in range(floor - 64, none_peak, 8):
            try:
                without = simulate(plain, plan_dp(plain, budget).plan)
            except InfeasibleBudgetError:
                without = None
            try:
                res = plan_dp(chain, budget)
            except InfeasibleBudgetError:
                assert plan_offload(chain, budget, none_peak) is None
                continue
            sc = simulate(chain, res.plan)
            assert sc.peak_bytes <= budget
            if without is None:
                below_floor += 1
                assert OFFLOAD in res.plan.options()
                continue
            assert sc.step_ms <= without.step_ms + 1e-9
            if OFFLOAD in res.plan.options():
                offloaded_somewhere += 1
                assert sc.step_ms < without.step_ms
                assert any("offloaded to host memory" in note for note in res.notes)
    assert offloaded_somewhere


def test_no_host_link_no_offload():
    chain = _three(0.0, 0.0)
    budget = simulate(chain, plan_none(3)).peak_bytes - 1
    assert OFFLOAD not in plan_chain(chain, "dp", budget).plan.options()


def test_among_equal_times_the_fewest_layers_are_offloaded():
    """Copies hidden whole (a fast link): offloading costs nothing, so any number of offloaded
    layers ties; a budget one byte under none's peak needs one, and one is what dp offloads."""
    chain = _three(d2h=1e4, h2d=1e4)
    none_peak = simulate(chain, plan_none(3)).peak_bytes
    plan = plan_dp(chain, none_peak - 1).plan
    sc = simulate(chain, plan)
    assert sc.peak_bytes <= none_peak - 1 and sc.transfer_ms == 0 and sc.recompute_ms == 0
    assert plan.options().count(OFFLOAD) == 1


@pytest.mark.parametrize("seed", range(6))
def test_offload_plans_fit_on_chains_beyond_rotors(seed):
    """Autocast copies, outputs no op keeps and side inputs (what the offload DP bounds from the
    safe side): at every budget from the smallest peak up, plan_dp with a host link fits, is never
    slower than without one, and offloads only top-level stores."""
    from dataclasses import replace

    from ckplan.records import SideInput
    rng = random.Random(100 + seed)
    base = _random_chain(rng, 5)
    layers = tuple(replace(ly, cast_bytes=rng.choice([0, 8, 16]), x_kept=rng.random() > 0.3,
                           xbar_bytes=ly.xbar_bytes + ly.x_bytes) for ly in base.layers)
    chain = replace(base, layers=layers, side_inputs=(SideInput(24, (1, 3)),))
    plain = replace(chain, d2h_bytes_per_ms=0.0, h2d_bytes_per_ms=0.0)
    none_peak = simulate(chain, plan_none(5)).peak_bytes
    for budget in range(min_peak(plain), none_peak, 8):
        res = plan_dp(chain, budget)
        sc = simulate(chain, res.plan)
        assert sc.peak_bytes <= budget
        assert sc.step_ms <= simulate(plain, plan_dp(plain, budget).plan).step_ms + 1e-9
        top = {it.layer for it in res.plan.items if isinstance(it, Store)}
        assert all(i in top for i, o in enumerate(res.plan.options()) if o == OFFLOAD)


def test_bench_gives_a_plan_file_without_release_points_the_queued_ones():
    """A hand-written plan that offloads (no params.offload_release) is benched with the release
    points its profile's copies reach, not with a wait at every next layer."""
    from ckplan.bench.plans import plan_entries
    chain = _five(d2h=45.0)
    plan = Plan("hand", 5, (Store(0, OFFLOAD), Store(1, OFFLOAD), Store(2), Store(3), Store(4)))
    (entry,) = plan_entries(chain, [], None, 2, {"plan:hand": plan})
    assert entry.plan.releases() == {0: 2, 1: 4}
    assert entry.predicted_overhead == pytest.approx(0.0)
    assert simulate(chain, plan).transfer_ms == pytest.approx(2.0)  # the plan as written: next-layer waits


def _with_choices(items: tuple, layers, moved: bool = False) -> "list[tuple]":
    """``items`` with every choice for each top-level store: stored, offloaded, or one of its
    layer's selective options (``moved``: each also with what it keeps offloaded)."""
    from itertools import product
    tops = [k for k, it in enumerate(items) if isinstance(it, Store)]
    choices = [("store", OFFLOAD, *(o.name for o in layers[items[k].layer].options),
                *((f"{o.name}+offload" for o in layers[items[k].layer].options) if moved else ()))
               for k in tops]
    out = []
    for pick in product(*choices):
        cur = list(items)
        for k, name in zip(tops, pick):
            cur[k] = Store(cur[k].layer, name)
        out.append(tuple(cur))
    return out


def _chain_with_options(rng: random.Random, n: int) -> Chain:
    from dataclasses import replace

    from ckplan.planner.layer import Option
    base = _random_chain(rng, n)
    layers = []
    for ly in base.layers:
        opts = []
        for k in range(rng.randint(0, 2)):
            keep = rng.randint(ly.x_bytes // 8, ly.xbar_bytes // 8) * 8
            opts.append(Option(f"sac-{k}", keep, float(rng.randint(0, 3)) / 2, rng.randint(0, 3) * 8,
                               ly.bwd_tmp_bytes + rng.randint(0, 3) * 8))
        layers.append(replace(ly, options=tuple(opts)))
    return replace(base, layers=tuple(layers))


@pytest.mark.parametrize("casts, moved", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("seed", range(5))
def test_offload_dp_with_selective_options_matches_brute_force(seed, casts, moved):
    """Top-level stores may also take a selective option: at every budget the DP's plan fits and
    adds exactly the least time of any plan whose top-level stores are stored, offloaded or given
    an option (inner plans without options, as the DP plans them); with ``casts`` the layers and
    options (and pre, and stored layers' unsaved ones) also hold autocast copies to the forward's
    end; with ``moved`` an option may also send
    what it keeps to the host (``sac-0+offload``)."""
    from dataclasses import replace
    rng = random.Random(300 + seed + 50 * casts + 100 * moved)
    for _ in range(3):
        chain = replace(_chain_with_options(rng, rng.randint(2, 4)), offload_options=moved)
        if casts:  # pre's and stored layers' unsaved copies too (a bias's)
            layers = []
            for ly in chain.layers:
                cast = rng.choice([0, 8, 16])
                layers.append(replace(ly, cast_bytes=cast, unsaved_cast_bytes=rng.choice([0, 8]) if cast else 0,
                                      options=tuple(replace(o, cast_bytes=rng.choice([0, 8])) for o in ly.options)))
            chain = replace(chain, layers=tuple(layers), pre=replace(chain.pre, cast_bytes=rng.choice([0, 8])))
        n = chain.n_layers
        scores = [(*peak_of(chain, its), its) for items in all_plans(n, True)
                  for its in _with_choices(items, chain.layers, moved)]
        none_peak = simulate(chain, plan_none(n)).peak_bytes
        for budget in sorted({p for p, _, _ in scores}):
            want = min(t for p, t, _ in scores if p <= budget)
            got = plan_offload(chain, budget, none_peak, lookahead=False)
            assert got is not None, budget
            sc = simulate(chain, got)
            assert sc.peak_bytes <= budget
            assert sc.recompute_ms + sc.transfer_ms == pytest.approx(want, abs=1e-9), (budget, got.describe())


def test_a_copy_back_started_earlier_is_hidden_by_more_backward():
    """Layer 0's copy back takes 3 ms (90 B at 30 B/ms). Started at B(1) (2 ms) the step waits
    1 ms; started at B(2) (its fetch point 2) it has B(2) and B(1), 4 ms, and the bytes are on the
    device from B(2) on instead."""
    from ckplan.planner.plan import FETCH
    chain = _five(d2h=1e6, h2d=30.0)
    items = (Store(0, OFFLOAD), Store(1), Store(2), Store(3), Store(4))
    late, early = Plan("x", 5, items), Plan("x", 5, items, {FETCH: {0: 2}})
    assert late.fetches() == {0: 1} and early.fetches() == {0: 2}
    assert simulate(chain, late).transfer_ms == pytest.approx(1.0)
    assert simulate(chain, early).transfer_ms == pytest.approx(0.0)
    ops = [(e.op, e.stage) for e in trace(chain, early)]
    assert ops.index(("fetch", 0)) == ops.index(("B", 2)) - 1
    assert simulate(chain, early).peak_bytes >= simulate(chain, late).peak_bytes
    for bad in ({"0": 0}, {"0": 5}, {"0": 2.0}):
        with pytest.raises(SpecError, match="offload_fetch"):
            simulate(chain, Plan("x", 5, items, {FETCH: bad}))
    again = Plan.from_dict(json.loads(json.dumps(early.to_dict())), known_options=(OFFLOAD,))
    assert again.fetches() == {0: 2}


def _fetch_variants(items: tuple, n: int) -> "list[dict[int, int]]":
    """Every choice of fetch points (up to the lookahead) for the offloaded layers of ``items``."""
    from itertools import product

    from ckplan.planner import limits
    offl = [it.layer for it in items if isinstance(it, Store) and it.option == OFFLOAD and it.layer < n - 1]
    ranges = [range(i + 1, min(i + limits.OFFLOAD_LOOKAHEAD, n - 1) + 1) for i in offl]
    return [dict(zip(offl, pick)) for pick in product(*ranges)]


@pytest.mark.parametrize("seed", range(5))
def test_earlier_copies_back_fit_and_never_cost_more(seed):
    """With fetch points moved (``lookahead``): at every budget the plan fits, adds no more time
    than the best plan fetching at the next layer, and no less than the best of every plan with
    every choice of fetch points (brute force)."""
    from ckplan.planner.simulate import simulate_items
    rng = random.Random(700 + seed)
    for _ in range(3):
        chain = _random_chain(rng, rng.randint(3, 5))
        n = chain.n_layers
        default, every = [], []
        for items in all_plans(n, True):
            for its in _with_offloads(items):
                p, t = peak_of(chain, its)
                default.append((p, t))
                for f in _fetch_variants(its, n):
                    sc = simulate_items(chain, its, fetches=f)
                    every.append((sc.peak_bytes, sc.recompute_ms + sc.transfer_ms))
        none_peak = simulate(chain, plan_none(n)).peak_bytes
        for budget in sorted({p for p, _ in default}):
            lo = min(t for p, t in every if p <= budget)
            hi = min(t for p, t in default if p <= budget)
            got = plan_offload(chain, budget, none_peak)
            sc = simulate(chain, got)
            assert sc.peak_bytes <= budget
            assert lo - 1e-9 <= sc.recompute_ms + sc.transfer_ms <= hi + 1e-9, (budget, got.describe())


def test_dp_moves_a_waiting_copy_back_earlier_where_the_budget_allows():
    """Offloading layer 0 costs 0.5 ms of waiting (a 2.5 ms copy back beside B(1)'s 2 ms), less
    than recomputing a layer (1 ms): at a budget with room for its bytes from B(2) on, dp starts
    the copy there and waits for nothing."""
    from ckplan.planner.plan import FETCH
    chain = _five(d2h=1e6, h2d=36.0)
    none = simulate(chain, plan_none(5))
    items = (Store(0, OFFLOAD), Store(1), Store(2), Store(3), Store(4))
    late, early = simulate(chain, Plan("x", 5, items)), simulate(chain, Plan("x", 5, items, {FETCH: {0: 2}}))
    assert late.transfer_ms == pytest.approx(0.5) and early.transfer_ms == 0
    assert early.peak_bytes < none.peak_bytes
    got = plan_offload(chain, early.peak_bytes, none.peak_bytes)
    sc = simulate(chain, got)
    assert got.options()[0] == OFFLOAD and got.fetches()[0] >= 2 and sc.transfer_ms == 0
    assert sc.peak_bytes <= early.peak_bytes
    assert plan_offload(chain, early.peak_bytes, none.peak_bytes, lookahead=False).fetches() == {0: 1}


def test_dp_offloads_a_layer_whose_copy_back_only_an_earlier_start_hides():
    """Layer 0's copy back takes 4 ms: beside B(1) alone (2 ms) it waits 2 ms, more than a
    checkpoint of one layer costs (1 ms), so the DP with copies back at the next layer checkpoints
    instead; started at B(2) it is hidden. At a budget with room for that, dp offloads layer 0 and
    starts its copy back at B(2): no recompute, no wait."""
    from ckplan.planner import limits
    from ckplan.planner.plan import FETCH
    chain = _five(d2h=1e6, h2d=22.5)
    none = simulate(chain, plan_none(5))
    items = (Store(0, OFFLOAD), Store(1), Store(2), Store(3), Store(4))
    late, early = simulate(chain, Plan("x", 5, items)), simulate(chain, Plan("x", 5, items, {FETCH: {0: 2}}))
    assert late.transfer_ms == pytest.approx(2.0) and early.transfer_ms == 0
    narrow = plan_offload(chain, early.peak_bytes, none.peak_bytes, lookahead=False)
    assert OFFLOAD not in narrow.options() and simulate(chain, narrow).recompute_ms == pytest.approx(1.0)
    got = plan_offload(chain, early.peak_bytes, none.peak_bytes)
    sc = simulate(chain, got)
    assert sc.peak_bytes <= early.peak_bytes and sc.recompute_ms + sc.transfer_ms == 0
    assert OFFLOAD in got.options() and min(got.fetches().values()) >= 2
    assert chain.n_layers <= limits.OFFLOAD_WIDE_MAX_LAYERS


@pytest.fixture(scope="module")
def gpt2_h100_chain():
    """gpt2-small at 8 x 512 on fake tensors, priced as an H100 (data sheet), selective options
    measured: a real chain on which the offload DP keeps many states."""
    from pathlib import Path

    from ckplan import api
    from ckplan.planner import chain_from_profile
    spec = api.load(Path(__file__).resolve().parents[1] / "configs/gpt2-small.yaml", batch_size=8, optimizer="sgd")
    return chain_from_profile(api.profile(spec, device="meta", meta_target="h100", options=True))


def test_offload_dp_keeps_enough_states_to_stay_exact_on_a_real_chain(gpt2_h100_chain, monkeypatch):
    """The DP keeps at most a few hundred states per unit (limits.OFFLOAD_MAX_STATES); against the
    same DP with no cap (exact: dominance drops no optimum, brute force above) it finds a plan at
    every budget and the same least time. With 32 states it found none at three of these budgets."""
    from ckplan.planner import limits
    from ckplan.planner.solve import min_peak
    chain = gpt2_h100_chain
    none = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    lo = min_peak(chain)
    budgets = [int(lo + f / 12 * (none - lo)) for f in range(1, 12)]
    capped = [plan_offload(chain, b, none, lookahead=False) for b in budgets]
    monkeypatch.setattr(limits, "OFFLOAD_MAX_STATES", 10**6)
    monkeypatch.setattr(limits, "OFFLOAD_STATE_WORK", 10**12)
    for b, got in zip(budgets, capped):
        want = plan_offload(chain, b, none, lookahead=False)
        assert (got is None) == (want is None), b
        if want is not None:
            g, w = simulate(chain, got), simulate(chain, want)
            assert g.peak_bytes <= b
            assert g.recompute_ms + g.transfer_ms == pytest.approx(w.recompute_ms + w.transfer_ms, abs=1e-6), b


def test_an_option_with_what_it_keeps_offloaded_by_hand():
    """Layer 0 has a selective option keeping 55 bytes (its 10-byte output included) and redoing
    0.5 ms. Stored with ``sac-a+offload`` it sends 45 bytes to the host (1 ms at 45 B/ms, hidden by
    F(1)'s 1 ms) instead of the 90 plain ``offload`` sends (2 ms: the step waits 1 ms at F(1)'s end):
    the same device bytes after the release, 0.5 ms of recompute instead of 1 ms of waiting. The
    copy back (45 B at 90 B/ms) starts at B(1) and is done before layer 0's recompute."""
    from dataclasses import replace

    from ckplan.planner.layer import Option
    from ckplan.planner.plan_items import is_offloaded, kept_option
    base = _three()
    chain = replace(base, layers=(replace(base.layers[0], options=(Option("sac-a", 55, 0.5, 0, 7),)),
                                  *base.layers[1:]))
    assert chain.offload_bytes(0) == 90 and chain.offload_bytes(0, "sac-a") == 45
    at_next = {RELEASE: {0: 1}}
    plain = simulate(chain, Plan("x", 3, (Store(0, OFFLOAD), Store(1), Store(2)), at_next))
    moved = simulate(chain, Plan("x", 3, (Store(0, "sac-a+offload"), Store(1), Store(2)), at_next))
    assert plain.transfer_ms == pytest.approx(1.0) and plain.recompute_ms == 0
    assert moved.transfer_ms == 0 and moved.recompute_ms == pytest.approx(0.5)
    assert moved.peak_bytes == plain.peak_bytes == 1242
    ops = [(e.op, e.stage)
           for e in trace(chain, Plan("x", 3, (Store(0, "sac-a+offload"), Store(1), Store(2)), at_next))]
    assert ops.index(("offloaded", 0)) == ops.index(("F", 1)) + 1
    assert ops.index(("fetch", 0)) == ops.index(("B", 1)) - 1
    assert is_offloaded("sac-a+offload") and kept_option("sac-a+offload") == "sac-a"
    assert kept_option(OFFLOAD) == "store" and not is_offloaded("sac-a")
    # the DP finds it: at that peak it is the least time, and only where the chain allows it
    none = simulate(chain, plan_none(3)).peak_bytes
    got = plan_offload(replace(chain, offload_options=True), moved.peak_bytes, none, lookahead=False)
    assert got.options()[0] == "sac-a+offload"
    assert "sac-a+offload" not in plan_offload(chain, moved.peak_bytes, none, lookahead=False).options()


def test_an_offloaded_option_round_trips_and_is_refused_where_it_cannot_run():
    """A plan file may name ``sac-compute+offload`` (ckplan's options); inside a checkpoint, on a
    profile without that option or without a host link, the plan is refused by name."""
    from ckplan.options import PLAN_OPTIONS
    from ckplan.planner.layer import Option
    items = (Store(0, "sac-compute+offload"), Store(1), Store(2))
    plan = Plan("x", 3, items)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())), known_options=PLAN_OPTIONS)
    assert back.options()[0] == "sac-compute+offload" and back.releases() == {0: 1}
    with pytest.raises(SpecError, match="only a layer stored at the top level"):
        Plan("x", 3, (Checkpoint(0, 2, (Store(0, "sac-compute+offload"), Store(1))), Store(2)))
    chain = _three()
    with pytest.raises(SpecError, match="sac-compute"):
        simulate(chain, plan)  # no such option measured
    from dataclasses import replace
    with_opt = replace(chain, layers=(replace(chain.layers[0], options=(Option("sac-compute", 55, 0.5, 0, 7),)),
                                      *chain.layers[1:]))
    assert simulate(with_opt, plan).peak_bytes > 0
    with pytest.raises(SpecError, match="host link"):
        simulate(replace(with_opt, d2h_bytes_per_ms=0.0, h2d_bytes_per_ms=0.0), plan)


def test_dp_chooses_each_copy_backs_start_against_brute_force():
    """The DP prices each offloaded layer's copy back started 1 to ``OFFLOAD_LOOKAHEAD`` layers on,
    with its bytes on the device from there: on this chain, at these budgets, it reaches the best of
    every plan with every choice of fetch points (brute force), which a DP fetching at the next
    layer and moving fetch points afterwards missed (4 ms added where 2 ms is the optimum)."""
    from ckplan.planner.simulate import simulate_items
    rng = random.Random(716)
    for _ in range(3):
        chain = _random_chain(rng, rng.randint(3, 5))
    n = chain.n_layers
    every = []
    for items in all_plans(n, True):
        for its in _with_offloads(items):
            for f in _fetch_variants(its, n):
                sc = simulate_items(chain, its, fetches=f)
                every.append((sc.peak_bytes, sc.recompute_ms + sc.transfer_ms))
    none_peak = simulate(chain, plan_none(n)).peak_bytes
    for budget in (396, 404):
        best = min(t for p, t in every if p <= budget)
        got = plan_offload(chain, budget, none_peak)
        sc = simulate(chain, got)
        assert sc.peak_bytes <= budget and sc.recompute_ms + sc.transfer_ms == pytest.approx(best) == 2.0
        assert any(k > i + 1 for i, k in got.fetches().items())
