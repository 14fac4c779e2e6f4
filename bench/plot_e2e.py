"""Plot of an end-to-end result file (bench/e2e_benchmark.py): decode tokens/s against batch, one line per method,
one panel per context length, each method's largest batch marked.

    python bench/plot_e2e.py bench/results/<date>-<commit>-e2e.json out.png
"""

from __future__ import annotations

import json
import sys


def plot(results: dict, out: str) -> str:
    """Writes the plot of `results` ({"runs": [...]} as e2e_benchmark.py writes it) to `out`; returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results.get("runs", [results])
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    colors = {"full": "tab:blue", "store": "tab:orange"}
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        plot(json.load(f), argv[1])
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
