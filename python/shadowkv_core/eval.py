"""Accuracy harness: full attention and the store, side by side, on the same synthetic retrieval prompts.

    python -m shadowkv_core.eval --model smollm2 --tasks niah --lengths 2048,4096,8192 --depths 0,0.5,1 \\
        --samples 2 --budgets 3.125% --rank 64 --out eval_results/smollm2_niah

For each sample (tasks in `shadowkv_core.eval_tasks`) the prompt is prefilled once with the model's own dense
attention into a transformers `DynamicCache`, recording each layer's last query. Then

* full attention: greedy decoding continues from that DynamicCache;
* the store, for each budget: a `shadowkv_core.hf` ShadowKVCache is seeded from the same prefill exactly as the
  adapter's attention function does it during a prefill (each full-attention layer's `update` + the registered
  attention function with the prompt's post-RoPE keys/values, positions and last query -> `KVStore.prefill`;
  sliding-window layers get a copy of the DynamicCache's layer), and greedy decoding runs through the adapter
  (every decode step of every full-attention layer is a `KVStore.decode`).

So both see the same prompt and the same first token (the prefill is dense in both), and the dense prefill is paid
once per sample rather than once per configuration. `tests/python/test_eval.py` checks that the seeded cache decodes
token for token like a ShadowKVCache filled by the model's own prefill.

Writes `results.json` (every answer of both, scores, memory_report and stats of the store, times; rewritten after
each sample, so a run cut short keeps what it did), `summary.md` (the tables) and PNG plots: depth x length heatmaps
(niah, multikey), accuracy vs budget (when several budgets are given), per-turn accuracy (multiturn).
`--replot results.json` redraws the plots and tables of an earlier run.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import platform
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from ._progress import ProgressBar
from .eval_tasks import DEPTH_TASKS, TASKS, Haystack, PromptFormat, Sample, make_sample, score

__all__ = ["EvalConfig", "budget_tokens", "evaluate", "main", "rescore", "seed_store_cache", "summarize", "tables",
           "write_outputs"]

ATTENTION_NAME = "shadowkv_eval"
MAX_NEW_TOKENS = {"niah": 16, "multikey": 16, "multivalue": 48, "multiquery": 48, "vt": 40, "multiturn": 16}


# ---------------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------------

class EvalConfig:
    """What to run. Budgets are tokens ("128") or percentages of the prompt ("3.125%"), rounded to whole chunks."""

    def __init__(self, *, tasks=("niah",), lengths=(4096,), depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=2,
                 budgets=("3.125%",), rank=64, chunk_size=8, outlier_chunks=4, local_chunks=4,
                 generation_window=256, store_dtype=None, seed=0, max_new_tokens=None, time_limit=None,
                 sink_chunks=1):
        for task in tasks:
            if task not in TASKS:
                raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
        self.tasks = list(tasks)
        self.lengths = [int(n) for n in lengths]
        self.depths = [float(d) for d in depths]
        self.samples = int(samples)
        self.budgets = [str(b) for b in budgets]
        self.rank = rank
        self.chunk_size = int(chunk_size)
        self.outlier_chunks = int(outlier_chunks)
        self.sink_chunks = int(sink_chunks)
        self.local_chunks = int(local_chunks)
        self.generation_window = int(generation_window)
        self.store_dtype = store_dtype
        self.seed = int(seed)
        self.max_new_tokens = max_new_tokens
        self.time_limit = time_limit
        for b in self.budgets:
            budget_tokens(b, 1024, self.chunk_size)  # validates the spelling

    def as_dict(self) -> dict:
        return dict(vars(self))


def budget_tokens(spec: str, length: int, chunk_size: int) -> int:
    """Tokens of a budget spec at a prompt of `length` tokens: "128" or "3.125%", rounded to a multiple of
    chunk_size (at least one chunk)."""
    text = str(spec).strip()
    try:
        tokens = float(text[:-1]) / 100.0 * length if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"budget {spec!r}: give tokens (128) or a percentage of the prompt (3.125%)") from None
    if not tokens > 0:
        raise ValueError(f"budget {spec!r} must be positive")
    return max(chunk_size, int(round(tokens / chunk_size)) * chunk_size)


# ---------------------------------------------------------------------------------------------------------------------
# the model side: prefill capture, seeding the store, greedy decoding
# ---------------------------------------------------------------------------------------------------------------------

_recording = threading.local()


def _eval_attention(module, query, key, value, attention_mask, **kwargs):
    """The adapter's attention function, recording each layer's last query during a recorded prefill."""
    import shadowkv_core.hf as skv

    queries = getattr(_recording, "queries", None)
    if queries is not None and query.shape[2] > 1:
        queries[module.layer_idx] = query[:, :, -1:, :].detach().clone()
    return skv.shadowkv_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    import shadowkv_core.hf as skv

    skv.register()
    AttentionInterface.register(ATTENTION_NAME, _eval_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def _attention_modules(model) -> dict:
    return {m.layer_idx: m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling") and hasattr(m, "head_dim")}


def seed_store_cache(cache, prefilled, queries: dict, modules: dict, length: int) -> None:
    """Fills a fresh ShadowKVCache from a DynamicCache that holds a `length`-token prompt (batch 1, no padding),
    as the adapter does during the model's own prefill: per full-attention layer, the cache layer's `update` with
    the prompt's post-RoPE keys/values, then the registered attention function with the last prompt query (the
    store only uses the prompt's last query, as q_last) -> `KVStore.prefill(..., keys_post_rope=True)`. Other
    layers (sliding windows) get a copy of the DynamicCache's layer."""
    import torch

    import shadowkv_core.hf as skv

    positions = torch.arange(length, dtype=torch.int64)[None]
    for idx, layer in enumerate(cache.layers):
        source = prefilled.layers[idx]
        if isinstance(layer, skv.ShadowKVLayer):
            keys, values = source.keys, source.values
            if keys is None or keys.shape[-2] != length:
                raise RuntimeError(f"layer {idx}: the prefilled cache holds {None if keys is None else keys.shape} "
                                   f"for a {length}-token prompt")
            module = modules[idx]
            layer.update(keys, values)
            skv.shadowkv_attention_forward(module, queries[idx], keys, values, None, scaling=module.scaling,
                                           position_ids=positions.to(keys.device))
            if not layer.prefilled:
                raise RuntimeError(f"layer {idx}: the adapter did not prefill the store")
        else:
            cache.layers[idx] = copy.deepcopy(source)


