"""The live-tensor tracker and storage counting against analytic sizes."""
import pytest
import torch

from ckplan.measure import Clock, LiveTensorTracker, TrackerLimitExceeded, unique_storage_bytes

F32 = 4


def test_new_tensors_count_their_bytes_and_freeing_drops_them():
    with LiveTensorTracker() as tr:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(250, dtype=torch.float64)  # 2000 bytes
        assert tr.live == 1000 * F32 + 250 * 8
        del a
        assert tr.live == 250 * 8
        del b
        assert tr.live == 0
    assert tr.peak == 1000 * F32 + 250 * 8


def test_views_share_a_storage_counted_once():
    with LiveTensorTracker() as tr:
        a = torch.empty(64, 64)
        views = [a[:32], a.t(), a.view(-1), a[::2, ::2]]
        assert tr.live == 64 * 64 * F32
        del a
        assert tr.live == 64 * 64 * F32  # the views still hold the storage
        del views
        assert tr.live == 0


def test_in_place_results_and_tensors_made_before_are_not_counted():
    before = torch.zeros(100)
    with LiveTensorTracker() as tr:
        before.add_(1)  # in place on a tensor the tracker never saw made
        out = before * 2  # a new storage
        assert tr.live == 100 * F32
        out.mul_(3)
        assert tr.live == 100 * F32
        del out
    assert tr.live == 0 and tr.peak == 100 * F32


def test_peak_and_reset_peak():
    with LiveTensorTracker() as tr:
        a = torch.empty(100)
        b = torch.empty(300)
        del b
        assert (tr.live, tr.peak) == (100 * F32, 400 * F32)
        tr.reset_peak()
        assert tr.peak == tr.live == 100 * F32
        c = torch.empty(50)
        assert tr.peak == 150 * F32
        del a, c
    assert tr.live == 0 and tr.peak == 150 * F32


def test_meta_tensors_are_counted_without_memory():
    with LiveTensorTracker() as tr:
        x = torch.empty(1 << 20, 1 << 10, device="meta")  # 4 GiB, never allocated
        assert tr.live == (1 << 30) * F32
        del x
    assert tr.live == 0


def test_limit_bytes_raises_once_live_bytes_pass_it():
    with LiveTensorTracker(limit_bytes=1000 * F32) as tr:
        a = torch.empty(1000)  # exactly at the limit: fine
        with pytest.raises(TrackerLimitExceeded, match=r"4004 bytes, over the limit of 4000"):
            torch.empty(1)
        del a
    assert tr.peak == 1001 * F32


def test_callbacks_see_new_storages_and_inputs():
    allocs, ops = [], []
    w = torch.randn(8, 8)
    with LiveTensorTracker(on_alloc=lambda key, n: allocs.append(n),
                           on_op=lambda func, inputs, new, args, kwargs: ops.append((func, inputs, new))):
        y = w @ w
        v = y.t()  # a view: nothing new
    assert allocs == [8 * 8 * F32]
    (mm, mm_in, mm_new), (_, t_in, t_new) = ops
    assert mm is torch.ops.aten.mm.default and id(w.untyped_storage()) in mm_in
    assert [n for _, n in mm_new] == [8 * 8 * F32] and t_new == []
    assert id(y.untyped_storage()) in t_in and v.untyped_storage().data_ptr() == y.data_ptr()


def test_unique_storage_bytes_counts_each_storage_once():
    a = torch.empty(10, 10)
    b = torch.empty(7, dtype=torch.float16)
    assert unique_storage_bytes(a) == 400
    assert unique_storage_bytes([a, a[0], a.t(), b]) == 400 + 14
    assert unique_storage_bytes({"x": (a[:2], [b, b[1:]]), "n": 3}) == 414
    assert unique_storage_bytes([]) == 0
    # A view counts its whole storage: what keeping it alive costs.
    assert unique_storage_bytes(a[0]) == 400


def test_tensors_in_finds_what_pytree_finds():
    """The tracker's reader of op arguments and outputs against pytree's flatten, on the nests ops
    take and return (named tuples, torch's return types, dicts, scalars and dtypes between)."""
    import collections

    import torch
    from torch.utils._pytree import tree_flatten

    from ckplan.measure.tracker import tensors_in
    a, b = torch.randn(2), torch.randn(3)
    pair = collections.namedtuple("pair", "x y")
    nests = [a, (a,), ((a, [b, {"k": a}]), {"o": b}), (pair(a, b),), ((1, 2.0, None, torch.float32), {}),
             torch.return_types.max((a, b)), ({"z": [a, (b,)], "y": 3},), [], ((), {})]
    for nest in nests:
        want = [t for t in tree_flatten(nest)[0] if isinstance(t, torch.Tensor)]
        got = tensors_in(nest)
        assert len(got) == len(want) and all(x is y for x, y in zip(got, want)), nest


def test_the_clock_times_in_milliseconds_and_takes_the_median_after_a_warm_up():
    import time
    clock = Clock(torch.device("cpu"))
    assert clock.time_ms(lambda: time.sleep(0.02)) >= 20.0
    calls = []
    sleeps = iter([0.0, 0.03, 0.0, 0.01])  # the warm-up (not counted), then 30, 0, 10 ms

    def run():
        calls.append(1)
        time.sleep(next(sleeps))
    assert 10.0 <= clock.median_ms(run, 3) < 30.0 and len(calls) == 4
