"""Accuracy harness: full attention and the store, side by side, on the same synthetic retrieval prompts.

    python -m shadowkv_core.evaluation.accuracy --model smollm2 --tasks niah --lengths 2048,4096,8192 \\
        --depths 0,0.5,1 --samples 2 --budgets 3.125% --rank 64 --out eval_results/smollm2_niah

For each sample (tasks in `shadowkv_core.evaluation.tasks`) the prompt is prefilled once with the model's own dense
attention into a transformers `DynamicCache`, recording each layer's last query. Then

* full attention: greedy decoding continues from that DynamicCache;
* the store, for each budget: a `shadowkv_core.hf` ShadowKVCache is seeded from the same prefill exactly as the
  adapter's attention function does it during a prefill (each full-attention layer's `update` + the registered
  attention function with the prompt's post-RoPE keys/values, positions and last query -> `KVStore.prefill`;
  sliding-window layers get a copy of the DynamicCache's layer), and greedy decoding runs through the adapter
  (every decode step of every full-attention layer is a `KVStore.decode`).

So both see the same prompt and the same first token (the prefill is dense in both), and the dense prefill is paid
once per sample rather than once per configuration (`decoding.seed_store_cache`; `tests/python/test_eval.py` checks
that the seeded cache decodes token for token like a ShadowKVCache filled by the model's own prefill).

Writes `results.json` (every answer of both, scores, memory_report and stats of the store, times; rewritten after
each sample, so a run cut short keeps what it did), `summary.md` (the tables) and PNG plots: depth x length heatmaps
(niah, multikey, qa), accuracy vs budget (when several budgets are given), per-turn accuracy (multiturn).
`--replot results.json` redraws the plots and tables of an earlier run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import List, Optional

from tqdm.auto import tqdm

from .accuracy_report import plot, rescore, summarize, tables, write_json, write_outputs
from .decoding import GreedyDecoder, attention_modules, recording_last_queries, register_attention, seed_store_cache
from .haystack import Haystack
from .models import available_models
from .tasks import DEPTH_TASKS, TASKS, PromptFormat, Sample, make_sample, score

__all__ = ["EvalConfig", "budget_tokens", "evaluate", "main", "plot", "rescore", "summarize", "tables",
           "write_outputs"]

# fwe: three made-up words (RULER gives it 50); qa: one name or number
MAX_NEW_TOKENS = {"niah": 16, "multikey": 16, "multivalue": 48, "multiquery": 48, "vt": 40, "fwe": 32, "qa": 16,
                  "multiturn": 16}


# ---------------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------------

class EvalConfig:
    """What to run. Budgets are tokens ("128") or percentages of the prompt ("3.125%"), rounded to whole chunks."""

    def __init__(self, *, tasks=("niah",), lengths=(4096,), depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=2,
                 budgets=("3.125%",), rank=64, chunk_size=8, outlier_chunks=4, local_chunks=4,
                 generation_window=256, store_dtype=None, seed=0, max_new_tokens=None, time_limit=None,
                 sink_chunks=1, group_score="mean", chunk_score="landmark", selection="store", extend_block=32):
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
        if group_score not in ("mean", "max"):
            raise ValueError(f"group_score must be 'mean' or 'max', got {group_score!r}")
        self.group_score = str(group_score)
        if chunk_score not in ("landmark", "two_centroids"):
            raise ValueError(f"chunk_score must be 'landmark' or 'two_centroids', got {chunk_score!r}")
        self.chunk_score = str(chunk_score)
        if selection not in ("store", "oracle"):
            raise ValueError(f"selection must be 'store' or 'oracle', got {selection!r}")
        self.selection = str(selection)
        self.local_chunks = int(local_chunks)
        self.generation_window = int(generation_window)
        self.extend_block = int(extend_block)
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


def _oracle_run(decoder, dense, first_logits, sample, max_new, config, spec, budget, length, layers) -> dict:
    """One conversation on a copy of the dense prefill with the best possible chunk selection (oracle.py) at the
    store's budget and settings; shaped like a store run (memory: the dense cache's bytes, no stats)."""
    from .oracle import OracleSpec, oracle_attention

    cache = copy.deepcopy(dense)
    oracle = OracleSpec(prompt_length=length, budget_tokens=budget, chunk_size=config.chunk_size,
                        outlier_chunks=config.outlier_chunks, sink_chunks=config.sink_chunks,
                        local_chunks=config.local_chunks, store_layers=layers)
    with oracle_attention(oracle):
        run = decoder.converse(cache, first_logits, sample, max_new)
    dense_bytes = sum(t.numel() * t.element_size() for layer in dense.layers for t in (layer.keys, layer.values)
                      if t is not None)
    del cache
    scores = [score(a, t.expected) for a, t in zip(run["answers"], sample.turns)]
    return dict(budget=spec, budget_tokens=budget, store_prefill_seconds=0.0, scores=scores, selection="oracle",
                memory=dict(total=dense_bytes, value_store=0, full_attention_equivalent=dense_bytes), stats={}, **run)


def _versions() -> dict:
    import torch
    import transformers

    from .._store import build_info
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

    from . import haystack as hs

    model.set_attn_implementation(register_attention())
    fmt = PromptFormat(tokenizer)
    haystack = Haystack(tokenizer, haystack_text if haystack_text is not None else hs.haystack_text(),
                        min_tokens=max(config.lengths))
    samples = _samples(config, fmt, haystack)
    decoder = GreedyDecoder(model, tokenizer, fmt)
    modules = attention_modules(model)
    kv = skv.store_kwargs_for(model, max(config.lengths) + 64)
    rank = kv["num_kv_heads"] * kv["head_dim"] if config.rank in (None, "full") else int(config.rank)
    layer_types, _ = skv._plan_layers(model, max(config.lengths) + 64)
    oracle_layers = frozenset(i for i, kind in enumerate(layer_types) if kind == "full_attention")

    results = {
        "model": model_name,
        "model_config": {k: kv[k] for k in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim")},
        "config": dict(config.as_dict(), rank=rank),
        "versions": _versions(),
        "records": [],
        "complete": False,
    }
    bar = tqdm(total=len(samples) * (1 + len(config.budgets)), desc=f"eval {model_name}", disable=not progress)
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
            with recording_last_queries() as queries:
                started = time.perf_counter()
                first_logits = decoder.forward(prompt, dense)
                prefill_seconds = time.perf_counter() - started

            store_runs = []
            for spec in config.budgets:
                budget = budget_tokens(spec, length, config.chunk_size)
                if config.selection == "oracle":
                    store_runs.append(_oracle_run(decoder, dense, first_logits, sample, max_new, config, spec,
                                                  budget, length, oracle_layers))
                    done_store += sum(store_runs[-1]["scores"]) / len(store_runs[-1]["scores"])
                    n_store += 1
                    bar.update()
                    continue
                cache = skv.make_cache(model, budget=budget, rank=rank, chunk_size=config.chunk_size,
                                       outlier_chunks=config.outlier_chunks, sink_chunks=config.sink_chunks,
                                       group_score=config.group_score, chunk_score=config.chunk_score,
                                       local_chunks=config.local_chunks,
                                       generation_window=config.generation_window, max_seq_len=capacity,
                                       dtype=config.store_dtype, extend_block=config.extend_block)
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
                bar.set_postfix_str(f"full {done_full:.0f}/{n_full} store {done_store:.1f}/{n_store}", refresh=False)
                bar.update()
            full = decoder.converse(dense, first_logits, sample, max_new)
            del dense
        full_scores = [score(a, t.expected) for a, t in zip(full["answers"], sample.turns)]
        done_full += sum(full_scores) / len(full_scores)
        n_full += 1
        bar.set_postfix_str(f"full {done_full:.1f}/{n_full} store {done_store:.1f}/{n_store}", refresh=False)
        bar.update()
        results["records"].append(dict(
            task=sample.task, length=sample.length, prompt_tokens=length, depth=sample.depth, index=sample.index,
            needles=sample.needles, questions=[t.question for t in sample.turns],
            expected=[t.expected for t in sample.turns], prefill_seconds=prefill_seconds,
            full=dict(scores=full_scores, **full), store=store_runs))
        results["elapsed_seconds"] = time.perf_counter() - started_run
        if out_dir is not None:
            write_json(results, out_dir)
    bar.close()
    results["complete"] = len(results["records"]) == len(samples)
    results["elapsed_seconds"] = time.perf_counter() - started_run
    results["summary"] = summarize(results)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------

def _floats(text: str) -> list:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shadowkv_core.evaluation.accuracy",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=available_models(),
                   help="a packaged model (shadowkv_core.evaluation.models)")
    p.add_argument("--tasks", default="niah", help=f"comma-separated: {','.join(TASKS)}")
    p.add_argument("--lengths", default="4096", help="prompt tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths for niah/multikey/qa")
    p.add_argument("--samples", type=int, default=2, help="samples per (task, length, depth)")
    p.add_argument("--budgets", default="3.125%",
                   help="store budgets, comma-separated: tokens (128) or %% of the prompt (e.g. "
                        "0.78%%,1.56%%,3.125%%,6.25%%,12.5%%,25%%)")
    p.add_argument("--rank", default="64", help="rank of the key factorisation, or 'full' (= kv heads x head_dim)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outliers", type=int, default=4, help="outlier chunks per KV head")
    p.add_argument("--sink-chunks", type=int, default=1, help="of the outlier chunks, the prompt's first (sinks)")
    p.add_argument("--group-score", default="mean", choices=("mean", "max"),
                   help="how a chunk's score combines the query heads of a KV head's group (KVStore group_score)")
    p.add_argument("--chunk-score", default="landmark", choices=("landmark", "two_centroids"),
                   help="what a chunk's score is computed from (KVStore chunk_score)")
    p.add_argument("--selection", default="store", choices=("store", "oracle"),
                   help="oracle: instead of the store, attention over the chunks with the most true attention mass "
                        "(exact keys, as many chunks as the store attends; shadowkv_core.evaluation.oracle): the "
                        "best any chunk score could do at the budget")
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--generation-window", type=int, default=256)
    p.add_argument("--extend-block", type=int, default=32,
                   help="tokens of a later turn's question that share one selection (the store's extend_block; 1: "
                        "one decode per token)")
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
    return p


def main(argv=None, *, model=None, tokenizer=None) -> int:
    """Command line entry; `model`/`tokenizer` (tests) replace loading --model."""
    parser = _parser()
    args = parser.parse_args(argv)
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
    try:
        config = EvalConfig(
            tasks=[t.strip() for t in args.tasks.split(",") if t.strip()], lengths=_ints(args.lengths),
            depths=_floats(args.depths), samples=args.samples,
            budgets=[b.strip() for b in args.budgets.split(",") if b.strip()],
            rank=None if args.rank == "full" else int(args.rank), chunk_size=args.chunk_size,
            outlier_chunks=args.outliers, local_chunks=args.local_chunks, generation_window=args.generation_window,
            sink_chunks=args.sink_chunks, group_score=args.group_score, chunk_score=args.chunk_score,
            selection=args.selection, store_dtype=args.store_dtype, seed=args.seed,
            max_new_tokens=args.max_new_tokens, time_limit=args.time_limit, extend_block=args.extend_block)
    except ValueError as exc:  # an unknown task, a misspelt budget or rank: one line, not a traceback
        parser.error(str(exc))
    name = args.model
    if model is None:
        from .models import load_model
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    else:
        name = getattr(model.config, "model_type", "model")
    results = evaluate(model, tokenizer, config, model_name=name, out_dir=args.out)
    results["command"] = ("python -m shadowkv_core.evaluation.accuracy "
                          + " ".join(sys.argv[1:] if argv is None else argv))
    paths = write_outputs(results, args.out, plots=not args.no_plots)
    print(tables(results))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
