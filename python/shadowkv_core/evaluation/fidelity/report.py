"""The fidelity tool's Markdown tables (`format_tables`), from the result dict `evaluate` returns (or its JSON)."""

from __future__ import annotations

import numpy as np

from .._markdown import table

__all__ = ["format_tables"]


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        return f"{x:.1e}"
    return f"{x:.4f}"


def format_tables(result: dict, max_layer_columns: int = 8) -> str:
    """Markdown tables: one summary row per (rank, budget) (means over layers and steps), then per-layer relative
    errors and hit rates (min / median / max over layers when there are more than `max_layer_columns`), then the
    energy ranks per layer."""
    cfg = result["config"]
    lines = []
    title = result.get("model", {}).get("name", result.get("source", "capture"))
    lines.append(f"{title}: prompt {cfg['prompt_len']} tokens, {cfg['steps']} decode steps, layers "
                 f"{cfg['layers']}, chunk {cfg['chunk_size']}, outliers {cfg['outlier_chunks']} chunks, local "
                 f"{cfg['local_chunks']} chunks, store dtype {cfg['dtype']}, warm={cfg['warm']}")
    lines.append("")
    has_mass = any("mass_covered" in r["overall"] for r in result["runs"])
    rows = []
    for r in result["runs"]:
        o = r["overall"]
        row = [r["rank"], r["budget"], f"{o.get('attended_tokens', 0):.0f}", _fmt(o["rel_err_mean"]),
               _fmt(o["rel_err_max"]), f"{o['hit_rate']:.3f}"]
        if has_mass:
            row += [f"{o.get('mass_covered', float('nan')):.3f}", f"{o.get('mass_oracle', float('nan')):.3f}"]
        rows.append(row)
    lines += table(["rank", "budget", "attended", "rel. err mean", "rel. err max", "hit rate"]
                   + (["mass covered", "oracle mass"] if has_mass else []), rows, "---:")
    lines.append("")
    layers = [str(l) for l in cfg["layers"]]
    if len(layers) <= max_layer_columns:
        lines.append("Relative error (mean over steps) / hit rate per layer:")
        lines.append("")
        lines += table(["rank", "budget"] + [f"L{l}" for l in layers],
                       [[r["rank"], r["budget"]] + [f"{_fmt(r['layers'][l]['rel_err_mean'])} / "
                                                    f"{r['layers'][l]['hit_rate']:.2f}" for l in layers]
                        for r in result["runs"]], "---:")
    else:
        lines.append(f"Across the {len(layers)} layers (each layer's mean over steps; per-layer values in the JSON):")
        lines.append("")
        rows = []
        for r in result["runs"]:
            errs = sorted((r["layers"][l]["rel_err_mean"], l) for l in layers)
            hits = sorted(r["layers"][l]["hit_rate"] for l in layers)
            rows.append([r["rank"], r["budget"], _fmt(errs[0][0]), _fmt(float(np.median([e for e, _ in errs]))),
                         f"{_fmt(errs[-1][0])} (L{errs[-1][1]})", f"{hits[0]:.2f}", f"{float(np.median(hits)):.2f}",
                         f"{hits[-1]:.2f}"])
        lines += table(["rank", "budget", "rel. err min", "median", "max (layer)", "hit rate min", "median", "max"],
                       rows, "---:")
    lines.append("")
    fr = list(next(iter(result["energy"].values()))["rank_for"])
    ranks = list(next(iter(result["energy"].values()))["key_error_at_rank"])
    lines.append(f"Rank for a share of pre-RoPE key energy (full rank {cfg['full_rank']}); at each evaluated rank r "
                 "the relative key error of the best rank-r approximation (key err) and the relative error of full "
                 "attention (float64, mean over steps) with every context key at rank r, outlier chunks included, and "
                 "nothing else changed (out err; the store keeps its outlier chunks exact, see its full-budget rows):")
    lines.append("")
    rows = []
    for l in layers:
        e = result["energy"][l]
        rows.append([l] + [e["rank_for"][f] for f in fr]
                    + [c for r in ranks for c in (_fmt(e["key_error_at_rank"][r]), _fmt(e["output_err_at_rank"][r]))])
    header = ["layer"] + [f"rank@{f}" for f in fr] + [c for r in ranks for c in (f"key err@r{r}", f"out err@r{r}")]
    lines += table(header, rows, "---:")
    checks = result.get("checks", {})
    if checks:
        out_err = [c["model_output_rel_err_max"] for c in checks.values() if "model_output_rel_err_max" in c]
        unr = [c["unrope_rel_err"] for c in checks.values() if "unrope_rel_err" in c]
        lines.append("")
        note = "Capture checks:"
        if out_err:
            note += f" float64 full attention vs the model's own decode output, max rel. err {max(out_err):.1e};"
        if unr:
            note += f" unrope(post-RoPE keys) vs the model's pre-RoPE keys, max rel. err {max(unr):.1e}"
        lines.append(note)
    return "\n".join(lines)

