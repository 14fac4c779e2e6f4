#!/usr/bin/env python3
"""Per kernel of an `ncu --page source --csv --print-source sass` export: the instructions holding most of the warp
stall samples (with their offset in the function), the sampled reasons summed over the kernel, and, given the
`nvdisasm -g -c` listing of the same build (--lines), the source lines holding most of the samples.

    python3 bench/probes/ncu_source_summary.py source-B8-device.csv [--top 30] [--lines landmark_logits.dis ...]

The listing: `cuobjdump -xelf all <object>.cu.o` then `nvdisasm -g -c <file>.cubin > <file>.dis` (cuobjdump and
nvdisasm install from PyPI: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm); the object must come from the same source,
compiler and flags as the profiled build. A kernel is matched to the listing's function with the same instructions.
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


def opcode(text):
    """The mnemonic of one SASS line, predicate and operands dropped: '@!P1 BRA 0x..' -> 'BRA'."""
    words = text.replace(";", " ").split()
    words = [w for w in words if not w.startswith("@")]
    return words[0] if words else ""


def listings(paths):
    """{function: [(offset, opcode, 'file:line'), ...]} from `nvdisasm -g -c` listings."""
    functions = {}
    for path in paths:
        name, where, body = None, "", None
        with open(path, errors="replace") as f:
            for line in f:
                m = re.match(r"^\.text\.(\S+):$", line.strip())
                if m:
                    name, where, body = m.group(1), "", []
                    functions[name] = body
                    continue
                m = re.match(r'^\s*//## File "([^"]+)", line (\d+)', line)
                if m:
                    where = f"{m.group(1).split('/')[-1]}:{m.group(2)}"
                    continue
                m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
                if m and body is not None:
                    body.append((int(m.group(1), 16), opcode(m.group(2)), where))
    return functions


def match(functions, ops):
    """The listing's function whose instructions are `ops` (mnemonics in address order), or None."""
    for name, body in functions.items():
        if len(body) == len(ops) and all(b[1] == o for b, o in zip(body, ops)):
            return name, body
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--lines", nargs="*", default=[], help="nvdisasm -g -c listings of the same build")
    args = parser.parse_args()
    functions = listings(args.lines) if args.lines else {}
    found = False
    for title, header, rows in blocks(args.csv):
        found = True
        source = next(i for i, c in enumerate(header) if "Source" in c)
        address = next((i for i, c in enumerate(header) if c.strip() in ("Address", "# Address")), None)
        total_col = next((i for i, c in enumerate(header) if re.search(r"stall sampling \(all", c, re.I)), None)
        if total_col is None:
            total_col = next((i for i, c in enumerate(header) if c.strip() == "# Samples"), None)
        if total_col is None:
            print(f"== {title}\ncolumns: {header}")
            continue
        reason_cols = [i for i, c in enumerate(header) if i != total_col and c.startswith("stall_")
                       and "Not Issued" not in c]
        values = [(number(r[total_col]) or 0.0, r) for r in rows]
        total = sum(v for v, _ in values) or 1.0
        first = min((int(r[address], 16) for r in rows if address is not None and r[address].startswith("0x")),
                    default=0)
        print(f"== {title}: {len(rows)} instructions, {total:.0f} samples")
        sums = defaultdict(float)
        for _, r in values:
            for i in reason_cols:
                sums[header[i]] += number(r[i]) or 0.0
        ranked = sorted(((s, n) for n, s in sums.items() if s > 0), reverse=True)[:10]
        print("   reasons: " + ", ".join(f"{n} {100 * s / total:.1f}%" for s, n in ranked))

        lines = {}
        if functions and address is not None:
            ordered = sorted(rows, key=lambda r: int(r[address], 16))
            matched = match(functions, [opcode(r[source]) for r in ordered])
            if matched:
                name, body = matched
                lines = {off: where for off, _, where in body}
                print(f"   listing: {name[:100]}")
            else:
                print("   listing: no function of the listings has these instructions")

        def offset_of(r):
            return int(r[address], 16) - first if address is not None and r[address].startswith("0x") else -1

        for value, r in sorted(values, key=lambda x: -x[0])[: args.top]:
            if value <= 0:
                break
            reasons = sorted(((number(r[i]) or 0.0, header[i]) for i in reason_cols), reverse=True)[:2]
            detail = ", ".join(f"{n[6:]} {v:.0f}" for v, n in reasons if v > 0)
            off = offset_of(r)
            where = lines.get(off, "")
            print(f"  {100 * value / total:5.1f}%  {off:#07x}  {r[source].strip()[:56]:<56}  {where:<28} {detail}")
        if lines:
            by_line = defaultdict(float)
            for value, r in values:
                by_line[lines.get(offset_of(r), "?")] += value
            print("   by source line:")
            for where, value in sorted(by_line.items(), key=lambda x: -x[1])[:15]:
                if value <= 0:
                    break
                print(f"  {100 * value / total:5.1f}%  {where}")
    if not found:
        print("no table with Address and Source columns in", args.csv)
        with open(args.csv, errors="replace") as f:
            print("".join(f.readlines()[:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
