"""Plot of end-to-end result files (bench/e2e_benchmark.py): decode tokens/s against batch, one line per method,
one panel per run (context length), each method's largest batch marked.

    python bench/plot_e2e.py bench/results/<date>-<commit>-e2e.json --out e2e.png
    python bench/plot_e2e.py e2e-122880.json e2e-65536.json --out e2e.png --merge merged.json   # runs of two calls
"""

from __future__ import annotations

import json


def _hit_rate(method: dict):
    """The temporal hit rate of a store curve (the mean over its sweep's rows), None for full attention."""
    rates = [r["hit_rate"] for r in method.get("sweep", []) if r.get("hit_rate") is not None]
    return sum(rates) / len(rates) if rates else None


def plot(results: dict, out: str) -> str:
    """Writes the plot of `results` ({"runs": [...]} as e2e_benchmark.py writes it) to `out`; returns `out`. Runs of
    the same context length share a panel; every method keeps one colour in every panel; a store curve's legend
    entry gives its hit rate (and says when its queries were steered)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict = {}
    for run in results.get("runs", [results]):
        panel = panels.setdefault(run.get("seq_len"), {"gpu": run.get("gpu", ""), "methods": {}})
        for name, method in run.get("methods", {}).items():
            # The same method (label) again, from a later file of the same context length: the later one replaces it.
            label = method.get("label", name)
            for key in [k for k, m in panel["methods"].items() if m.get("label", k) == label]:
                del panel["methods"][key]
            key = name
            while key in panel["methods"]:
                key += "'"
            panel["methods"][key] = method
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors: dict = {}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (seq_len, panel) in zip(axes[0], panels.items()):
        top_y = 0.0
        for name, method in panel["methods"].items():
            rows = sorted((r for r in method.get("sweep", []) if r.get("tokens_per_s")), key=lambda r: r["batch"])
            if not rows:
                continue
            label = method.get("label", name)
            color = colors.setdefault(label, palette[len(colors) % len(palette)])
            hit = _hit_rate(method)
            if hit is not None:
                steered = method.get("hit_steered")
                label += f" (hit {hit:.2f}" + (f", steered to {steered}" if steered is not None else "") + ")"
            xs, ys = [r["batch"] for r in rows], [r["tokens_per_s"] for r in rows]
            top_y = max(top_y, max(ys))
            ax.plot(xs, ys, "o-", color=color, label=label)
            top = method.get("max_batch")
            at_top = [r for r in rows if r["batch"] == top]
            if at_top:
                ax.plot([top], [at_top[0]["tokens_per_s"]], "*", markersize=16, color=color)
                ax.annotate(f"largest batch {top}\n{at_top[0]['tokens_per_s']:.0f} tok/s",
                            (top, at_top[0]["tokens_per_s"]), textcoords="offset points", xytext=(-10, -12),
                            ha="right", va="top", fontsize=8, color=color)
        ax.set_ylim(0, top_y * 1.25 if top_y else None)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoding together)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{panel['gpu']}, context {seq_len} tokens", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"end to end decode, commit {results.get('commit', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def merge(paths) -> dict:
    """The runs of several result files in one {"gpu", "commit", "runs"} (the first file's gpu, every file's commit)."""
    merged = {"runs": []}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        merged.setdefault("gpu", data.get("gpu"))
        commits = [c for c in merged.get("commit", "").split(" + ") if c]
        if data.get("commit") and data["commit"] not in commits:
            commits.append(data["commit"])
        merged["commit"] = " + ".join(commits)
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
