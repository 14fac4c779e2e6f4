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

Many questions per prefill (`--questions-per-document Q`, Q > 1; tasks.DOCUMENT_TASKS): a document carrying the
needles of Q questions (`tasks.make_document`) is prefilled once (its tokens without any question); then each
question is asked on its own copy: full attention on a `copy.deepcopy` of the DynamicCache, the store, per budget, on
a `copy.deepcopy` of the seeded ShadowKVCache (a `KVStore.fork` of its sequence: the document's compressed state is
shared, not copied), released after the answer. The question's tokens go through the model's forward (the store's
`extend`), then greedy decoding. One record per question (`document`, `question`); its `memory` and `stats` are
those of the question's sequence as if it were alone (the document's report plus what the question added), so they
equal a one-question run's. `--reprefill-documents` prefills the document again for every question instead (no copy,
no fork): the check that sharing changes no answer, at Q times the prefill cost.

Writes `results.json` (every answer of both, scores, memory_report and stats of the store, times; rewritten after
each sample or document, so a run cut short keeps what it did; `--resume` continues such a run: the samples and
documents already in its results.json are kept and skipped), `summary.md` (the tables) and PNG plots: depth x length
heatmaps (niah, multikey, qa), accuracy vs budget (when several budgets are given), per-turn accuracy (multiturn).
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
from .tasks import (DEPTH_TASKS, DOCUMENT_TASKS, TASKS, Document, PromptFormat, Sample, make_document, make_sample,
                    question_prompt, score)

__all__ = ["EvalConfig", "ResumeMismatch", "budget_tokens", "evaluate", "main", "plot", "rescore", "summarize",
           "tables", "unit_id", "write_outputs"]

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
                 sink_chunks=1, group_score="mean", chunk_score="landmark", selection="store", extend_block=32,
                 questions_per_document=1, share_prefill=True):
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
        self.questions_per_document = int(questions_per_document)
        if self.questions_per_document < 1:
            raise ValueError(f"questions_per_document must be at least 1, got {questions_per_document}")
        self.share_prefill = bool(share_prefill)
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

def _samples(config: EvalConfig, fmt: PromptFormat, haystack: Haystack) -> list:
    """Samples, and with questions_per_document > 1 documents for DOCUMENT_TASKS (one per (task, length, index); the
    depths are the document's own, `tasks.spread_depths`). Index-major, so a run cut short has every (task, length,
    depth) cell at similar counts."""
    out: list = []
    questions = config.questions_per_document
    for index in range(config.samples):
        for task in config.tasks:
            for length in config.lengths:
                if questions > 1 and task in DOCUMENT_TASKS:
                    out.append(make_document(task, length, fmt, haystack, questions=questions, index=index,
                                             seed=config.seed))
                    continue
                for depth in (config.depths if task in DEPTH_TASKS else [None]):
                    out.append(make_sample(task, length, fmt, haystack, depth=depth, index=index, seed=config.seed))
    return out


def unit_id(unit) -> str:
    """The id results.json gives a sample ("task:length:depth:index", depth "-" when none) or a document
    ("task:length:qQ:index"); every record says its unit's id in `document`."""
    if isinstance(unit, Document):
        return f"{unit.task}:{unit.length}:q{len(unit.questions)}:{unit.index}"
    return f"{unit.task}:{unit.length}:{'-' if unit.depth is None else float(unit.depth)}:{unit.index}"


def _record_unit(rec: dict) -> str:
    """The unit id of a record (records written before `document` existed: from their task, length, depth, index)."""
    if rec.get("document"):
        return rec["document"]
    depth = rec.get("depth")
    return f"{rec['task']}:{rec['length']}:{'-' if depth is None else float(depth)}:{rec['index']}"


class ResumeMismatch(ValueError):
    """--resume found a results.json of another run (another model or configuration)."""


