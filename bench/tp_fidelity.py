"""What per-shard factorisation costs in accuracy, on real Q/K/V (the fidelity captures of tests/fixtures).

Under tensor parallelism each rank's KVStore factorises only ITS KV heads' pre-RoPE keys ([S, Hkv/tp*D]) instead of
all heads together ([S, Hkv*D]). Landmarks, outliers and the top-k selection are per KV head and use exact keys, so
they do not change; only the rebuilt keys do. This script feeds a capture's prompt and decode steps through

* joint:          one store over all heads at rank r (what TP=1 does);
* shard r/tp:     tp stores, one per group of Hkv/tp KV heads (with their Hq/tp query heads), rank r/tp each:
                  the same A memory in total (S*r floats), B is tp times smaller;
* shard r:        tp stores at rank r each (tp times the A memory);

and compares each decode output, all query heads concatenated, with float64 full attention over the same tokens
(relative Frobenius error, mean over steps and layers), at a fixed budget and at a budget covering every token (the
rank's error alone). It also gives the relative error of the pre-RoPE keys themselves (best rank-r approximation:
jointly, or per shard). The store runs exactly as `shadowkv_core.evaluation.fidelity.evaluate` runs it (float32, post-RoPE keys
in, warm selection); the joint rows are checked against `evaluate` itself.

A model whose Hkv is not divisible by tp cannot be sharded by KV heads (the TP decoder refuses it): for such a model
(Gemma-3-270M has ONE KV head) the script measures instead what KV-head replication would do (every rank holds the
KV head and its full factorisation, and only Hq/tp query heads: the factors are identical, the selection of a rank
is driven by its own query heads only). That layout is NOT implemented in examples/tp_llama_decoder.py.

    PYTHONPATH=python python bench/tp_fidelity.py --json bench/results/tp_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Dict, List, Sequence

import numpy as np
import torch

from shadowkv_core import KVStore
from shadowkv_core.evaluation import fidelity as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CAPTURES = ",".join(os.path.join(ROOT, "tests", "fixtures", f) for f in
                            ("fidelity_smollm2_1k.npz", "fidelity_gemma3_1k.npz"))


def shards_by_kv_heads(hq: int, hkv: int, tp: int, rank: int) -> List[dict]:
    """tp groups of Hkv/tp consecutive KV heads with their query heads (query head j reads KV head j // G)."""
    g, per = hq // hkv, hkv // tp
    return [dict(kv=list(range(i * per, (i + 1) * per)), q=list(range(i * per * g, (i + 1) * per * g)), rank=rank)
            for i in range(tp)]


def shards_replicated(hq: int, hkv: int, tp: int, rank: int) -> List[dict]:
    """tp groups of Hq/tp query heads; each holds the KV heads its query heads read (all of them when Hkv=1)."""
    g, per = hq // hkv, hq // tp
    if hq % tp or (per % g and g % per):
        raise ValueError(f"{hq} query heads in {tp} groups do not fall on whole KV heads (group size {g})")
    return [dict(kv=sorted({j // g for j in range(i * per, (i + 1) * per)}), q=list(range(i * per, (i + 1) * per)),
                 rank=rank) for i in range(tp)]


def run_shards(capture: F.Capture, layers: Sequence[int], shards: List[dict], budget: int, refs, kw: dict) -> dict:
    """Each shard through its own store; the decode outputs of all shards assembled per step and compared with the
    float64 reference. Returns per-layer mean relative error and the stores' factor bytes."""
    m = capture.meta
    d, S, T = m["head_dim"], capture.prompt_len, capture.steps
    inv_freq = torch.tensor(m["inv_freq"], dtype=torch.float32)
    outs = {layer: torch.zeros(T, m["num_q_heads"], d, dtype=torch.float64) for layer in layers}
    factor_bytes = 0
    for sh in shards:
        kv, q = torch.tensor(sh["kv"]), torch.tensor(sh["q"])
        store = KVStore(num_layers=len(layers), num_q_heads=len(sh["q"]), num_kv_heads=len(sh["kv"]), head_dim=d,
                        max_batch=1, max_seq_len=S + T, inv_freq=inv_freq, rotary_dim=m["rotary_dim"],
                        rope_style="half", attention_scaling=m["attention_scaling"],
                        softmax_scale=float(m["softmax_scale"]), rank=sh["rank"], budget=budget, **kw)
        slot = store.add_sequences(1)[0]
        positions = torch.arange(S, dtype=torch.int64)[None]
        for i, layer in enumerate(layers):
            lc = capture.layers[layer]
            store.prefill(i, [slot], lc.keys[:, kv][None], lc.values[:, kv][None], positions=positions,
                          q_last=lc.q_last[q][None], keys_post_rope=True)
        for t in range(T):
            pos = torch.tensor([S + t], dtype=torch.int64)
            for i, layer in enumerate(layers):
                lc = capture.layers[layer]
                o = store.decode(i, [slot], lc.q[t][q][None], lc.k_new[t][kv][None], lc.v_new[t][kv][None],
                                 positions=pos)
                outs[layer][t, q] = o[0].double()
        factor_bytes += store.memory_report()["low_rank_factors"]
    errs = {str(layer): float(np.mean([float((outs[layer][t] - refs[layer][t]).norm() / refs[layer][t].norm())
                                       for t in range(T)])) for layer in layers}
    return dict(rel_err=errs, rel_err_mean=float(np.mean(list(errs.values()))), factor_bytes=factor_bytes)


def key_error(keys_pre: torch.Tensor, shards: List[dict]) -> float:
    """Relative Frobenius error of the best rank-r approximation of each shard's pre-RoPE keys [S, |kv|*D], over
    all heads (shards holding the same KV heads, i.e. replication, count them once)."""
    seen, tail, total = set(), 0.0, float(keys_pre.double().square().sum())
    for sh in shards:
        key = tuple(sh["kv"])
        if key in seen:
            continue
        seen.add(key)
        k = keys_pre[:, sh["kv"]].double().reshape(keys_pre.shape[0], -1)
        energy = torch.linalg.svdvals(k).square()
        tail += float(energy[sh["rank"]:].sum())
    return math.sqrt(max(0.0, tail / total))


def measure(path: str, ranks_frac: Sequence[float], budget: int, tp: int, kw: dict, check: bool, log) -> dict:
    capture = F.load_capture(path)
    m = capture.meta
    hq, hkv, d = m["num_q_heads"], m["num_kv_heads"], m["head_dim"]
    layers = sorted(capture.layers)
    S, T, C = capture.prompt_len, capture.steps, kw["chunk_size"]
    full_rank = hkv * d
    full_budget = -(-(S + T) // C) * C
    inv_freq = torch.tensor(m["inv_freq"], dtype=torch.float32)
    refs = {}
    for layer in layers:
        lc = capture.layers[layer]
        keys = torch.cat((lc.keys, lc.k_new), 0)
        values = torch.cat((lc.values, lc.v_new), 0)
        refs[layer] = [F.full_attention(lc.q[t], keys[: S + t + 1], values[: S + t + 1], float(m["softmax_scale"]))
                       for t in range(T)]
    pre = {layer: F.unrope(capture.layers[layer].keys, torch.arange(S), inv_freq, m["attention_scaling"])
           for layer in layers}
    divisible = [x for x in range(2, hkv + 1) if hkv % x == 0]
    if tp in divisible:
        layout, shard_tp, make = "kv_heads", tp, shards_by_kv_heads
    elif divisible:
        layout, shard_tp, make = "kv_heads", divisible[0], shards_by_kv_heads
    else:
        layout, shard_tp, make = "replicated", tp, shards_replicated
    name = m.get("model", os.path.basename(path))
    log(f"{name}: Hq {hq}, Hkv {hkv}, D {d}, layers {layers}, prompt {S}, steps {T}; tp {tp} "
        + (f"divides Hkv: sharding by KV heads" if shard_tp == tp and layout == "kv_heads" else
           f"does not divide Hkv={hkv}: " + (f"tp={shard_tp} (divides Hkv) by KV heads" if layout == "kv_heads" else
                                             f"KV head replicated over tp={tp} (query heads split)")))
    rows = []
    ranks = sorted({max(shard_tp, int(round(full_rank * f / shard_tp)) * shard_tp) for f in ranks_frac})
    for r in ranks:
        variants = [("joint", f"1 store, rank {r}", [dict(kv=list(range(hkv)), q=list(range(hq)), rank=r)])]
        if layout == "kv_heads":
            variants.append(("shard_r_over_tp", f"{shard_tp} stores, rank {r // shard_tp} each",
                             make(hq, hkv, shard_tp, r // shard_tp)))
            capped = min(r, full_rank // shard_tp)
            if capped != r // shard_tp:
                    variants.append(("shard_r", f"{shard_tp} stores, rank {capped} each" +
                                 (" (full)" if capped == full_rank // shard_tp else ""),
                                 make(hq, hkv, shard_tp, capped)))
        else:
            variants.append(("replicated_r", f"{shard_tp} stores (KV replicated), rank {r} each",
                             make(hq, hkv, shard_tp, r)))
        row = dict(rank=r, variants={})
        for key, label, shards in variants:
            t0 = time.perf_counter()
            entry = dict(label=label, shards=len(shards),
                         key_err=float(np.mean([key_error(pre[l], shards) for l in layers])),
                         key_err_per_layer={str(l): key_error(pre[l], shards) for l in layers})
            for b, tag in ((budget, "budget"), (full_budget, "full")):
                entry[tag] = run_shards(capture, layers, shards, b, refs, kw)
            row["variants"][key] = entry
            log(f"  rank {r:4d} {label:38s} key err {entry['key_err']:.4f}  out err @{budget} "
                f"{entry['budget']['rel_err_mean']:.4f}  @full {entry['full']['rel_err_mean']:.4f}  "
                f"({time.perf_counter() - t0:.1f}s)")
        rows.append(row)
    result = dict(capture=os.path.relpath(path, ROOT), model=name, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                  layers=layers, prompt_len=S, steps=T, tp_requested=tp, tp_used=shard_tp, layout=layout,
                  budget=budget, full_budget=full_budget, rows=rows)
    if check:  # the joint rows must be what shadowkv_core.evaluation.fidelity.evaluate reports for the same settings
        r = ranks[0]
        ev = F.evaluate(capture, budgets=[budget], ranks=[r], mass=False,
                        **{k: v for k, v in kw.items() if k != "device"})
        mine = rows[0]["variants"]["joint"]["budget"]["rel_err_mean"]
        theirs = ev["runs"][0]["overall"]["rel_err_mean"]
        result["check_vs_fidelity_evaluate"] = dict(rank=r, budget=budget, this=mine, evaluate=theirs)
        log(f"  check: joint rank {r} budget {budget}: {mine:.6g} here, {theirs:.6g} from fidelity.evaluate")
        if abs(mine - theirs) > 1e-6 * max(1.0, abs(theirs)):
            raise SystemExit("the joint store does not reproduce fidelity.evaluate")
    return result


def table(results: List[dict]) -> str:
    lines = ["| model (layers) | layout | rank r | variant | key err | out err @budget | out err @full | "
             "factor MiB |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for res in results:
        layout = (f"tp={res['tp_used']} by KV heads" if res["layout"] == "kv_heads" else
                  f"tp={res['tp_used']}, KV replicated")
        for row in res["rows"]:
            for v in row["variants"].values():
                lines.append(f"| {res['model']} ({','.join(map(str, res['layers']))}) | {layout} | {row['rank']} | "
                             f"{v['label']} | {v['key_err']:.4f} | {v['budget']['rel_err_mean']:.4f} | "
                             f"{v['full']['rel_err_mean']:.4f} | {v['full']['factor_bytes'] / 2**20:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--captures", default=DEFAULT_CAPTURES, help="comma-separated capture .npz files")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ranks", default="0.25,0.5,0.75,1", help="ranks as fractions of Hkv*D (rounded to multiples of tp)")
    p.add_argument("--budget", type=int, default=128, help="tokens per KV head per step (plus a 'full' run)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outlier-chunks", type=int, default=4)
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--generation-window", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-check", action="store_true", help="skip the check against fidelity.evaluate")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small LAPACK calls: faster on one thread (see fidelity._OneThread)
    kw = dict(chunk_size=args.chunk_size, outlier_chunks=args.outlier_chunks, local_chunks=args.local_chunks,
              generation_window=args.generation_window, dtype=args.dtype, factorization="gram", device="cpu")
    fracs = [float(x) for x in args.ranks.split(",")]
    t0 = time.perf_counter()
    results = [measure(path, fracs, args.budget, args.tp, kw, not args.no_check,
                       lambda *a: print(*a, file=sys.stderr, flush=True))
               for path in args.captures.split(",") if path]
    print(table(results))
    out = dict(results=results, settings=dict(vars(args), store=kw), seconds=time.perf_counter() - t0,
               environment=dict(torch=torch.__version__, python=platform.python_version(),
                                machine=platform.machine(), date=time.strftime("%Y-%m-%d")),
               command="python bench/tp_fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
