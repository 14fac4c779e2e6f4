"""Plot of end-to-end result files (bench/e2e_benchmark.py): decode tokens/s against batch, one line per method,
one panel per run (context length), each method's largest batch marked.

    python bench/plot_e2e.py bench/results/<date>-<commit>-e2e.json --out e2e.png
    python bench/plot_e2e.py e2e-122880.json e2e-65536.json --out e2e.png --merge merged.json   # runs of two calls
"""

from __future__ import annotations

import json


def plot(results: dict, out: str) -> str:
    """Writes the plot of `results` ({"runs": [...]} as e2e_benchmark.py writes it) to `out`; returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results.get("runs", [results])
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    colors = {"full": "tab:blue", "store": "tab:orange", "store_fp8": "tab:green"}
    for ax, run in zip(axes[0], runs):
        for name, method in run.get("methods", {}).items():
            rows = sorted((r for r in method.get("sweep", []) if r.get("tokens_per_s")), key=lambda r: r["batch"])
            if not rows:
                continue
            xs, ys = [r["batch"] for r in rows], [r["tokens_per_s"] for r in rows]
            label = method.get("label", name)
            ax.plot(xs, ys, "o-", color=colors.get(name), label=label)
            top = method.get("max_batch")
            at_top = [r for r in rows if r["batch"] == top]
            if at_top:
                ax.plot([top], [at_top[0]["tokens_per_s"]], "*", markersize=16, color=colors.get(name))
                ax.annotate(f"largest batch {top}\n{at_top[0]['tokens_per_s']:.0f} tok/s", (top, at_top[0]["tokens_per_s"]),
                            textcoords="offset points", xytext=(-10, 8), ha="right", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoding together)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{run.get('gpu', '')}  context {run.get('seq_len')} tokens", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"end to end decode, commit {results.get('commit', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def merge(paths) -> dict:
    """The runs of several result files in one {"gpu", "commit", "runs"} (gpu/commit of the first file)."""
    merged = {"runs": []}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for key in ("gpu", "commit"):
            merged.setdefault(key, data.get(key))
        merged["runs"] += data.get("runs", [data])
    return merged


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="result files of e2e_benchmark.py")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--merge", help="also write the runs of all files into this one result file")
    args = p.parse_args(argv)
    results = merge(args.results)
    if args.merge:
        with open(args.merge, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.merge}")
    plot(results, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
