#!/usr/bin/env python3
"""Per kernel of an `ncu --page source --csv --print-source sass` export: the instructions holding most of the warp
stall samples, and the sampled reasons summed over the kernel (columns whose name says stall or sampling).

    python3 bench/probes/ncu_source_summary.py source-B8-device.csv [--top 30]
"""
import argparse
import csv
import re
import sys
from collections import defaultdict


def number(text):
    try:
        return float(text.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def blocks(path):
    """Yields (title, header, rows) for each table of the export; a title line is any non-table line before it."""
    title, header, rows = "", None, []
    with open(path, newline="", errors="replace") as f:
        for record in csv.reader(f):
            if not record:
                continue
            is_header = any(cell.strip() in ("Address", "# Address") for cell in record) and any(
                "Source" in cell for cell in record)
            if is_header:
                if header is not None:
                    yield title, header, rows
                header, rows = [c.strip() for c in record], []
            elif header is not None and len(record) == len(header):
                rows.append(record)
            else:
                if header is not None:
                    yield title, header, rows
                    header, rows = None, []
                title = ",".join(record)[:160]
    if header is not None:
        yield title, header, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    found = False
    for title, header, rows in blocks(args.csv):
        found = True
        source = next(i for i, c in enumerate(header) if "Source" in c)
        samples = [i for i, c in enumerate(header) if re.search(r"stall sampling \(all", c, re.I)]
        total_col = samples[0] if samples else None
        reason_cols = [i for i, c in enumerate(header)
                       if i != total_col and re.search(r"stall|sampl", c, re.I) and "Not-issued" not in c]
        if total_col is None:
            print(f"== {title}\ncolumns: {header}")
            continue
        values = [(number(r[total_col]) or 0.0, r) for r in rows]
        total = sum(v for v, _ in values) or 1.0
        print(f"== {title}: {len(rows)} instructions, {total:.0f} samples")
        sums = defaultdict(float)
        for _, r in values:
            for i in reason_cols:
                sums[header[i]] += number(r[i]) or 0.0
        ranked = sorted(((s, n) for n, s in sums.items() if s > 0), reverse=True)[:12]
        print("   reasons: " + ", ".join(f"{n} {100 * s / total:.1f}%" for s, n in ranked))
        address = next((i for i, c in enumerate(header) if c.strip() in ("Address", "# Address")), None)
        for value, r in sorted(values, key=lambda x: -x[0])[: args.top]:
            if value <= 0:
                break
            where = r[address] if address is not None else ""
            reasons = sorted(((number(r[i]) or 0.0, header[i]) for i in reason_cols), reverse=True)[:3]
            detail = ", ".join(f"{n} {v:.0f}" for v, n in reasons if v > 0)
            print(f"  {100 * value / total:5.1f}%  {where:>8}  {r[source].strip()[:70]:<70}  {detail}")
    if not found:
        print("no table with Address and Source columns in", args.csv)
        with open(args.csv, errors="replace") as f:
            print("".join(f.readlines()[:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
