"""A table of the kernels in Nsight Compute text logs (ncu's default --page details output): duration, DRAM and SM
throughput (% of peak), achieved occupancy, waves per SM, grid, block and registers per thread; for a log of the
warps' stall reasons (profile_decode_kernels.sh with NCU_STALLS=1), each kernel's largest reasons instead.

    python bench/probes/ncu_summary.py ncu-B8-device.log [...]
"""

import re
import sys

FIELDS = [("Duration", "duration"), ("DRAM Throughput", "dram %"), ("Compute (SM) Throughput", "sm %"),
          ("Achieved Occupancy", "occ %"), ("Waves Per SM", "waves"), ("Grid Size", "grid"), ("Block Size", "block"),
          ("Registers Per Thread", "regs"), ("Memory Throughput", "mem %")]


def kernels(text):
    """(name, {field: 'value unit'}) per profiled kernel, in launch order."""
    out = []
    for block in re.split(r"\n(?=  \S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\))", text):
        head = block.strip().splitlines()[0] if block.strip() else ""
        m = re.match(r"\s*(?:void )?([\w:<>, ()*&\[\]-]+?)\s*\((\d+, \d+, \d+)\)x\((\d+, \d+, \d+)\)", head)
        if not m:
            continue
        name = re.sub(r"\(anonymous namespace\)::|<unnamed>::|shadowkv::cuda::|shadowkv::|selection::|void ", "", m.group(1)).split("<")[0]
        values = {}
        for label, key in FIELDS:
            f = re.search(rf"^\s*{re.escape(label)}\s+(\S+)\s+([\d.,]+)\s*$", block, re.M)
            if f:
                values[key] = f"{f.group(2)} {f.group(1)}" if key == "duration" else f.group(2)
        stalls = {}
        for f in re.finditer(r"^\s*smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+(?:\S+\s+)?([\d.,]+)\s*$",
                             block, re.M):
            stalls[f.group(1)] = float(f.group(2).replace(",", ""))
        out.append((name[-44:], values, stalls))
    return out


for path in sys.argv[1:]:
    text = open(path, errors="replace").read()
    print(f"\n{path}: " + next((l.strip() for l in text.splitlines() if "a step (profiled)" in l), "(no step line)"))
    keys = [k for _, k in FIELDS]
    print(f"{'kernel':<44} " + " ".join(f"{k:>12}" for k in keys))
    for name, values, stalls in kernels(text):
        if stalls:
            top = sorted(stalls.items(), key=lambda item: -item[1])[:6]
            print(f"{name:<44} stalled warps an issue: " + ", ".join(f"{reason} {value:.2f}" for reason, value in top))
        else:
            print(f"{name:<44} " + " ".join(f"{values.get(k, '-'):>12}" for k in keys))
