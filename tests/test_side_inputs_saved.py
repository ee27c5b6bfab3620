"""Side inputs that some of the layers receiving them save (``SideInput.saved_by``): the rotary
``(cos, sin)`` a hybrid model (Qwen3.5, Flint) hands every layer while only its attention layers
multiply it in. Without checkpoints the tensor lives until the backward of the first layer that
saved it; a checkpoint over an earlier layer that receives it keeps it until that checkpoint's
backward.

Oracle: the live-tensor tracker's peak of real training steps under every plan of a six-layer
chain (rotor's grammar), predicted to the byte. Profiled as the maker's saved bytes, held until the
maker's backward, the plans checkpointing layers before the first saver were below the
measurement by the tensor's size (32,768 B here).
"""
from dataclasses import replace

import pytest
from brute_plans import all_plans
from side_nets import B, D, N, RotaryChain, cpu_and_meta, measured_peak, profiled

from ckplan import api
from ckplan.planner import Plan, chain_from_profile, simulate, trace
from ckplan.planner.plan import items_from_ranges
from ckplan.records import SideInput

PE = B * 4 * D * 4  # one (B, 4d) fp32 tensor


def _rotary(uses=(3, 5), maker=-1):
    return profiled(lambda d, n: RotaryChain(d, n, uses, maker), f"rotary{uses}{maker}")


def test_profile_lists_the_saved_side_input_with_its_savers_and_not_in_the_makers_bytes():
    _, _, prof = _rotary()
    assert prof.side_inputs == (SideInput(PE, tuple(range(N)), -1, 0, (3, 5), ()),)
    assert prof.pre.saved_bytes == B * D * 4  # the chain input only: pe is the side input's
    assert prof.totals.activation_bytes == sum(r.saved_bytes for r in prof.layers) + PE
    back = type(prof).from_dict(prof.to_dict())  # JSON round trip
    assert back.side_inputs == prof.side_inputs


# (layers saving it, the layer making it: -1 before the chain). Made by a layer, the tensor reaches
# the layers after the next one from the model's variable, not from the previous layer's output
# (SideInput.unrelayed): a checkpoint over its maker records those calls and keeps it.
CASES = [((3, 4), -1), ((1,), -1), ((0, 3), -1), ((), 0), ((1,), 0), ((2, 4), 0), ((3,), 0)]


@pytest.mark.parametrize("uses,maker", CASES)
def test_every_plan_predicted_to_the_byte(uses, maker):
    n = 5
    model, x, prof = profiled(lambda d, _: RotaryChain(d, n, uses, maker), f"rotary{uses}{maker}")
    chain = chain_from_profile(prof)
    (si,) = chain.side_inputs
    assert (si.saved_by, si.made_by, si.bytes) == (uses, maker, PE)
    assert si.unrelayed == (tuple(range(maker + 2, n)) if maker >= 0 else ())
    p = chain.persistent_bytes
    # read as its maker's saved bytes: the plans holding it longer than layer 0's backward were wrong
    old = chain_from_profile(_as_maker_saved(prof)) if uses and min(uses) > 0 else None
    wrong_before = 0
    for items in all_plans(n):
        plan = Plan("brute", n, items)
        measured = measured_peak(model, x, plan)
        assert simulate(chain, plan).peak_bytes - p == measured, plan.describe()
        if old is not None:
            wrong_before += simulate(old, plan).peak_bytes - p != measured
    assert old is None or wrong_before >= 20


def _as_maker_saved(prof):
    """``prof`` with its saved side input read as it is allocated: in its maker's saved bytes
    (pre's, or the making layer's), held until the maker's backward, and relayed."""
    (si,) = prof.side_inputs
    rows = list(prof.layers)
    rows[si.made_by + 1] = replace(rows[si.made_by + 1], saved_bytes=rows[si.made_by + 1].saved_bytes + si.bytes)
    return replace(prof, layers=tuple(rows), side_inputs=())


def test_a_saver_stored_holds_it_and_a_checkpoint_over_an_earlier_receiver_holds_it_longer():
    _, _, prof = _rotary()
    chain = chain_from_profile(prof)

    def freed_before(ranges):
        ev = trace(chain, Plan("c", N, items_from_ranges(N, ranges)))
        i = next(i for i, e in enumerate(ev) if e.op == "side")
        return ev[i + 1].label

    assert freed_before([]) == "B(layer 2)"  # the plain step: after the backward of layer 3
    assert freed_before([(3, 6)]) == "B(layer 2)"  # the checkpoint over both savers holds it as long
    assert freed_before([(1, 3)]) == "B(layer 0)"  # the checkpoint over layers 1-2 holds it longer
    with pytest.raises(ValueError, match="saved_by"):
        replace(chain, side_inputs=(SideInput(PE, (2, 3), saved_by=(4,)),))


def test_meta_profile_equals_the_cpu_profile():
    cpu, meta = cpu_and_meta(RotaryChain(), "rotary")
    assert meta.side_inputs == cpu.side_inputs
    assert [r.saved_bytes for r in meta.layers] == [r.saved_bytes for r in cpu.layers]


QWEN35 = """
model:
  hf: {model_type: qwen3_5_text, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4,
       num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, vocab_size: 512, use_cache: false,
       linear_key_head_dim: 16, linear_value_head_dim: 16, linear_num_key_heads: 2, linear_num_value_heads: 4,
       layer_types: [linear_attention, linear_attention, linear_attention, full_attention]}
  task: causal-lm
input: {batch_size: 2, shape: [64], dtype: int64, high: 512, name: input_ids, labels: copy}
train: {optimizer: sgd}
"""


def test_hf_qwen35_rotary_saved_by_its_full_attention_layer_only(tmp_path):
    # Qwen3.5 hands the rotary (cos, sin) to every layer; only the full-attention layer 3 uses it.
    # every-k and hf checkpoint layers 0-2 and keep it past layer 3's backward: 4,096 B above
    # their predictions while the profile counted it among pre's saved bytes.
    transformers = pytest.importorskip("transformers")
    if "qwen3_5_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    path = tmp_path / "qwen35.yaml"
    path.write_text(QWEN35)
    spec = api.load(path)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    rotary = [si for si in prof.side_inputs if si.saved_by]
    assert [si.saved_by for si in rotary] == [(3,)]
    assert rotary[0].bytes == 2 * 2 * 64 * 4 * 4  # cos and sin, B x T x 4 (a quarter of head_dim rotates)
    res = api.bench(spec, strategies=["none", "every-k", "dp", "hf"], k=2, device="cpu", steps=1, warmup=0)
    for row in res.rows:
        assert row.status == "ok", (row.strategy, row.message)
        assert row.measured_peak_bytes == row.predicted_peak_bytes, row.strategy
        assert row.max_grad_diff == 0.0
