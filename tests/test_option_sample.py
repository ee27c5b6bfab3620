"""ckplan.profiling.option_sample: the no-save pass and the options on meta measured on three chain
layers give the same profile, to the byte, as measuring them on every layer; where the middle layers
differ it declines."""
from __future__ import annotations

from pathlib import Path

import pytest

import ckplan.profiler as profiler
import ckplan.profiling.option_sample as option_sample
from ckplan.api import load, profile

ROOT = Path(__file__).resolve().parents[1]
GPT7 = """
model:
  builtin: gpt
  args: {vocab_size: 256, block_size: 64, n_layer: 7, n_head: 2, n_embd: 64, dropout: 0.0}
input: {batch_size: 2, shape: [64], dtype: int64, high: 256, name: input_ids, labels: copy}
chain: blocks
train: {optimizer: adamw, precision: fp32, accum: 1}
"""


def _both(spec, monkeypatch, target: str = "cpu", options: bool = True):
    """(profile with sampling, whether it sampled, profile measuring every layer)."""
    used = []
    real = profiler.sampled_passes

    def spy(*a, **k):
        got = real(*a, **k)
        used.append(got is not None)
        return got

    monkeypatch.setattr(profiler, "sampled_passes", spy)
    sampled = profile(spec, device="meta", options=options, meta_target=target)
    monkeypatch.setattr(option_sample, "MIN_LAYERS", 10**9)
    every = profile(spec, device="meta", options=options, meta_target=target)
    assert used[1:] == [False]  # the second profile measured every layer
    return sampled, used[0], every


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_sampled_options_equal_every_layer_gpt(tmp_path, monkeypatch, target):
    p = tmp_path / "gpt7.yaml"
    p.write_text(GPT7)
    sampled, used, every = _both(load(p), monkeypatch, target)
    assert used
    assert all(r.options for r in sampled.chain_layers)
    assert sampled.chain_layers == every.chain_layers
    assert sampled.notes == every.notes


def test_sampled_nosave_pass_equals_every_layer_without_options(tmp_path, monkeypatch):
    """Without options the no-save pass alone is sampled: the same rows (their no-save peaks and
    unsaved bytes included) as running it on every layer."""
    p = tmp_path / "gpt7.yaml"
    p.write_text(GPT7)
    sampled, used, every = _both(load(p), monkeypatch, options=False)
    assert used
    assert not any(r.options for r in sampled.chain_layers)
    assert sampled.chain_layers == every.chain_layers
    assert any(r.nosave_peak_bytes for r in sampled.chain_layers)


def test_sampled_options_equal_every_layer_hf_llama_gqa(monkeypatch):
    pytest.importorskip("transformers")
    spec = load(ROOT / "configs/hf-llama-gqa.yaml")
    sampled, used, every = _both(spec, monkeypatch)
    assert used
    assert sampled.chain_layers == every.chain_layers


def test_alternating_layers_are_measured_one_by_one(monkeypatch):
    """Qwen2 with sliding-window and full attention layers alternating: on transformers 5 the full
    layers get no mask (SDPA's is_causal) and the sliding ones a mask, so the middle layers are not
    one layer and every layer is measured; on transformers 4 every layer gets a mask of one shape.
    The profile is the same either way."""
    transformers = pytest.importorskip("transformers")
    spec = load(ROOT / "configs/hf-qwen2-alt.yaml")
    sampled, used, every = _both(spec, monkeypatch)
    assert not used or int(transformers.__version__.split(".")[0]) < 5
    assert sampled.chain_layers == every.chain_layers


def test_a_model_that_cannot_run_cut_is_measured_layer_by_layer(tmp_path, monkeypatch):
    """A model that calls its layers by index up to a fixed count fails with its chain cut: the
    profile measures every layer instead (and does not fail)."""
    p = tmp_path / "counted.yaml"
    p.write_text('model:\n  target: "side_nets:CountedLayers"\n  args: {width: 32, depth: 5}\n'
                 "input: {batch_size: 4, shape: [32], dtype: float32}\nchain: layers\n")
    sampled, used, every = _both(load(p), monkeypatch)
    assert not used
    assert all(r.options for r in sampled.chain_layers)
    assert sampled.chain_layers == every.chain_layers
