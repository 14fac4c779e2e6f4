"""Summary, Markdown tables and plots of the accuracy harness's results (`shadowkv_core.evaluation.accuracy`).

* `summarize(results)`: accuracy (full attention vs the store) per (task, length, depth, budget), per turn, memory and
  times; `tables(results)`: those as Markdown; `plot(results, out_dir)`: depth x length heatmaps, accuracy vs budget
  (log2 axis, Wilson 95% intervals, n in the legend), accuracy per turn.
* `write_outputs(results, out_dir)`: results.json, summary.md and the plots.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import List, Sequence

from ._markdown import table
from .tasks import DEPTH_TASKS, score

__all__ = ["budget_ticks", "plot", "rescore", "summarize", "tables", "wilson_interval", "write_json",
           "write_outputs"]

def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def summarize(results: dict) -> dict:
    """Accuracy (full vs store) per (task, length, depth, budget), per turn, memory and times."""
    accuracy = defaultdict(lambda: {"full": [], "store": [], "budget_tokens": [], "prompt_tokens": []})
    per_turn = defaultdict(lambda: {"full": [], "store": []})
    memory = defaultdict(lambda: defaultdict(list))
    times = defaultdict(lambda: defaultdict(list))
    for rec in results["records"]:
        full = rec["full"]
        # a document's later questions share its prefill (and each budget's seeding): timed once, with question 0
        later = bool(rec.get("prefill_shared")) and rec.get("question", 0) > 0
        for run in rec["store"]:
            key = (rec["task"], rec["length"], rec["depth"], run["budget"])
            cell = accuracy[key]
            cell["full"].append(_mean(full["scores"]))
            cell["store"].append(_mean(run["scores"]))
            cell["budget_tokens"].append(run["budget_tokens"])
            cell["prompt_tokens"].append(rec["prompt_tokens"])
            if rec["task"] == "multiturn":
                for turn, (f, s) in enumerate(zip(full["scores"], run["scores"]), start=1):
                    per_turn[(rec["length"], run["budget"], turn)]["full"].append(f)
                    per_turn[(rec["length"], run["budget"], turn)]["store"].append(s)
            m, mem = memory[(rec["length"], run["budget"])], run["memory"]
            m["store_total"].append(mem["total"])
            m["store_resident"].append(mem["total"] - mem["value_store"])
            m["full_kv"].append(mem["full_attention_equivalent"])
            m["hit_rate"].append(run["stats"].get("hit_rate", float("nan")))
            m["prompt_tokens"].append(rec["prompt_tokens"])
            m["budget_tokens"].append(run["budget_tokens"])
            t = times[(rec["task"], rec["length"])]
            if run["decode_steps"]:
                t["store_ms_per_token"].append(1e3 * run["decode_seconds"] / run["decode_steps"])
            if not later:
                t["store_prefill_seconds"].append(run["store_prefill_seconds"])
        t = times[(rec["task"], rec["length"])]
        if not later:
            t["prefill_seconds"].append(rec["prefill_seconds"])
        if full["decode_steps"]:
            t["full_ms_per_token"].append(1e3 * full["decode_seconds"] / full["decode_steps"])
    mib = 1.0 / (1 << 20)
    return {
        "accuracy": [dict(task=k[0], length=k[1], depth=k[2], budget=k[3], n=len(v["full"]),
                          budget_tokens=_mean(v["budget_tokens"]), prompt_tokens=_mean(v["prompt_tokens"]),
                          full=_mean(v["full"]), store=_mean(v["store"])) for k, v in accuracy.items()],
        "per_turn": [dict(length=k[0], budget=k[1], turn=k[2], n=len(v["full"]), full=_mean(v["full"]),
                          store=_mean(v["store"])) for k, v in sorted(per_turn.items(), key=lambda kv: (
                              kv[0][0], str(kv[0][1]), kv[0][2]))],
        "memory": [dict(length=k[0], budget=k[1], prompt_tokens=_mean(v["prompt_tokens"]),
                        budget_tokens=_mean(v["budget_tokens"]), store_total_mib=_mean(v["store_total"]) * mib,
                        store_resident_mib=_mean(v["store_resident"]) * mib, full_kv_mib=_mean(v["full_kv"]) * mib,
                        saved_total=1.0 - _mean(v["store_total"]) / _mean(v["full_kv"]),
                        saved_resident=1.0 - _mean(v["store_resident"]) / _mean(v["full_kv"]),
                        hit_rate=_mean(v["hit_rate"])) for k, v in memory.items()],
        "time": [dict(task=k[0], length=k[1], **{name: _mean(vals) for name, vals in v.items()})
                 for k, v in times.items()],
    }


def _fmt(x: float, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _budget_sort_key(spec: str) -> float:
    text = str(spec)
    return float(text[:-1]) * 1e6 if text.endswith("%") else float(text)


def _documents_note(results: dict) -> str:
    """", as N questions on M documents (one prefill each)" for a run with many questions per document."""
    records = [r for r in results["records"] if r.get("questions_per_document", 1) > 1]
    if not records:
        return ""
    documents = len({r["document"] for r in records})
    shared = all(r.get("prefill_shared") for r in records)
    return (f", {len(records)} of them questions on {documents} documents "
            + ("(one prefill each)" if shared else "(prefilled again for each question)"))


def tables(results: dict) -> str:
    """Markdown tables of a results dict (accuracy full vs store, per turn, memory, time)."""
    s = results.get("summary") or summarize(results)
    cfg = results["config"]
    lines = [f"model {results['model']} {results.get('model_config', {})}; rank {cfg['rank']}, chunk "
             f"{cfg['chunk_size']}, outlier chunks {cfg['outlier_chunks']}, local chunks {cfg['local_chunks']}, "
             f"samples {cfg['samples']}, seed {cfg['seed']}; {len(results['records'])} prompts"
             + _documents_note(results) + ("" if results.get("complete") else " (run cut short)"), ""]
    by_task = defaultdict(list)
    for row in s["accuracy"]:
        by_task[row["task"]].append(row)
    for task, rows in by_task.items():
        rows.sort(key=lambda r: (r["length"], _budget_sort_key(r["budget"]), -1 if r["depth"] is None else r["depth"]))
        lines += [f"**{task}** accuracy (full attention / store)", ""]
        lines += table(["length", "prompt tokens", "depth", "budget", "budget tokens", "n", "full", "store"],
                       [[r["length"], f"{r['prompt_tokens']:.0f}", "—" if r["depth"] is None else r["depth"],
                         r["budget"], f"{r['budget_tokens']:.0f}", r["n"], _fmt(r["full"]), _fmt(r["store"])]
                        for r in rows])
        # per (length, budget) over depths
        agg = defaultdict(lambda: [[], []])
        for r in rows:
            agg[(r["length"], r["budget"])][0].append(r["full"])
            agg[(r["length"], r["budget"])][1].append(r["store"])
        if any(r["depth"] is not None for r in rows):
            lines += ["", f"**{task}** mean over depths", ""]
            lines += table(["length", "budget", "full", "store"],
                           [[length, budget, _fmt(_mean(f)), _fmt(_mean(st))] for (length, budget), (f, st)
                            in sorted(agg.items(), key=lambda kv: (kv[0][0], _budget_sort_key(kv[0][1])))])
        lines.append("")
    if s["per_turn"]:
        budgets = sorted({r["budget"] for r in s["per_turn"]}, key=_budget_sort_key)
        turns = sorted({r["turn"] for r in s["per_turn"]})
        rows = []
        for length in sorted({r["length"] for r in s["per_turn"]}):
            cells = {(r["budget"], r["turn"]): r for r in s["per_turn"] if r["length"] == length}
            rows.append([length, "full"] + [_fmt(cells[(budgets[0], t)]["full"]) for t in turns])
            rows += [[length, f"store {b}"] + [_fmt(cells[(b, t)]["store"]) for t in turns] for b in budgets]
        lines += ["**multiturn** accuracy per turn", ""]
        lines += table(["length", ""] + [f"turn {t}" for t in turns], rows)
        lines.append("")
    lines += ["**memory** of the store (store layers only; MiB) vs full attention KV of the same layers", ""]
    lines += table(["length", "budget", "budget tokens", "store total", "store w/o value store", "full KV",
                    "saved (total)", "saved (w/o values)", "hit rate"],
                   [[r["length"], r["budget"], f"{r['budget_tokens']:.0f}", _fmt(r["store_total_mib"]),
                     _fmt(r["store_resident_mib"]), _fmt(r["full_kv_mib"]), f"{_fmt(100 * r['saved_total'], 1)}%",
                     f"{_fmt(100 * r['saved_resident'], 1)}%", _fmt(r["hit_rate"])]
                    for r in sorted(s["memory"], key=lambda r: (r["length"], _budget_sort_key(r["budget"])))])
    lines += ["", "**time** (CPU; dense prefill shared by both, and by a document's questions: seconds per "
              "prefill; store prefill = factorisation etc. per budget)", ""]
    lines += table(["task", "length", "dense prefill s", "store prefill s", "full ms/token", "store ms/token"],
                   [[r["task"], r["length"], _fmt(r.get("prefill_seconds"), 1), _fmt(r.get("store_prefill_seconds"), 1),
                     _fmt(r.get("full_ms_per_token"), 0), _fmt(r.get("store_ms_per_token"), 0)]
                    for r in sorted(s["time"], key=lambda r: (r["task"], r["length"]))])
    lines.append("")
    return "\n".join(lines)


def _label(spec: str) -> str:
    return str(spec).replace("%", "pct").replace(".", "p")


def plot(results: dict, out_dir: os.PathLike) -> List[str]:
    """Writes the PNG plots of `results` into out_dir; returns their paths."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the eval plots need matplotlib: run `pip install matplotlib`") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    s = results.get("summary") or summarize(results)
    written: List[str] = []
    title = f"{results['model']}, rank {results['config']['rank']}, {len(results['records'])} prompts"

    # depth x length heatmaps (full | store), one figure per depth task and budget
    for task in DEPTH_TASKS:
        rows = [r for r in s["accuracy"] if r["task"] == task]
        if not rows:
            continue
        lengths = sorted({r["length"] for r in rows})
        depths = sorted({r["depth"] for r in rows})
        for budget in sorted({r["budget"] for r in rows}, key=_budget_sort_key):
            cells = {(r["length"], r["depth"]): r for r in rows if r["budget"] == budget}
            fig, axes = plt.subplots(1, 2, figsize=(4 + 1.1 * len(lengths), 1.5 + 0.45 * len(depths)), sharey=True)
            for ax, side in zip(axes, ("full", "store")):
                grid = [[cells[(n, d)][side] if (n, d) in cells else float("nan") for n in lengths] for d in depths]
                im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                for i, row in enumerate(grid):
                    for j, v in enumerate(row):
                        if not math.isnan(v):
                            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
                ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
                ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
                ax.set_xlabel("context length (tokens)")
                name = "full attention" if side == "full" else f"store, budget {budget}"
                ax.set_title(name, fontsize=9)
            axes[0].set_ylabel("needle depth")
            fig.colorbar(im, ax=axes, fraction=0.04)
            fig.suptitle(f"{task}: {title}", fontsize=10, y=1.03)
            path = out / f"{task}_heatmap_{_label(budget)}.png"
            fig.savefig(path, dpi=90, bbox_inches="tight")
            plt.close(fig)
            written.append(str(path))

    # accuracy vs budget, per task and length
    if len({r["budget"] for r in s["accuracy"]}) > 1:
        for task in sorted({r["task"] for r in s["accuracy"]}):
            path = out / f"{task}_budget_sweep.png"
            _plot_budget_sweep(plt, task, [r for r in s["accuracy"] if r["task"] == task], title, path)
            written.append(str(path))

    if s["per_turn"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for length in sorted({r["length"] for r in s["per_turn"]}):
            rows = [r for r in s["per_turn"] if r["length"] == length]
            bs = sorted({r["budget"] for r in rows}, key=_budget_sort_key)
            turns = sorted({r["turn"] for r in rows})
            full = [_mean(r["full"] for r in rows if r["turn"] == t) for t in turns]
            n = max(r["n"] for r in rows)
            ax.plot(turns, full, "k--o", label=f"full attention, {length} tokens (n={n} a turn)")
            for b in bs:
                ax.plot(turns, [next(r["store"] for r in rows if r["turn"] == t and r["budget"] == b) for t in turns],
                        "o-", label=f"store budget {b}, {length} tokens")
        ax.set_xlabel("turn")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"multi-turn NIAH: {title}", fontsize=10)
        ax.legend(fontsize=8)
        path = out / "multiturn_per_turn.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(str(path))
    return written


Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(accuracy: float, n: int, z: float = Z95) -> tuple:
    """Wilson score interval (95% by default) of a proportion `accuracy` measured on `n` trials; (nan, nan) for
    n = 0. For scores between 0 and 1 (multi-value tasks) it treats the mean score as the proportion."""
    if n <= 0 or accuracy is None or math.isnan(accuracy):
        return float("nan"), float("nan")
    p = min(1.0, max(0.0, accuracy))
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _pooled(rows: Sequence[dict], key: str) -> float:
    """Mean of `key` over the prompts of summary rows (each row's value weighted by its n)."""
    n = sum(r["n"] for r in rows)
    return sum(r["n"] * r[key] for r in rows) / n if n else float("nan")