class _Decoder:
    """Greedy decoding of a conversation on one cache."""

    def __init__(self, model, tokenizer, fmt: PromptFormat) -> None:
        self.model, self.tokenizer, self.fmt = model, tokenizer, fmt
        forward = inspect.signature(type(model).forward).parameters
        self.cache_kw = "cache" if "cache" in forward else "past_key_values"
        eos = set()
        for source in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(t) for t in source)
        self.eos = eos

    def forward(self, ids: List[int], cache):
        import torch

        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.model.device),
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[0, -1].float()

    def _done(self, tokens: List[int]) -> bool:
        if tokens[-1] in self.eos:
            return True
        return self.fmt.stop_at_newline and "\n" in self.tokenizer.decode(tokens, skip_special_tokens=True)

    def converse(self, cache, first_logits, sample: Sample, max_new: int) -> dict:
        """Answers every turn of `sample`, the first from `first_logits` (the prompt's last position)."""
        answers, decode_seconds, decode_steps, turn_seconds = [], 0.0, 0, 0.0
        logits, last = first_logits, None
        for t, turn in enumerate(sample.turns):
            if t > 0:
                feed = self.fmt.encode_next(self.fmt.next(turn))
                text_of_last = self.tokenizer.decode([last], skip_special_tokens=True)
                if last not in self.eos and text_of_last.strip():
                    feed = [last] + feed
                started = time.perf_counter()
                logits = self.forward(feed, cache)
                turn_seconds += time.perf_counter() - started
            tokens = [int(logits.argmax())]
            while len(tokens) < max_new and not self._done(tokens):
                started = time.perf_counter()
                logits = self.forward([tokens[-1]], cache)
                decode_seconds += time.perf_counter() - started
                decode_steps += 1
                tokens.append(int(logits.argmax()))
            last = tokens[-1]
            answers.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return dict(answers=answers, decode_seconds=decode_seconds, decode_steps=decode_steps,
                    turn_prefill_seconds=turn_seconds)


