"""Sums the lines that kernels built with -DSHADOWKV_PHASE_STAMPS print (cuda/kernels/common/phase_stamps.cuh): for
each kernel, the median cycles between consecutive stamps, as µs at the clock the line's own global-timer span
gives. Reads a log on stdin (or the files named), prints a table a kernel.

    python3 bench/probes/phase_stamps.py step.log
"""
import collections
import re
import statistics
import sys

KERNELS = {0: "select", 1: "rebuild", 2: "logits", 3: "attention", 4: "fetch", 5: "combine"}
LABELS = {
    0: "start", 1: "prior grids done",
    # select
    2: "normalisers, histogram cleared", 3: "scored (own slice)", 4: "scores of all (barrier)",
    5: "hint path: keys gathered", 8: "threshold found", 9: "compacted", 19: "cluster done",
    18: "cache updated (end)",
    10: "digit 0 merged", 11: "digit 1 merged", 12: "digit 2 merged", 20: "digit 0 counted",
    21: "digit 1 counted", 22: "digit 2 counted", 26: "digit 1 barrier", 27: "digit 2 barrier",
    # rebuild
    30: "main loop done", 31: "barrier A (next tables)", 32: "barrier B (RoPE)", 33: "barrier C (stores)",
    34: "K tile 0 issued (thread 0)", 35: "K tile 1 issued (thread 0)",
    38: "no group (end)", 39: "last stores (end)",
    36: "fused: values landed (barrier)", 37: "fused: scores (barrier)", 46: "fused: softmax (barrier)",
    47: "fused: P V, partials written", 48: "fused: values stored to the cache (thread 0)",
    50: "K tile 0 landed", 51: "K tile 1 landed", 52: "K tile 2 landed", 53: "K tile 3 landed",
    54: "K tile 4 landed", 55: "K tile 5 landed",
    # logits
    42: "views read", 43: "tiles described", 44: "first copies issued, q staged", 45: "tile done (barrier)",
    40: "tile landed", 41: "tile computed (before the barrier)", 56: "tile written (thread 0's epilogue)",
    49: "last tile (end)",
    # sparse attention (tensor cores)
    79: "fetch done (end)", 70: "split weights (barrier)", 71: "combined (end)",
    60: "row walk begun (barrier)", 61: "q staged, first steps issued", 62: "step landed (barrier)",
    63: "next step issued", 64: "all steps done (barrier)", 65: "warps merged (barrier)", 69: "partials written (end)",
}
LINE = re.compile(r"phase_stamps (\d+) sm (\d+) ns (\d+) :(.*)")
SPANS = re.compile(r"cta_spans (\d+) ctas (\d+) starts ([0-9: ]*) ends ([0-9: ]*)(?:first_ns (\d+))?")


def _bins(text: str) -> dict:
    return {int(b): int(n) for b, n in (item.split(":") for item in text.split())}


def _quantile(bins: dict, q: float) -> int:
    """The 1 µs bin where a fraction q of the counts is reached."""
    total, seen = sum(bins.values()), 0
    for b in sorted(bins):
        seen += bins[b]
        if seen >= q * total:
            return b
    return max(bins) if bins else 0


def print_spans(text: str) -> None:
    """When each kernel's CTAs started and ended (cta_spans lines; µs bins from the grid's first start), summed over
    the printed launches."""
    spans = collections.defaultdict(lambda: [0, 0, collections.Counter(), collections.Counter()])
    for match in SPANS.finditer(text):
        entry = spans[int(match[1])]
        entry[0] += 1
        entry[1] = int(match[2])
        entry[2].update(_bins(match[3]))
        entry[3].update(_bins(match[4]))
    if not spans:
        return
    print("\nCTA spans (µs from the grid's first CTA start; 1 µs bins, summed over the printed launches):")
    print("| kernel | launches | CTAs | starts p50 / p90 / last | ends p10 / p50 / p90 / last |")
    print("| --- | --- | --- | --- | --- |")
    for kernel in sorted(spans):
        launches, ctas, starts, ends = spans[kernel]
        print(f"| {KERNELS.get(kernel, kernel)} | {launches} | {ctas} | {_quantile(starts, 0.5)} / "
              f"{_quantile(starts, 0.9)} / {max(starts)} | {_quantile(ends, 0.1)} / {_quantile(ends, 0.5)} / "
              f"{_quantile(ends, 0.9)} / {max(ends)} |")