def _sweep_x(r: dict, by_tokens: bool) -> float:
    return r["budget_tokens"] if by_tokens else 100.0 * r["budget_tokens"] / r["prompt_tokens"]


def budget_ticks(rows: List[dict]) -> tuple:
    """(by_tokens, major positions, their labels, minor positions) of the budget-sweep x axis (log2) for summary
    accuracy rows. One tick a budget spec at its n-weighted mean position over the lengths (a percentage lands at
    about the same share at every length); on a % axis a token budget gets one tick per distinct share it has at the
    different lengths. Going left to right, a tick closer than max(0.3, 0.09 x the axis span) octaves to the previous
    labelled one keeps no label (a minor tick): labels never collide."""
    by_tokens = not any(str(r["budget"]).endswith("%") for r in rows)
    xs = [_sweep_x(r, by_tokens) for r in rows]
    span = math.log2(max(xs) / min(xs)) if xs else 0.0
    gap = max(0.3, 0.09 * span)
    candidates = []
    for spec in {r["budget"] for r in rows}:
        at = [r for r in rows if r["budget"] == spec]
        mean_x = sum(r["n"] * _sweep_x(r, by_tokens) for r in at) / sum(r["n"] for r in at)
        if by_tokens:
            candidates.append((mean_x, f"{float(spec):g}"))
        elif str(spec).endswith("%"):
            candidates.append((mean_x, str(spec)))
        else:
            candidates += [(x, f"{spec} tok") for x in sorted({_sweep_x(r, False) for r in at})]
    ticks, labels, minor, last = [], [], [], None
    for x, label in sorted(candidates):
        if last is not None and math.log2(x / last) < gap:
            minor.append(x)
            continue
        ticks.append(x)
        labels.append(label)
        last = x
    return by_tokens, ticks, labels, minor