# ---------------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------------

def _samples(config: EvalConfig, fmt: PromptFormat, haystack: Haystack) -> List[Sample]:
    """Index-major, so a run cut short has every (task, length, depth) cell at similar counts."""
    out = []
    for index in range(config.samples):
        for task in config.tasks:
            for length in config.lengths:
                for depth in (config.depths if task in DEPTH_TASKS else [None]):
                    out.append(make_sample(task, length, fmt, haystack, depth=depth, index=index, seed=config.seed))
    return out


def _versions() -> dict:
    import torch
    import transformers

    from ._store import build_info
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "shadowkv_core": build_info().get("version"), "threads": torch.get_num_threads(),
            "machine": platform.machine()}


def evaluate(model, tokenizer, config: EvalConfig, *, model_name: str = "model", haystack_text: Optional[str] = None,
             out_dir: Optional[os.PathLike] = None, progress: bool = True) -> dict:
    """Runs `config` on `model`; returns the results dict (also written to out_dir/results.json after each sample
    when out_dir is given)."""
    import torch

    import shadowkv_core.hf as skv
    from transformers import DynamicCache

    from .models import haystack_text as default_haystack

    name = _register()
    model.set_attn_implementation(name)
    fmt = PromptFormat(tokenizer)
    haystack = Haystack(tokenizer, haystack_text if haystack_text is not None else default_haystack(),
                        min_tokens=max(config.lengths))
    samples = _samples(config, fmt, haystack)
    decoder = _Decoder(model, tokenizer, fmt)
    modules = _attention_modules(model)
    kv = skv.store_kwargs_for(model, max(config.lengths) + 64)
    rank = kv["num_kv_heads"] * kv["head_dim"] if config.rank in (None, "full") else int(config.rank)

    results = {
        "model": model_name,
        "model_config": {k: kv[k] for k in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim")},
        "config": dict(config.as_dict(), rank=rank),
        "versions": _versions(),
        "records": [],
        "complete": False,
    }
    bar = ProgressBar(len(samples) * (1 + len(config.budgets)), f"eval {model_name}") if progress else None
    started_run = time.perf_counter()
    done_full = done_store = 0.0
    n_full = n_store = 0
    for sample in samples:
        if results["records"] and config.time_limit and time.perf_counter() - started_run > config.time_limit:
            break
        max_new = config.max_new_tokens or MAX_NEW_TOKENS[sample.task]
        prompt = fmt.encode_first(fmt.first(sample.instruction, sample.context, sample.turns[0]))
        length = len(prompt)
        later = sum(len(fmt.encode_next(fmt.next(turn))) + 1 for turn in sample.turns[1:])
        capacity = length + later + max_new * len(sample.turns) + 8

        with torch.no_grad():
            dense = DynamicCache(config=model.config)
            _recording.queries = {}
            try:
                started = time.perf_counter()
                first_logits = decoder.forward(prompt, dense)
                prefill_seconds = time.perf_counter() - started
                queries = _recording.queries
            finally:
                _recording.queries = None

            store_runs = []
            for spec in config.budgets:
                budget = budget_tokens(spec, length, config.chunk_size)
                cache = skv.make_cache(model, budget=budget, rank=rank, chunk_size=config.chunk_size,
                                       outlier_chunks=config.outlier_chunks, sink_chunks=config.sink_chunks,
                                       local_chunks=config.local_chunks,
                                       generation_window=config.generation_window, max_seq_len=capacity,
                                       dtype=config.store_dtype)
                started = time.perf_counter()
                seed_store_cache(cache, dense, queries, modules, length)
                store_prefill = time.perf_counter() - started
                run = decoder.converse(cache, first_logits, sample, max_new)
                memory, stats = cache.store.memory_report(), cache.store.stats()
                cache.release()
                del cache
                scores = [score(a, t.expected) for a, t in zip(run["answers"], sample.turns)]
                store_runs.append(dict(budget=spec, budget_tokens=budget, store_prefill_seconds=store_prefill,
                                       scores=scores, memory=memory, stats=stats, **run))
                done_store += sum(scores) / len(scores)
                n_store += 1
                if bar:
                    bar.advance(note=f"full {done_full:.0f}/{n_full} store {done_store:.1f}/{n_store}")
            full = decoder.converse(dense, first_logits, sample, max_new)
            del dense
        full_scores = [score(a, t.expected) for a, t in zip(full["answers"], sample.turns)]
        done_full += sum(full_scores) / len(full_scores)
        n_full += 1
        if bar:
            bar.advance(note=f"full {done_full:.1f}/{n_full} store {done_store:.1f}/{n_store}")
        results["records"].append(dict(
            task=sample.task, length=sample.length, prompt_tokens=length, depth=sample.depth, index=sample.index,
            needles=sample.needles, questions=[t.question for t in sample.turns],
            expected=[t.expected for t in sample.turns], prefill_seconds=prefill_seconds,
            full=dict(scores=full_scores, **full), store=store_runs))
        results["elapsed_seconds"] = time.perf_counter() - started_run
        if out_dir is not None:
            _write_json(results, out_dir)
    if bar and bar.done < bar.total:
        sys.stderr.write("\n")
    results["complete"] = len(results["records"]) == len(samples)
    results["elapsed_seconds"] = time.perf_counter() - started_run
    results["summary"] = summarize(results)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# summary, tables, plots
# ---------------------------------------------------------------------------------------------------------------------

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
            t["store_prefill_seconds"].append(run["store_prefill_seconds"])
        t = times[(rec["task"], rec["length"])]
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


def tables(results: dict) -> str:
    """Markdown tables of a results dict (accuracy full vs store, per turn, memory, time)."""
    s = results.get("summary") or summarize(results)
    cfg = results["config"]
    lines = [f"model {results['model']} {results.get('model_config', {})}; rank {cfg['rank']}, chunk "
             f"{cfg['chunk_size']}, outlier chunks {cfg['outlier_chunks']}, local chunks {cfg['local_chunks']}, "
             f"samples {cfg['samples']}, seed {cfg['seed']}; {len(results['records'])} prompts"
             + ("" if results.get("complete") else " (run cut short)"), ""]
    by_task = defaultdict(list)
    for row in s["accuracy"]:
        by_task[row["task"]].append(row)
    for task, rows in by_task.items():
        lines += [f"**{task}** accuracy (full attention / store)", "",
                  "| length | prompt tokens | depth | budget | budget tokens | n | full | store |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        rows.sort(key=lambda r: (r["length"], _budget_sort_key(r["budget"]), -1 if r["depth"] is None else r["depth"]))
        for r in rows:
            lines.append(f"| {r['length']} | {r['prompt_tokens']:.0f} | {'—' if r['depth'] is None else r['depth']} "
                         f"| {r['budget']} | {r['budget_tokens']:.0f} | {r['n']} | {_fmt(r['full'])} | "
                         f"{_fmt(r['store'])} |")
        # per (length, budget) over depths
        agg = defaultdict(lambda: [[], []])
        for r in rows:
            agg[(r["length"], r["budget"])][0].append(r["full"])
            agg[(r["length"], r["budget"])][1].append(r["store"])
        if any(r["depth"] is not None for r in rows):
            lines += ["", f"**{task}** mean over depths", "", "| length | budget | full | store |",
                      "| --- | --- | --- | --- |"]
            for (length, budget), (f, st) in sorted(agg.items(), key=lambda kv: (kv[0][0], _budget_sort_key(kv[0][1]))):
                lines.append(f"| {length} | {budget} | {_fmt(_mean(f))} | {_fmt(_mean(st))} |")
        lines.append("")
    if s["per_turn"]:
        budgets = sorted({r["budget"] for r in s["per_turn"]}, key=_budget_sort_key)
        turns = sorted({r["turn"] for r in s["per_turn"]})
        lines += ["**multiturn** accuracy per turn", "",
                  "| length | | " + " | ".join(f"turn {t}" for t in turns) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in turns) + " |"]
        for length in sorted({r["length"] for r in s["per_turn"]}):
            cells = {(r["budget"], r["turn"]): r for r in s["per_turn"] if r["length"] == length}
            lines.append(f"| {length} | full | " + " | ".join(_fmt(cells[(budgets[0], t)]["full"]) for t in turns) + " |")
            for b in budgets:
                lines.append(f"| {length} | store {b} | " + " | ".join(_fmt(cells[(b, t)]["store"]) for t in turns)
                             + " |")
        lines.append("")
    lines += ["**memory** of the store (store layers only; MiB) vs full attention KV of the same layers", "",
              "| length | budget | budget tokens | store total | store w/o value store | full KV | saved (total) | "
              "saved (w/o values) | hit rate |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(s["memory"], key=lambda r: (r["length"], _budget_sort_key(r["budget"]))):
        lines.append(f"| {r['length']} | {r['budget']} | {r['budget_tokens']:.0f} | {_fmt(r['store_total_mib'])} | "
                     f"{_fmt(r['store_resident_mib'])} | {_fmt(r['full_kv_mib'])} | {_fmt(100 * r['saved_total'], 1)}% | "
                     f"{_fmt(100 * r['saved_resident'], 1)}% | {_fmt(r['hit_rate'])} |")
    lines += ["", "**time** (CPU; dense prefill shared by both; store prefill = factorisation etc. per budget)", "",
              "| task | length | dense prefill s | store prefill s | full ms/token | store ms/token |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(s["time"], key=lambda r: (r["task"], r["length"])):
        lines.append(f"| {r['task']} | {r['length']} | {_fmt(r.get('prefill_seconds'), 1)} | "
                     f"{_fmt(r.get('store_prefill_seconds'), 1)} | {_fmt(r.get('full_ms_per_token'), 0)} | "
                     f"{_fmt(r.get('store_ms_per_token'), 0)} |")
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

    # accuracy vs budget (fraction of the prompt), per task and length
    budgets = {r["budget"] for r in s["accuracy"]}
    if len(budgets) > 1:
        for task in sorted({r["task"] for r in s["accuracy"]}):
            rows = [r for r in s["accuracy"] if r["task"] == task]
            fig, ax = plt.subplots(figsize=(6, 4))
            for k, length in enumerate(sorted({r["length"] for r in rows})):
                pts = defaultdict(lambda: [[], [], []])
                for r in rows:
                    if r["length"] == length:
                        p = pts[r["budget"]]
                        p[0].append(r["budget_tokens"] / r["prompt_tokens"])
                        p[1].append(r["store"])
                        p[2].append(r["full"])
                xs = sorted(pts, key=_budget_sort_key)
                color = f"C{k}"
                ax.plot([100 * _mean(pts[b][0]) for b in xs], [_mean(pts[b][1]) for b in xs], "o-", color=color,
                        label=f"store, {length} tokens")
                ax.axhline(_mean(v for b in xs for v in pts[b][2]), color=color, ls="--",
                           label=f"full attention, {length} tokens")
            ax.set_xscale("log")
            ticks = sorted({round(100 * r["budget_tokens"] / r["prompt_tokens"], 2) for r in rows})
            ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("budget (% of the prompt's tokens)")
            ax.set_ylabel("accuracy")
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(f"{task}: {title}", fontsize=10)
            ax.legend(fontsize=8)
            path = out / f"{task}_budget_sweep.png"
            fig.savefig(path, dpi=90, bbox_inches="tight")
            plt.close(fig)
            written.append(str(path))

    if s["per_turn"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for length in sorted({r["length"] for r in s["per_turn"]}):
            rows = [r for r in s["per_turn"] if r["length"] == length]
            bs = sorted({r["budget"] for r in rows}, key=_budget_sort_key)
            turns = sorted({r["turn"] for r in rows})
            full = [_mean(r["full"] for r in rows if r["turn"] == t) for t in turns]
            ax.plot(turns, full, "k--o", label=f"full attention, {length} tokens")
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


def _write_json(results: dict, out_dir: os.PathLike) -> Path:
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
    written = [str(_write_json(results, out_dir))]
    summary = Path(out_dir) / "summary.md"
    summary.write_text(tables(results))
    written.append(str(summary))
    if plots:
        written += plot(results, out_dir)
    return written


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------

def _floats(text: str) -> list:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def _parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m shadowkv_core.eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 or gemma3 (shadowkv_core.models)")
    p.add_argument("--tasks", default="niah", help=f"comma-separated: {','.join(TASKS)}")
    p.add_argument("--lengths", default="4096", help="prompt tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths for niah/multikey")
    p.add_argument("--samples", type=int, default=2, help="samples per (task, length, depth)")
    p.add_argument("--budgets", default="3.125%",
                   help="store budgets, comma-separated: tokens (128) or % of the prompt (e.g. "
                        "0.78%%,1.56%%,3.125%%,6.25%%,12.5%%,25%%)")
    p.add_argument("--rank", default="64", help="rank of the key factorisation, or 'full' (= kv heads x head_dim)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outliers", type=int, default=4, help="outlier chunks per KV head")
    p.add_argument("--sink-chunks", type=int, default=1, help="of the outlier chunks, the prompt's first (sinks)")
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--generation-window", type=int, default=256)
    p.add_argument("--store-dtype", default=None, help="store precision (default: the model's)")
    p.add_argument("--dtype", default="float32", help="model weights dtype")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: per task (16 for needles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds; no new sample starts after it (the results say complete: false)")
    p.add_argument("--out", default="eval_results", help="output directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--replot", default=None, metavar="RESULTS_JSON",
                   help="only redraw plots and summary.md of an earlier results.json (into --out)")
    return p.parse_args(argv)


def main(argv=None, *, model=None, tokenizer=None) -> int:
    """Command line entry; `model`/`tokenizer` (tests) replace loading --model."""
    args = _parse_args(argv)
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for path in write_outputs(results, args.out, plots=not args.no_plots):
            print(path)
        print(tables(results))
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EvalConfig(
        tasks=[t.strip() for t in args.tasks.split(",") if t.strip()], lengths=_ints(args.lengths),
        depths=_floats(args.depths), samples=args.samples,
        budgets=[b.strip() for b in args.budgets.split(",") if b.strip()],
        rank=None if args.rank == "full" else int(args.rank), chunk_size=args.chunk_size,
        outlier_chunks=args.outliers, local_chunks=args.local_chunks, generation_window=args.generation_window,
        sink_chunks=args.sink_chunks, store_dtype=args.store_dtype, seed=args.seed, max_new_tokens=args.max_new_tokens,
        time_limit=args.time_limit)
    name = args.model
    if model is None:
        from .models import load_model
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    else:
        name = getattr(model.config, "model_type", "model")
    results = evaluate(model, tokenizer, config, model_name=name, out_dir=args.out)
    results["command"] = "python -m shadowkv_core.eval " + " ".join(sys.argv[1:] if argv is None else argv)
    paths = write_outputs(results, args.out, plots=not args.no_plots)
    print(tables(results))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