def print_aligned_spans(text: str, window_us: float = 100.0) -> None:
    """Kernels of one step side by side: for each printed launch of the first kernel that has first_ns (the anchor),
    each other kernel's printed launch whose first CTA start is nearest to the anchor's, if within `window_us` (each
    kernel prints one launch in 16 of its own, and the kernels are not launched equally often, so the n-th printed
    launches need not be one step's). Cells: first CTA start, p90 start, p50 end, last end, in µs from the earliest
    first start of the row."""
    launches = collections.defaultdict(list)  # kernel -> [(first_ns, starts, ends)]
    for match in SPANS.finditer(text):
        if match[5] is not None:
            launches[int(match[1])].append((int(match[5]), _bins(match[3]), _bins(match[4])))
    if len(launches) < 2:
        return
    kernels = sorted(launches)
    anchor = kernels[0]
    print(f"\nOne step's kernels side by side, around each printed {KERNELS.get(anchor, anchor)} launch (µs from the "
          "row's earliest first CTA start: first start, p90 start, p50 end, last end; '-' none within "
          f"{window_us:.0f} µs):")
    print("| row | " + " | ".join(KERNELS.get(k, str(k)) for k in kernels) + " |")
    print("| --- |" + " --- |" * len(kernels))
    for n, (anchor_ns, _, _) in enumerate(launches[anchor]):
        row = {}
        for k in kernels:
            nearest = min(launches[k], key=lambda launch: abs(launch[0] - anchor_ns))
            if abs(nearest[0] - anchor_ns) <= window_us * 1000:
                row[k] = nearest
        origin = min(launch[0] for launch in row.values())
        cells = []
        for k in kernels:
            if k not in row:
                cells.append("-")
                continue
            first, starts, ends = row[k]
            at = (first - origin) / 1000.0
            cells.append(f"{at:.1f}, {at + _quantile(starts, 0.9):.0f}, {at + _quantile(ends, 0.5):.0f}, "
                         f"{at + max(ends):.0f}")
        print(f"| {n} | " + " | ".join(cells) + " |")


def main() -> None:
    text = "".join(open(p).read() for p in sys.argv[1:]) if len(sys.argv) > 1 else sys.stdin.read()
    steps = collections.defaultdict(lambda: collections.defaultdict(list))  # kernel -> (i, a, b) -> µs
    totals = collections.defaultdict(list)
    for match in LINE.finditer(text):
        kernel, _, ns, rest = int(match[1]), int(match[2]), int(match[3]), match[4]
        stamps = [(0, 0)] + [tuple(int(x) for x in item.split(":")) for item in rest.split()]
        cycles = stamps[-1][1]
        if cycles <= 0 or ns <= 0:
            continue
        per_us = cycles / (ns / 1000.0)  # cycles a µs on this SM during this launch
        totals[kernel].append(ns / 1000.0)
        for i in range(1, len(stamps)):
            key = (i, stamps[i - 1][0], stamps[i][0])
            steps[kernel][key].append((stamps[i][1] - stamps[i - 1][1]) / per_us)
    for kernel in sorted(totals):
        name = KERNELS.get(kernel, str(kernel))
        print(f"\n{name}: {len(totals[kernel])} launches, median {statistics.median(totals[kernel]):.2f} µs from the "
              f"first stamp to the last (the stamping CTA at blockIdx 0)")
        print("| # | from | to | median µs | min | max | n |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for (i, a, b), values in sorted(steps[kernel].items()):
            if len(values) < max(2, len(totals[kernel]) // 4):
                continue  # a rare path
            print(f"| {i} | {LABELS.get(a, a)} | {LABELS.get(b, b)} | {statistics.median(values):.2f} | "
                  f"{min(values):.2f} | {max(values):.2f} | {len(values)} |")
    print_spans(text)
    print_aligned_spans(text)


if __name__ == "__main__":
    main()
