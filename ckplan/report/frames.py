"""DataFrames for the CSV files and ``--format csv``: one row per record."""
from __future__ import annotations

from ..records import Profile

# pandas is imported where a frame is built, not at the top: it takes a second or more to import,
# and most commands print JSON or a table without ever building one.


def records_frame(rows):
    import pandas as pd
    return pd.DataFrame([r.to_dict() for r in rows])


def profile_frame(prof: Profile):
    """One row per stage; each measured selective option adds columns ``<option>_<field>``."""
    import pandas as pd
    names = prof.option_names
    rows = []
    for r in prof.layers:
        d = r.to_dict()
        d.pop("options")
        for n in names:
            o = r.option(n)
            for k, v in (o.to_dict() if o is not None else {}).items():
                if k != "name":
                    d[f"{n}_{k}"] = v
        rows.append(d)
    frame = pd.DataFrame(rows)
    # Columns blank on some rows (options and early-stop sizes: not for pre and post) would turn
    # to floats: keep byte and FLOP counts whole numbers beside the blanks, as in the JSON.
    for col in frame.columns:
        if (col.endswith("_bytes") or col.endswith("_flops")) and frame[col].dtype.kind == "f":
            frame[col] = frame[col].astype("Int64")
    return frame


def sweep_frame(points):
    """One row per frontier point; the columns only some strategies have (budget_bytes, k,
    threshold_bytes) stay integers, empty where a strategy has none."""
    import pandas as pd
    frame = pd.DataFrame([p.to_dict() for p in points])
    for col in ("budget_bytes", "k", "threshold_bytes"):
        if col in frame:
            frame[col] = frame[col].astype("Int64")
    return frame


def bench_frame(result):
    import pandas as pd
    return pd.DataFrame([r.to_dict() for r in result.rows])