def _plot_budget_sweep(plt, task: str, rows: List[dict], title: str, path: Path) -> None:
    """Accuracy vs budget of one task: per prompt length the store's accuracy at each budget (pooled over depths)
    with its Wilson 95% interval, and full attention's as a dashed line with its interval as a band. The x axis is
    log2: the budget in tokens when every budget is a token count, else its share of the prompt in %
    (`budget_ticks`)."""
    from matplotlib.ticker import NullFormatter

    by_tokens, ticks, labels, minor = budget_ticks(rows)
    specs = sorted({r["budget"] for r in rows}, key=_budget_sort_key)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lengths = sorted({r["length"] for r in rows})
    for k, length in enumerate(lengths):
        dodge = 2.0 ** (0.04 * (k - (len(lengths) - 1) / 2))   # lengths side by side, so that their bars do not overlap
        cells = defaultdict(list)
        for r in rows:
            if r["length"] == length:
                cells[r["budget"]].append(r)
        present = [b for b in specs if b in cells]
        xs = [dodge * sum(r["n"] * _sweep_x(r, by_tokens) for r in cells[b]) / sum(r["n"] for r in cells[b])
              for b in present]
        ys = [_pooled(cells[b], "store") for b in present]
        ns = [sum(r["n"] for r in cells[b]) for b in present]
        bounds = [wilson_interval(y, n) for y, n in zip(ys, ns)]
        color = f"C{k}"
        n_text = f"n={ns[0]}" if len(set(ns)) == 1 else f"n={min(ns)}-{max(ns)}"
        yerr = [[y - lo for y, (lo, _) in zip(ys, bounds)], [hi - y for y, (_, hi) in zip(ys, bounds)]]
        ax.errorbar(xs, ys, yerr=yerr, fmt="o-", color=color, capsize=3,
                    label=f"store, {length} tokens ({n_text} a budget)")
        full = cells[present[0]]   # the same prompts at every budget
        f, nf = _pooled(full, "full"), sum(r["n"] for r in full)
        lo, hi = wilson_interval(f, nf)
        ax.axhline(f, color=color, ls="--", label=f"full attention, {length} tokens (n={nf})")
        ax.axhspan(lo, hi, color=color, alpha=0.08, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels)
    ax.set_xticks(minor, minor=True)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", which="minor", length=2)
    ax.set_xlabel("budget (tokens a KV head, log2 scale)" if by_tokens else
                  "budget (% of the prompt's tokens, log2 scale)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{task}: {title}\nerror bars and bands: Wilson 95% intervals over n prompts", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def write_json(results: dict, out_dir: os.PathLike) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=float))
    os.replace(tmp, path)
    return path


def rescore(results: dict) -> dict:
    """Scores every stored answer again with the current `score` (e.g. for --replot of an older run)."""
    for rec in results["records"]:
        for run in [rec["full"]] + rec["store"]:
            run["scores"] = [score(a, e) for a, e in zip(run["answers"], rec["expected"])]
    return results


def write_outputs(results: dict, out_dir: os.PathLike, plots: bool = True) -> List[str]:
    """results.json, summary.md and (plots=True) the PNG plots; returns the written paths."""
    rescore(results)
    results["summary"] = summarize(results)
    written = [str(write_json(results, out_dir))]
    summary = Path(out_dir) / "summary.md"
    summary.write_text(tables(results))
    written.append(str(summary))
    if plots:
        written += plot(results, out_dir)
    return written
