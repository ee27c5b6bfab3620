"""Preflight: a meta pass predicts the step's peak; a run that cannot fit stops before it starts."""
import time

import pytest
from typer.testing import CliRunner

from ckplan import api
from ckplan.cli import app
from ckplan.preflight import MARGINS, Available, cpu_available, decide

GiB = 2**30
runner = CliRunner()


def test_decide_with_numbers():
    factor, fixed = MARGINS["cpu"]
    peak = 10 * GiB
    needed = int(peak * factor) + fixed
    assert decide(peak, Available(needed, "test"), "cpu").fits
    v = decide(peak, Available(needed - 1, "test"), "cpu")
    assert not v.fits and v.needed_bytes == needed and v.predicted_peak_bytes == peak
    msg, tip = v.message(), v.tip()
    assert "10 GiB" in msg and "available" in msg and "test" in msg
    assert "--device meta" in tip and "--batch-size" in tip and "--force" in tip
    assert "MALLOC_MMAP_THRESHOLD_=131072" in tip


def test_decide_cuda_margin_and_unknown_memory():
    factor, fixed = MARGINS["cuda"]
    assert factor < MARGINS["cpu"][0]
    v = decide(GiB, Available(int(GiB * factor) + fixed, "mem_get_info"), "cuda")
    assert v.fits and "MALLOC" not in v.tip()
    assert decide(10**15, Available(None, "unknown"), "cpu").fits  # nothing known: nothing refused


def test_cpu_available_reads_meminfo_and_cgroup(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:  32000000 kB\nMemAvailable:  20000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job\n")
    assert cpu_available(proc, cg).bytes == 20000000 * 1024
    (cg / "job").mkdir(parents=True)
    (cg / "job" / "memory.max").write_text(f"{8 * GiB}\n")
    (cg / "job" / "memory.current").write_text(f"{3 * GiB}\n")
    (cg / "job" / "memory.stat").write_text(f"anon 123\ninactive_file {GiB}\n")
    a = cpu_available(proc, cg)
    assert a.bytes == 8 * GiB - (3 * GiB - GiB) and "cgroup" in a.source
    (cg / "job" / "memory.max").write_text("max\n")
    assert cpu_available(proc, cg).bytes == 20000000 * 1024


@pytest.mark.slow
def test_bert_large_on_cpu_stops_before_profiling(configs):
    # The article's example: 8 x 512 BERT-large on a CPU ran for minutes and was killed at 22 GB.
    avail = cpu_available().bytes
    pre = api.preflight(api.load(configs / "bert-large.yaml"), "meta")
    assert pre is None  # nothing to check on meta
    t0 = time.perf_counter()
    r = runner.invoke(app, ["plan", str(configs / "bert-large.yaml"), "--budget", "12GB", "--device", "cpu"])
    elapsed = time.perf_counter() - t0
    if avail is not None and avail > 40 * GiB:
        pytest.skip("this machine has room for BERT-large at 8 x 512")
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "Error:" in out and "predicted to peak at" in out and "available" in out
    assert "--device meta" in out and "--force" in out
    assert elapsed < 60  # a meta pass, not a profile


def test_force_is_accepted_and_small_runs_pass(tiny_gpt_spec, tmp_path):
    spec = tiny_gpt_spec(tmp_path)
    for cmd in (["profile", spec, "--device", "cpu", "--repeats", "1", "--force", "-f", "json"],
                ["plan", spec, "--device", "cpu", "--force", "-f", "json"]):
        r = runner.invoke(app, [str(a) for a in cmd])
        assert r.exit_code == 0, r.output
    v = api.preflight(api.load(spec), "cpu")
    assert v is not None and v.fits and v.predicted_peak_bytes > 0


def test_force_overrides_a_refusal(tiny_gpt_spec, tmp_path, monkeypatch):
    import ckplan.preflight as pf
    monkeypatch.setattr(pf, "cpu_available", lambda: Available(1, "a 1-byte machine"))
    spec = api.load(tiny_gpt_spec(tmp_path))
    with pytest.raises(api.UsageError, match="1-byte machine"):
        api.profile(spec, device="cpu", repeats=1, warmup=0)
    notes = []
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0, force=True, note=notes.append)
    assert prof.totals.measured_peak_bytes > 0 and any("running anyway" in n for n in notes)


def test_meta_pass_failure_skips_with_a_note(tmp_path, monkeypatch):
    (tmp_path / "reads_values.py").write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))\n"
        "    def forward(self, x):\n"
        "        if x.sum().item() > 1e9:\n"
        "            x = x * 0\n"
        "        for l in self.layers:\n"
        "            x = l(x)\n"
        "        return x\n"
        "def make():\n    return M()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from ckplan.spec import validate
    spec = validate({"model": {"target": "reads_values:make"}, "input": {"batch_size": 2, "shape": [4]},
                     "chain": "layers"})
    notes = []
    assert api.preflight(spec, "cpu", note=notes.append) is None
    assert len(notes) == 1 and "preflight skipped" in notes[0] and "\n" not in notes[0]
    assert api.profile(spec, device="cpu", repeats=1, warmup=0, note=notes.append).device == "cpu"
    # the real run works: its own preflight's note is kept, once (held back until it worked)
    assert sum("preflight skipped" in n for n in notes) == 2


def test_a_failed_meta_pass_still_checks_the_batch_and_parameters(tmp_path, monkeypatch):
    # The meta pass cannot run this model, but its batch and parameters are known without it:
    # on a machine too small for them the real run is refused before it allocates anything.
    (tmp_path / "reads_values2.py").write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))\n"
        "    def forward(self, x):\n"
        "        if x.sum().item() > 1e9:\n"
        "            x = x * 0\n"
        "        for l in self.layers:\n"
        "            x = l(x)\n"
        "        return x\n"
        "def make():\n    return M()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import ckplan.preflight as pf
    monkeypatch.setattr(pf, "cpu_available", lambda: Available(1000, "a 1000-byte machine"))
    from ckplan.spec import validate
    spec = validate({"model": {"target": "reads_values2:make"}, "input": {"batch_size": 2, "shape": [4]},
                     "chain": "layers"})
    with pytest.raises(api.UsageError, match=r"the meta pass failed \(.*\), and the parameters, buffers and "
                                             r"batch alone take 192 B .*\(a 1000-byte machine\)"):
        api.profile(spec, device="cpu", repeats=1, warmup=0)
    notes = []
    assert api.preflight(spec, "cpu", force=True, note=notes.append) is None
    assert any("running anyway (force)" in n for n in notes) and any("preflight skipped" in n for n in notes)
