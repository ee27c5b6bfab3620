"""GPU tier: predicted peaks against torch.cuda.max_memory_allocated. Skipped without CUDA.

Run with: python -m pytest -m gpu
"""
import pytest
import torch

from ckplan import api

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("config,over", [
    ("tiny-gpt", dict(batch_size=8, seq_len=256)),
    ("gpt2-small.yaml", dict(batch_size=4, seq_len=512)),
    ("resnet.yaml", dict(batch_size=32)),
])
def test_predicted_peak_matches_cuda_allocator(configs, tiny_gpt_spec, tmp_path, config, over):
    path = tiny_gpt_spec(tmp_path, n_layer=8, n_embd=256, n_head=4, block_size=256) \
        if config == "tiny-gpt" else configs / config
    spec = api.load(path, **over)
    res = api.bench(spec, strategies=["none", "every-k", "sqrtn", "dp"], budget="70%", k=1,
                    steps=2, warmup=1, device="cuda")
    for r in res.rows:
        if r.status == "infeasible":
            continue
        assert r.status == "ok", r
        assert r.peak_error < 0.05, (r.strategy, r.predicted_peak_bytes, r.measured_peak_bytes)
        assert r.max_grad_diff < 1e-4

