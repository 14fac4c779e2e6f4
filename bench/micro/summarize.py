"""Compact table of a decode_ops_bench JSON file (Google Benchmark's --benchmark_out): one row per benchmark.

    python3 bench/micro/summarize.py bench/results/<date>-<commit>-micro.json

Columns: op, config (B/S/budget), hit (measured; target in brackets), time (µs, mean of the timed iterations),
floor (µs: bytes over the ceiling measured in the same run), time/floor, GB/s. Then, per config and hit rate, the
three value-fetch paths side by side and the fastest.
"""

from __future__ import annotations

import json
import sys

_TO_MICROSECONDS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def _parse_name(name: str) -> tuple[str, dict[str, str]]:
    parts = name.split("/")
    fields = {}
    for part in parts[1:]:
        if ":" in part:
            key, value = part.split(":", 1)
            fields[key] = value
    return parts[0], fields


def rows(results: dict) -> list[dict]:
    out = []
    for bench in results.get("benchmarks", []):
        if bench.get("run_type", "iteration") != "iteration":
            continue
        op, fields = _parse_name(bench.get("run_name", bench["name"]))
        config = ""
        if "B" in fields:
            config = f"B={fields['B']} S={fields['S']} budget={fields['budget']}"
        row = {"op": op, "config": config, "target_hit": fields.get("hit"), "error": None}
        if bench.get("error_occurred"):
            row["error"] = bench.get("error_message", "error")
            out.append(row)
            continue
        scale = _TO_MICROSECONDS.get(bench.get("time_unit", "ns"), 1e-3)
        row["us"] = bench["real_time"] * scale
        row["floor_us"] = bench.get("floor_us")
        row["x_floor"] = bench.get("x_floor")
        row["gbps"] = bench.get("GBps")
        row["hit"] = bench.get("hit")
        row["api_calls"] = bench.get("api_calls")
        out.append(row)
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict) -> str:
    lines = []
    context = results.get("context", {})
    lines.append(f"{context.get('gpu', '?')}: HBM copy {context.get('hbm_copy_GBps', '?')} GB/s, "
                 f"pinned host->device {context.get('pcie_h2d_GBps', '?')} GB/s")
    lines.append("| op | config | hit | µs | floor µs | x floor | GB/s |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    all_rows = rows(results)
    for r in all_rows:
        target = f"({int(r['target_hit']) / 100:.1f})" if r["target_hit"] is not None else ""
        hit = f"{r['hit']:.2f} {target}".strip() if r.get("hit") is not None else (target or "-")
        if r["error"]:
            lines.append(f"| {r['op']} | {r['config']} | {hit} | ERROR: {r['error']} | | | |")
            continue
        lines.append(f"| {r['op']} | {r['config']} | {hit} | {r['us']:.1f} | {_fmt(r['floor_us'], '.1f')} | "
                     f"{_fmt(r['x_floor'], '.2f')} | {_fmt(r['gbps'], '.1f')} |")
    # The value-fetch decision: zero-copy kernel vs one batched copy vs one copy per run.
    fetch = {}
    for r in all_rows:
        if r["op"].startswith("fetch_values_") and not r["error"]:
            fetch.setdefault((r["config"], r["target_hit"]), {})[r["op"][len("fetch_values_"):]] = r["us"]
    if fetch:
        lines.append("")
        lines.append("value fetch (µs): zero_copy / batched_copy / copy_per_run -> fastest")
        for (config, target), times in fetch.items():
            fastest = min(times, key=times.get)
            listed = " / ".join(_fmt(times.get(k), ".1f") for k in ("zero_copy", "batched_copy", "copy_per_run"))
            lines.append(f"  {config} hit {target}: {listed} -> {fastest}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        print(table(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