def _check_resumable(previous: dict, results: dict, path: Path) -> None:
    if previous.get("model") != results["model"]:
        raise ResumeMismatch(f"--resume: {path} is a run of model {previous.get('model')!r}, not "
                             f"{results['model']!r}")
    defaults = json.loads(json.dumps(EvalConfig().as_dict(), default=float))
    now = json.loads(json.dumps(results["config"], default=float))
    before = previous.get("config", {})
    for key in sorted(set(now) | set(before)):
        if key == "time_limit" or (key == "samples" and before.get(key, 0) <= now[key]):
            continue   # more samples: the first ones are the same prompts (index-major, a function of the index)
        old = before.get(key, defaults.get(key))
        if old != now.get(key, defaults.get(key)):
            raise ResumeMismatch(f"--resume: {path} was run with {key}={old!r}, this run has {key}="
                                 f"{now.get(key)!r}; resume with the same settings or write to another --out")


def _oracle_run(ask, dense, turns, config, spec, budget, length, layers) -> dict:
    """`ask(cache)` (a conversation, or one question of a document) on a copy of the dense prefill with the best
    possible chunk selection (oracle.py) at the store's budget and settings; shaped like a store run (memory: the
    dense cache's bytes, no stats)."""
    from .oracle import OracleSpec, oracle_attention

    cache = copy.deepcopy(dense)
    oracle = OracleSpec(prompt_length=length, budget_tokens=budget, chunk_size=config.chunk_size,
                        outlier_chunks=config.outlier_chunks, sink_chunks=config.sink_chunks,
                        local_chunks=config.local_chunks, store_layers=layers)
    with oracle_attention(oracle):
        run = ask(cache)
    dense_bytes = sum(t.numel() * t.element_size() for layer in dense.layers for t in (layer.keys, layer.values)
                      if t is not None)
    del cache
    scores = [score(a, t.expected) for a, t in zip(run["answers"], turns)]
    return dict(budget=spec, budget_tokens=budget, store_prefill_seconds=0.0, scores=scores, selection="oracle",
                memory=dict(total=dense_bytes, value_store=0, full_attention_equivalent=dense_bytes), stats={}, **run)


def _alone(document: dict, forked: dict, answered: dict) -> dict:
    """A report (memory_report or stats) of a question's sequence as if it were alone in its store: the document's
    report plus what changed between the fork and the answer (the document itself changes no more after its seed,
    and a fork changes no statistic). Non-numeric entries and hit_rate are recomputed or kept from `answered`."""
    out = {}
    for key, value in answered.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "hit_rate":
            out[key] = document.get(key, 0) + value - forked.get(key, 0)
        else:
            out[key] = value
    if "hit_rate" in answered:
        looked = out.get("hits", 0) + out.get("misses", 0)
        out["hit_rate"] = out["hits"] / looked if looked else 0.0
    return out


def _versions() -> dict:
    import torch
    import transformers

    from .._store import build_info
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "shadowkv_core": build_info().get("version"), "threads": torch.get_num_threads(),
            "machine": platform.machine()}


