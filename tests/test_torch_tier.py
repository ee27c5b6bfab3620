"""scripts/torch_tier.py: every test it names exists (a renamed test must not leave a check that
runs nothing), every CLI check names a shipped config, and its table reads its documents."""
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("torch_tier", ROOT / "scripts" / "torch_tier.py")
tier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tier)


def test_every_named_test_exists():
    for name, (_, ids) in tier.TESTS.items():
        assert ids, name
        for node in ids:
            path, _, rest = node.partition("::")
            text = (ROOT / path).read_text()
            if rest:
                func = re.split(r"[\[:]", rest)[0]
                assert re.search(rf"^def {func}\(", text, re.M), (name, node)


def test_cli_checks_use_shipped_configs_and_json():
    for name, (_, args) in tier.CLI.items():
        assert args[0] in ("profile", "plan", "bench"), name
        assert (ROOT / args[1]).is_file(), (name, args[1])
        assert args[args.index("--format") + 1] == "json", name


def test_bench_rows_off_their_prediction_fail_the_check():
    ok = {"rows": [{"strategy": "dp", "status": "ok", "predicted_peak_bytes": 1000, "measured_peak_bytes": 1000}]}
    assert tier._bench_problems(ok) == []
    off = {"rows": [{"strategy": "dp", "status": "ok", "predicted_peak_bytes": 1000, "measured_peak_bytes": 1002}]}
    assert tier._bench_problems(off) == ["dp: predicted 1000 B, measured 1002 B"]
    bad = {"rows": [{"strategy": "sqrtn", "status": "wrong-gradients"}]}
    assert tier._bench_problems(bad) == ["sqrtn: wrong-gradients"]
    assert tier._bench_problems({"rows": []}) == ["no rows"]


def test_table_orders_versions_and_marks_failures(tmp_path):
    def doc(version, ok):
        checks = {"gradients": {"status": "pass" if ok else "fail", "passed": 3 if ok else 2, "failed": 0 if ok else 1,
                                "skipped": 0, "seconds": 1.0, "detail": "" if ok else "1 failed"},
                  "cli-plan": {"status": "pass", "seconds": 1.0, "detail": ""}}
        return {"torch": version, "transformers": "5.0", "python": "3.11", "machine": "m", "date": "2026-11-27",
                "checks": checks, "passed": ok}
    for v, ok in (("2.10.0", False), ("2.9.1", True)):
        (tmp_path / f"{v}.json").write_text(json.dumps(doc(v, ok)))
    text = tier.table(sorted(tmp_path.glob("*.json")))
    rows = [line for line in text.splitlines() if line.startswith("| 2.")]
    assert [r.split("|")[1].strip() for r in rows] == ["2.9.1", "2.10.0"]
    assert "pass (3)" in rows[0] and "**fail** (1 of 3)" in rows[1] and rows[1].endswith("**fail** |")
    assert "torch 2.10.0, `gradients`: 1 failed" in text
