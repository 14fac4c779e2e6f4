"""`python -m shadowkv_core.evaluation.fidelity`: capture a packaged model (or load a capture), replay it through the
store, print the tables, write the JSON (docs/fidelity.md)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..haystack import LICENSES_DIR, PROMPT_SUFFIX, haystack_ids
from .. import models
from ..models import available_models
from .capture import capture_model, load_capture, save_capture
from .replay import DEFAULT_BUDGETS, evaluate, parse_budgets
from .report import format_tables

__all__ = ["main"]


def _parse_layers(text: Optional[str]) -> Optional[List[int]]:
    if text is None or text == "all":
        return None
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shadowkv_core.evaluation.fidelity",
        description="Relative error of the store's decode output vs full attention, temporal hit rate and key "
                    "energy rank, on Q/K/V captured from a real model (or a saved capture).")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=available_models(),
                     help="capture a packaged model (shadowkv_core.evaluation.models)")
    src.add_argument("--capture", help="a capture saved by --save-capture (e.g. tests/fixtures/*.npz)")
    src.add_argument("--report", help="only print the tables of a result JSON written by --json")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default 4096)")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps captured (default 32)")
    parser.add_argument("--layers", default="all", help="full-attention layers to capture, e.g. 0,7,15 (default all)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"tokens per KV head (default {DEFAULT_BUDGETS})")
    parser.add_argument("--ranks", default="full,160,96,48", help="key ranks, ints or 'full' (default full,160,96,48;"
                        " ranks above num_kv_heads*head_dim are dropped)")
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--outlier-chunks", type=int, default=48)
    parser.add_argument("--local-chunks", type=int, default=4)
    parser.add_argument("--generation-window", type=int, default=256)
    parser.add_argument("--dtype", default="float32", help="store dtype (default float32: the algorithm's error)")
    parser.add_argument("--factorization", default="gram", choices=["gram", "svd"])
    parser.add_argument("--sink-chunks", type=int, default=1, help="outlier chunks that are the prompt's first chunks")
    parser.add_argument("--value-dtype", default=None, help="value store format (default: --dtype; or float8_e4m3)")
    parser.add_argument("--factor-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="element type of the low-rank factors (default auto: bfloat16 for 16-bit --dtype)")
    parser.add_argument("--group-score", default="mean", choices=["max", "mean"],
                        help="how a chunk's score combines a group's query heads (default mean)")
    parser.add_argument("--chunk-score", default="landmark", choices=["landmark", "two_centroids"],
                        help="what a chunk's score is computed from (default landmark)")
    parser.add_argument("--extend-block", type=int, default=None,
                        help="feed the captured tokens to one extend call per layer with this extend_block (default: "
                             "one decode call per token)")
    parser.add_argument("--no-warm", action="store_true", help="do not warm the selection with the last prompt query")
    parser.add_argument("--no-mass", action="store_true", help="skip the attention-mass columns")
    parser.add_argument("--json", help="write the result JSON here")
    parser.add_argument("--save-capture", help="also save the capture (fp16 .npz) here")
    parser.add_argument("--save-layers", help="layers to save with --save-capture (default all captured)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.report:
        print(format_tables(json.loads(Path(args.report).read_text())))
        return 0
    started = time.perf_counter()
    times: Dict[str, float] = {}
    model_info: Dict[str, Any] = {}
    if args.model:
        t0 = time.perf_counter()
        model, tokenizer = models.load_model(args.model)
        times["load_s"] = time.perf_counter() - t0
        ids = haystack_ids(tokenizer, args.tokens)
        print(f"capturing {args.model}: {ids.shape[1]} prompt tokens + {args.steps} decode steps", file=sys.stderr,
              flush=True)
        t0 = time.perf_counter()
        capture = capture_model(model, ids, _parse_layers(args.layers), args.steps, verbose=True)
        times["capture_s"] = time.perf_counter() - t0
        capture.meta.update(model=args.model, prompt=f"haystack text ({LICENSES_DIR}) + suffix",
                            prompt_suffix=PROMPT_SUFFIX)
        times.update(capture.meta.get("capture_times", {}))
        model_info = dict(name=args.model, continuation=tokenizer.decode(capture.meta["generated_ids"]),
                          model_type=capture.meta.get("model_type"))
        if args.save_capture:
            size = save_capture(capture, args.save_capture, layers=_parse_layers(args.save_layers))
            print(f"saved capture {args.save_capture} ({size / 1e6:.2f} MB)", file=sys.stderr)
        del model
    else:
        capture = load_capture(args.capture)
        layers = _parse_layers(args.layers)
        if layers is not None:
            capture.layers = {l: capture.layers[l] for l in layers}
        model_info = dict(name=capture.meta.get("model", Path(args.capture).name), capture=args.capture)
    full_rank = capture.meta["num_kv_heads"] * capture.meta["head_dim"]
    ranks: List[Any] = []
    for part in args.ranks.split(","):
        part = part.strip()
        value = full_rank if part == "full" else int(part)
        if value <= full_rank and value not in ranks:
            ranks.append(value)
    t0 = time.perf_counter()
    result = evaluate(capture, budgets=parse_budgets(args.budgets), ranks=ranks, chunk_size=args.chunk_size,
                      outlier_chunks=args.outlier_chunks, local_chunks=args.local_chunks,
                      generation_window=args.generation_window, dtype=args.dtype, factorization=args.factorization,
                      value_dtype=args.value_dtype, sink_chunks=args.sink_chunks, factor_dtype=args.factor_dtype,
                      group_score=args.group_score, chunk_score=args.chunk_score, extend_block=args.extend_block,
                      warm=not args.no_warm,
                      mass=not args.no_mass, verbose=True)
    times["evaluate_s"] = time.perf_counter() - t0
    times["total_s"] = time.perf_counter() - started
    result["model"] = model_info
    result["times"] = times
    result["command"] = "python -m shadowkv_core.evaluation.fidelity " + " ".join(sys.argv[1:] if argv is None else argv)
    result["environment"] = dict(torch=torch.__version__, python=platform.python_version(),
                                 threads=torch.get_num_threads(), machine=platform.machine(),
                                 date=time.strftime("%Y-%m-%d"))
    try:
        import transformers
        result["environment"]["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    result["capture_meta"] = {k: v for k, v in capture.meta.items() if k not in ("inv_freq",)}
    print(format_tables(result))
    print(f"\ntimes: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0