def evaluate(model, tokenizer, config: EvalConfig, *, model_name: str = "model", haystack_text: Optional[str] = None,
             out_dir: Optional[os.PathLike] = None, progress: bool = True, resume: bool = False) -> dict:
    """Runs `config` on `model`; returns the results dict (also written to out_dir/results.json after each sample or
    document when out_dir is given). resume: keep the records of out_dir/results.json (a run of the same model and
    configuration, else ResumeMismatch) and run only the samples and documents it lacks."""
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
    previous_seconds = 0.0
    path = Path(out_dir) / "results.json" if out_dir is not None else None
    if resume and path is not None and path.exists():
        previous = json.loads(path.read_text())
        _check_resumable(previous, results, path)
        wanted = {unit_id(unit) for unit in samples}
        results["records"] = [rec for rec in previous["records"] if _record_unit(rec) in wanted]
        previous_seconds = float(previous.get("elapsed_seconds", 0.0))
        results["resumed"] = int(previous.get("resumed", 0)) + 1
    done = {_record_unit(rec) for rec in results["records"]}
    todo = [unit for unit in samples if unit_id(unit) not in done]

    def questions(unit) -> int:
        return len(unit.questions) if isinstance(unit, Document) else 1

    bar = tqdm(total=sum(questions(u) for u in todo) * (1 + len(config.budgets)), desc=f"eval {model_name}",
               disable=not progress)
    started_run = time.perf_counter()
    tally = dict(full=0.0, n_full=0, store=0.0, n_store=0)

    def tick(side: str, scores: list) -> None:
        tally[side] += sum(scores) / len(scores)
        tally["n_" + side] += 1
        bar.set_postfix_str(f"full {tally['full']:.1f}/{tally['n_full']} store {tally['store']:.1f}/"
                            f"{tally['n_store']}", refresh=False)
        bar.update()

    def new_cache(budget: int, capacity: int, max_batch: int = 1):
        return skv.make_cache(model, budget=budget, rank=rank, chunk_size=config.chunk_size,
                              outlier_chunks=config.outlier_chunks, sink_chunks=config.sink_chunks,
                              group_score=config.group_score, chunk_score=config.chunk_score,
                              local_chunks=config.local_chunks, generation_window=config.generation_window,
                              max_seq_len=capacity, dtype=config.store_dtype, extend_block=config.extend_block,
                              max_batch=max_batch)

    def run_sample(sample: Sample) -> List[dict]:
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
                    store_runs.append(_oracle_run(
                        lambda cache: decoder.converse(cache, first_logits, sample, max_new), dense, sample.turns,
                        config, spec, budget, length, oracle_layers))
                    tick("store", store_runs[-1]["scores"])
                    continue
                cache = new_cache(budget, capacity)
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
                tick("store", scores)
            full = decoder.converse(dense, first_logits, sample, max_new)
            del dense
        full_scores = [score(a, t.expected) for a, t in zip(full["answers"], sample.turns)]
        tick("full", full_scores)
        return [dict(
            task=sample.task, length=sample.length, prompt_tokens=length, depth=sample.depth, index=sample.index,
            document=unit_id(sample), question=0,
            needles=sample.needles, questions=[t.question for t in sample.turns],
            expected=[t.expected for t in sample.turns], prefill_seconds=prefill_seconds,
            full=dict(scores=full_scores, **full), store=store_runs)]

    def run_document(doc: Document) -> List[dict]:
        """The document prefilled once (share_prefill) and each question asked on a copy of it; else prefilled
        again for every question, which is then asked on the caches themselves."""
        count = len(doc.questions)
        max_new = config.max_new_tokens or MAX_NEW_TOKENS[doc.task]
        head = question_prompt(fmt, doc, 0)[0]
        tails = [question_prompt(fmt, doc, q)[1] for q in range(count)]
        length = len(head)
        capacity = length + max(len(t) for t in tails) + max_new + 8
        budgets = [(spec, budget_tokens(spec, length, config.chunk_size)) for spec in config.budgets]
        store_runs: List[list] = [[] for _ in range(count)]
        full_runs: list = [None] * count
        prefill_seconds: List[float] = []

        def prefill():
            dense = DynamicCache(config=model.config)
            with recording_last_queries() as queries:
                started = time.perf_counter()
                decoder.forward(head, dense)
                prefill_seconds.append(time.perf_counter() - started)
            return dense, queries

        def store_run(q: int, spec: str, budget: int, seeded: float, run: dict, memory: dict, stats: dict) -> None:
            scores = [score(a, doc.questions[q].expected) for a in run["answers"]]
            store_runs[q].append(dict(budget=spec, budget_tokens=budget, store_prefill_seconds=seeded, scores=scores,
                                      memory=memory, stats=stats, **run))
            tick("store", scores)

        def oracle_run(q: int, dense, spec: str, budget: int) -> None:
            store_runs[q].append(_oracle_run(lambda cache: decoder.ask(cache, tails[q], max_new), dense,
                                             [doc.questions[q]], config, spec, budget, length, oracle_layers))
            tick("store", store_runs[q][-1]["scores"])

        def full_run(q: int, cache) -> None:
            full_runs[q] = decoder.ask(cache, tails[q], max_new)
            full_runs[q]["scores"] = [score(a, doc.questions[q].expected) for a in full_runs[q]["answers"]]
            tick("full", full_runs[q]["scores"])

        with torch.no_grad():
            if config.share_prefill:
                dense, queries = prefill()
                for spec, budget in budgets:
                    if config.selection == "oracle":
                        for q in range(count):
                            oracle_run(q, dense, spec, budget)
                        continue
                    cache = new_cache(budget, capacity, max_batch=2)
                    started = time.perf_counter()
                    seed_store_cache(cache, dense, queries, modules, length)
                    seeded = time.perf_counter() - started
                    seed_memory, seed_stats = cache.store.memory_report(), cache.store.stats()
                    for q in range(count):
                        fork = copy.deepcopy(cache)   # KVStore.fork of the document's sequence
                        forked_memory, forked_stats = cache.store.memory_report(), cache.store.stats()
                        run = decoder.ask(fork, tails[q], max_new)
                        memory = _alone(seed_memory, forked_memory, cache.store.memory_report())
                        stats = _alone(seed_stats, forked_stats, cache.store.stats())
                        fork.release()
                        del fork
                        store_run(q, spec, budget, seeded, run, memory, stats)
                    cache.release()
                    del cache
                for q in range(count):
                    copied = copy.deepcopy(dense)
                    full_run(q, copied)
                    del copied
                del dense
            else:
                for q in range(count):
                    dense, queries = prefill()
                    for spec, budget in budgets:
                        if config.selection == "oracle":
                            oracle_run(q, dense, spec, budget)
                            continue
                        cache = new_cache(budget, capacity)
                        started = time.perf_counter()
                        seed_store_cache(cache, dense, queries, modules, length)
                        seeded = time.perf_counter() - started
                        run = decoder.ask(cache, tails[q], max_new)
                        memory, stats = cache.store.memory_report(), cache.store.stats()
                        cache.release()
                        del cache
                        store_run(q, spec, budget, seeded, run, memory, stats)
                    full_run(q, dense)
                    del dense
        shared = config.share_prefill
        return [dict(
            task=doc.task, length=doc.length, prompt_tokens=length + len(tails[q]), depth=doc.depths[q],
            index=doc.index, document=unit_id(doc), question=q, questions_per_document=count,
            document_tokens=length, prefill_shared=shared, needles=doc.needles[q],
            questions=[doc.questions[q].question], expected=[doc.questions[q].expected],
            prefill_seconds=prefill_seconds[0 if shared else q], full=full_runs[q], store=store_runs[q])
            for q in range(count)]

    for unit in todo:
        if unit is not todo[0] and config.time_limit and time.perf_counter() - started_run > config.time_limit:
            break
        results["records"] += run_document(unit) if isinstance(unit, Document) else run_sample(unit)
        results["elapsed_seconds"] = previous_seconds + time.perf_counter() - started_run
        if out_dir is not None:
            write_json(results, out_dir)
    bar.close()
    done = {_record_unit(rec) for rec in results["records"]}
    results["complete"] = all(unit_id(unit) in done for unit in samples)
    results["elapsed_seconds"] = previous_seconds + time.perf_counter() - started_run
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
    p.add_argument("--questions-per-document", type=int, default=1, metavar="Q",
                   help="Q > 1: niah, multikey, multivalue, multiquery and qa documents carry the needles of Q "
                        "questions (at depths i/(Q-1), not --depths), prefilled once; each question is asked on a "
                        "copy (full attention: of the DynamicCache; the store: a fork). --samples documents per "
                        "(task, length); vt, fwe and multiturn stay one question per sample")
    p.add_argument("--reprefill-documents", action="store_true",
                   help="with --questions-per-document: prefill the document again for every question instead of "
                        "copying it (the check that sharing changes no answer; Q times the prefill cost)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose results.json is in --out (same model and settings; --samples may "
                        "grow): its samples and documents are kept, the rest run")
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
            max_new_tokens=args.max_new_tokens, time_limit=args.time_limit, extend_block=args.extend_block,
            questions_per_document=args.questions_per_document, share_prefill=not args.reprefill_documents)
    except ValueError as exc:  # an unknown task, a misspelt budget or rank: one line, not a traceback
        parser.error(str(exc))
    name = args.model
    if model is None:
        from .models import load_model
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    else:
        name = getattr(model.config, "model_type", "model")
    try:
        results = evaluate(model, tokenizer, config, model_name=name, out_dir=args.out, resume=args.resume)
    except ResumeMismatch as exc:
        parser.error(str(exc))
    results["command"] = ("python -m shadowkv_core.evaluation.accuracy "
                          + " ".join(sys.argv[1:] if argv is None else argv))
    paths = write_outputs(results, args.out, plots=not args.no_plots)
    print(tables(results))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
