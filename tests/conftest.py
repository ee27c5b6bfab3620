import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.fixture(autouse=True)
def _no_planner_prints(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def tiny_gpt_spec(tmp_path: Path, **over) -> Path:
    args = dict(vocab_size=97, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.0)
    args.update(over)
    return write_spec(tmp_path, f"""
model:
  builtin: gpt
  args: {args}
input: {{batch_size: 2, shape: [16], dtype: int64, high: 97, name: input_ids, labels: copy}}
chain: blocks
""", "tiny-gpt.yaml")


sys.path.insert(0, str(Path(__file__).parent))
