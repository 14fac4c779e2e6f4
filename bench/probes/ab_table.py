"""One table of a patch_ab.sh call's step rows: for each configuration (batch, values with their options, target
hit), the step time of every run (a, b, c, a2, b2) side by side, in µs.

    python3 bench/probes/ab_table.py <folder holding a/ b/ (c/)>   (the unpacked ab.tgz, or bench/results/<name>)

The time is the graph of N steps' per-step time where the rows have one (--graph-steps), else the one-step graph's,
else the eager step's; the header says which. Runs the same configuration was not timed in are left empty."""
import glob
import json
import os
import sys

COLUMNS = [("ours_graph_steps_ms", "graph of N steps"), ("ours_graph_ms", "one-step graph"), ("ours_ms", "eager")]


def rows_of(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return data
    return next((v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)), [])


def options_of(row: dict) -> str:
    """The configuration's options as step_benchmark's --config spells them: as recorded (the row's "options"), or,
    in rows written before step_benchmark recorded them, rebuilt from the fields that tell rows apart here."""
    if "options" in row:
        return "+".join([row.get("value_store", ""), *row["options"]])
    parts = [row.get("value_store", "")]
    if row.get("layers", 1) > 1:
        parts.append(f"ly{row['layers']}")
    if row.get("landmark_l2") == "normal":
        parts.append("le0")
    if row.get("select_prefetch") is False:  # session 28's branch landmark-l2-policy, before its prefetch went
        parts.append("sp0")
    if row.get("select_cluster"):
        parts.append(f"s{row['select_cluster']}")
    if row.get("decode_pipeline_parts"):
        parts.append(f"p{row['decode_pipeline_parts']}")
    if row.get("factor_dtype") == "float32":
        parts.append("f32")
    for key, absent, name in (("logits", "auto", None), ("select_hint", True, "sh0"), ("logits_pool", True, "lp0"),
                              ("select_logits", "own", "sls")):
        value = row.get(key, absent)
        if value != absent and value is not None:
            parts.append(name or f"{key}={value}")
    fused = row.get("fused_misses", "auto")
    if fused != "auto":
        parts.append("fm" if fused == "on" else "fm0")
    return "+".join(p for p in parts if p)


def main(argv: list) -> int:
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print(__doc__)
        return 2
    files = sorted(glob.glob(os.path.join(argv[1], "*", "step-*.json")))
    if not files:
        print(f"no */step-*.json under {argv[1]}")
        return 1
    table = {}
    runs = []
    column = None
    for path in files:
        run = os.path.basename(path)[len("step-"):-len(".json")]
        runs.append(run)
        for row in rows_of(path):
            key = (row["batch"], options_of(row), round(row.get("target_hit", row["hit"]), 2))
            if column is None:
                column = next((c for c in COLUMNS if row.get(c[0]) is not None), COLUMNS[-1])
            value = row.get(column[0])
            table.setdefault(key, {})[run] = value * 1e3 if value is not None else None
    order = {"a": 0, "b": 1, "c": 2, "a2": 3, "b2": 4}
    runs = sorted(set(runs), key=lambda r: (order.get(r, 9), r))
    print(f"µs a step ({column[1]}), by run\n")
    print("| B | values, options | hit | " + " | ".join(runs) + " |")
    print("| --- " * (3 + len(runs)) + "|")
    for (batch, options, hit), times in sorted(table.items()):
        cells = [f"{times[r]:.1f}" if times.get(r) is not None else "" for r in runs]
        print(f"| {batch} | {options} | {hit:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
