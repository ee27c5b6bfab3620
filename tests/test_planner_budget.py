"""Budget rules: every form with exact bytes worked out by hand on a small chain.

The chain: persistent 1000; pre keeps 20 (the chain input is 10); two layers with x = 10 and
xbar = 30; the post keeps 40. Without checkpointing the live bytes are
pre F 1020 | F0 1050 | F1 1080 | post F 1120 | post B 1120 -> 1090 | B1 -> 1060 | B0 -> 1020 | pre B -> 1000,
so the peak is 1120 (the loss) and the activations held at the end of the forward are 120.
The smallest peak is 1070: C[0,2){C[0,1) S1} keeps 1020 + x1 + post 40 = 1070 at the loss, and
its recompute holds at most 1030 + 30 + 10 = 1070 (every other plan holds at least as much).
"""
from __future__ import annotations

import pytest

from ckplan.errors import UsageError
from ckplan.planner import (
    Budget,
    Chain,
    Layer,
    Post,
    Pre,
    activation_bytes,
    default_budget,
    min_peak,
    no_gain_reason,
    parse_budget,
)


def chain(opt_peak: int = 1000) -> Chain:
    layers = tuple(Layer(f"l{i}", 1.0, 2.0, 10, 30, 0, 0, 0) for i in range(2))
    return Chain(layers, Pre(20), Post(40), x_in_bytes=10, delta_in_bytes=0, persistent_bytes=1000,
                 opt_step_peak_bytes=opt_peak, param_bytes=400, optimizer_bytes=600, optimizer="adamw")


def test_the_chain_by_hand():
    ch = chain()
    assert activation_bytes(ch) == 120
    assert min_peak(ch) == 1070


@pytest.mark.parametrize(("text", "want", "kind"), [
    ("50%act", 1000 + 60, "act-share"),
    ("12.5%act", 1000 + 15, "act-share"),
    ("100%act", 1120, "act-share"),
    (" 25 % ACT ", 1000 + 30, "act-share"),
    ("40%", 448, "peak-share"),  # 1120 * 2 / 5
    ("33.3%", 372, "peak-share"),  # floor(1120 * 333 / 1000) = floor(372.96)
    ("1000%", 11200, "peak-share"),
    ("12GB", 12 * 10**9, "size"),
    ("12GiB", 12 * 2**30, "size"),
    ("500MB", 500 * 10**6, "size"),
    ("4096", 4096, "size"),
    (4096, 4096, "size"),
])
def test_budget_forms(text, want, kind):
    b = parse_budget(text, chain())
    assert (b.bytes, b.kind) == (want, kind)
    assert isinstance(b, Budget) and b.text == str(text).strip() and b.description


def test_act_share_description_shows_both_numbers():
    b = parse_budget("50%act", chain())
    assert b.description == "the peak without checkpointing 1.09 KiB with 50% of its activations 120 B = 1.04 KiB"


def test_100_percent_act_is_the_peak_without_checkpointing():
    # The optimizer step peaks at 1500, above the 1120 of the backward (persistent 1000 + 120 of
    # activations): the memory the step holds besides its activations is kept at every share.
    ch = chain(opt_peak=1500)
    top = parse_budget("100%", ch).bytes
    assert top > ch.persistent_bytes + activation_bytes(ch)
    assert parse_budget("100%act", ch).bytes == top
    assert parse_budget("50%act", ch).bytes == top - 60 and parse_budget("25%act", ch).bytes == top - 90


@pytest.mark.parametrize("text", ["0%", "0%act", "-5%", "-1", "0", "nan", "NaN%", "inf", "1e400",
                                  "1e400%", "101%act", "1001%", "12 parsecs", "%", "act", True])
def test_bad_budgets_are_usage_errors_naming_the_value(text):
    with pytest.raises(UsageError) as err:
        parse_budget(text, chain(), what="--budget")
    assert err.value.exit_code == 2
    assert repr(str(text).strip()) in err.value.message or repr(text) in err.value.message
    assert "50%act" in (err.value.tip or "")


def test_defaults():
    ch = chain()
    assert default_budget(ch, mode="plan", free_device_bytes=None) is None
    free = default_budget(ch, mode="plan", free_device_bytes=5000)
    assert free is not None and (free.bytes, free.kind) == (5000, "device-free")
    half = default_budget(ch, mode="bench", free_device_bytes=5000)
    assert half is not None and (half.bytes, half.kind) == ((1070 + 1120) // 2, "halfway")
    assert "halfway between the smallest feasible peak (1.04 KiB)" in half.description
    # the optimizer step sets every plan's peak: nothing lies between the two sizes
    flat = default_budget(chain(opt_peak=2000), mode="bench", free_device_bytes=None)
    assert flat is not None and flat.description == ("1.95 KiB: the smallest feasible peak equals the peak without "
                                              "checkpointing (1.95 KiB), so checkpoints gain little or nothing here")
    with pytest.raises(ValueError):
        default_budget(ch, mode="sweep", free_device_bytes=None)


def test_no_gain_reason():
    assert no_gain_reason(chain()) is None
    # An optimizer step of 2000 bytes sets every plan's peak.
    reason = no_gain_reason(chain(opt_peak=2000))
    assert reason == ("no checkpointing plan can lower this step's peak (1.95 KiB, reached at optimizer "
                      "step; made of parameters 400 B, optimizer state 600 B, optimizer-step transient "
                      "1000 B); checkpointing still frees the bytes held for backward")
