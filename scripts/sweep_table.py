"""The results table of a folder of `ckplan bench -f json --out-dir DIR` runs, as markdown.

    python scripts/sweep_table.py reports/cpu/hf-sweep-2 > table.md

Per spec (bench-NAME-DEVICE.json): the `none` row's measured peak, then per strategy the measured
minus the predicted peak of the whole step (`exact` for 0 bytes; negative: measured below the
prediction, the safe side), `[held ...]` where the bytes held for backward when the forward ends
differ, and the largest gradient difference from `none` over the rows.
"""
import json
import sys
from pathlib import Path

STRATEGIES = ("none", "every-k", "dp", "hf")


def cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    if row.get("predicted_peak_bytes") is None:
        return "no prediction"
    diff = row["measured_peak_bytes"] - row["predicted_peak_bytes"]
    text = "exact" if diff == 0 else f"{diff:+,} B ({diff / row['predicted_peak_bytes']:+.2%})"
    held = (row.get("measured_activation_bytes") or 0) - (row.get("predicted_activation_bytes") or 0)
    return text + (f" [held {held:+,}]" if held else "")


def main(folder: str) -> None:
    print("| model | none peak (bytes) | " + " | ".join(STRATEGIES) + " | max grad diff |")
    print("|---|---|" + "---|" * len(STRATEGIES) + "---|")
    for path in sorted(Path(folder).glob("bench-*.json")):
        doc = json.loads(path.read_text())
        rows = {r["strategy"]: r for r in doc["rows"]}
        none = rows.get("none") or {}
        diffs = [r["max_grad_diff"] for r in rows.values() if r.get("max_grad_diff") is not None]
        print(f"| {doc['model']} | {none.get('measured_peak_bytes') or 0:,} | "
              + " | ".join(cell(rows.get(s)) for s in STRATEGIES)
              + f" | {max(diffs, default=float('nan')):.3g} |")


if __name__ == "__main__":
    main(sys.argv[1])
