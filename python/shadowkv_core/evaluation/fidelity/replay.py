"""The store replay: a capture fed through a fresh CPU `KVStore` for every (rank, budget), each decode output compared
with exact attention over the same captured tokens (the fidelity tool's second half).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from ..._store import KVStore
from ..rope import unrope
from .capture import Capture
from .metrics import DEFAULT_FRACTIONS, capture_checks, energy_ranks, full_attention, mass_of_head, rank_only_error

__all__ = ["DEFAULT_BUDGETS", "evaluate", "parse_budgets"]

DEFAULT_BUDGETS = "64,128,256,512,1024,full"


def parse_budgets(text: str) -> List[Any]:
    out: List[Any] = []
    for part in str(text).split(","):
        part = part.strip()
        if part:
            out.append("full" if part == "full" else int(part))
    return out


class _OneThread:
    """torch on one thread for the evaluation: its small float64 LAPACK calls (eigh of a 256x256 Gram matrix) take
    seconds instead of milliseconds with 2 OpenMP threads on a shared 2-core machine."""

    def __enter__(self):
        self.previous = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.previous)


def _evaluate(capture: Capture, budgets: Sequence[Any] = (64, 128, 256, 512, 1024, "full"),
             ranks: Sequence[Any] = ("full",), chunk_size: int = 8, outlier_chunks: int = 48, local_chunks: int = 4,
             generation_window: int = 256, dtype: str = "float32", factorization: str = "gram", warm: bool = True,
             layers: Optional[Sequence[int]] = None, fractions: Sequence[float] = DEFAULT_FRACTIONS,
             mass: bool = True, verbose: bool = False, value_dtype: Optional[str] = None,
             sink_chunks: int = 1, factor_dtype: Optional[str] = None, group_score: str = "mean",
             chunk_score: str = "landmark", extend_block: Optional[int] = None) -> dict:
    """`evaluate` without the thread setting. value_dtype: the store's value format (None: `dtype`; "float8_e4m3").
    factor_dtype: the low-rank factors' element type (None: the store's default for `dtype`; "float32", "bfloat16").
    group_score: how a chunk's score combines a group's query heads ("mean", the store's default, or "max").
    chunk_score: what a chunk's score is computed from ("landmark", the default, or "two_centroids").
    extend_block: None feeds the captured tokens one `decode` call each; a number feeds all of them to one `extend`
    call per layer with that `extend_block` (one selection per block of that many tokens; docs/semantics.md,
    "Extend"): the error of a chat turn or a verified draft instead of token-by-token generation. The mass columns
    and the per-step hit rate need a selection per token and are left out then."""
    if extend_block is not None:
        mass = False
    m = capture.meta
    hq, hkv, d = m["num_q_heads"], m["num_kv_heads"], m["head_dim"]
    g = hq // hkv
    scale = float(m["softmax_scale"])
    inv_freq = torch.tensor(m["inv_freq"], dtype=torch.float32)
    layers = sorted(capture.layers) if layers is None else [int(l) for l in layers]
    S, T = capture.prompt_len, capture.steps
    full_rank = hkv * d
    rank_values = [full_rank if r == "full" else int(r) for r in ranks]
    total_max = S + T
    full_budget = -(-total_max // chunk_size) * chunk_size

    # Reference outputs and probabilities (float64), once per layer and step.
    refs: Dict[int, List[torch.Tensor]] = {}
    probs: Dict[int, List[torch.Tensor]] = {}
    for layer in layers:
        lc = capture.layers[layer]
        keys_all = torch.cat((lc.keys, lc.k_new), 0).double()
        values_all = torch.cat((lc.values, lc.v_new), 0).double()
        refs[layer], probs[layer] = [], []
        for t in range(T):
            o, p = full_attention(lc.q[t], keys_all[: S + t + 1], values_all[: S + t + 1], scale, return_probs=True)
            refs[layer].append(o)
            probs[layer].append(p if mass else None)

    # The store's outlier chunks per layer and KV head (they depend on the prompt keys only, not on rank or budget).
    probe = KVStore(num_layers=len(layers), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_batch=1,
                    max_seq_len=S + T, inv_freq=inv_freq, rotary_dim=m["rotary_dim"], rope_style="half",
                    attention_scaling=m["attention_scaling"], softmax_scale=scale, rank=full_rank,
                    chunk_size=chunk_size, budget=chunk_size, outlier_chunks=outlier_chunks, sink_chunks=sink_chunks,
                    local_chunks=local_chunks, generation_window=generation_window, factorization=factorization,
                    dtype=dtype, device="cpu")
    probe_slot = probe.add_sequences(1)[0]
    outliers = {}
    for i, layer in enumerate(layers):
        lc = capture.layers[layer]
        probe.prefill(i, [probe_slot], lc.keys[None], lc.values[None], keys_post_rope=True)
        outliers[layer] = probe.outlier_chunks(i, probe_slot)
    del probe

    energy = {}
    for layer in layers:
        lc = capture.layers[layer]
        pre = lc.keys_pre if lc.keys_pre is not None else unrope(lc.keys, torch.arange(S), inv_freq,
                                                                   m["attention_scaling"])
        energy[str(layer)] = energy_ranks(pre, fractions, rank_values)
        energy[str(layer)]["source"] = "model" if lc.keys_pre is not None else "unrope"
        # The store factorises the un-rotated post-RoPE keys it is given; so does the rank-only reference.
        pre_store = unrope(lc.keys, torch.arange(S), inv_freq, m["attention_scaling"])
        energy[str(layer)]["output_err_at_rank"] = {
            str(r): rank_only_error(lc, pre_store, r, inv_freq, m, chunk_size, local_chunks, refs[layer])
            for r in rank_values}
        energy[str(layer)]["output_err_at_rank_outliers_exact"] = {
            str(r): rank_only_error(lc, pre_store, r, inv_freq, m, chunk_size, local_chunks, refs[layer],
                                     outliers[layer])
            for r in rank_values}
        energy[str(layer)]["outlier_chunks"] = outliers[layer]

    runs = []
    for rank in rank_values:
        for budget in budgets:
            b = full_budget if budget == "full" else int(budget)
            t0 = time.perf_counter()
            store = KVStore(num_layers=len(layers), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_batch=1,
                            max_seq_len=S + T, inv_freq=inv_freq, rotary_dim=m["rotary_dim"], rope_style="half",
                            attention_scaling=m["attention_scaling"], softmax_scale=scale, rank=rank,
                            chunk_size=chunk_size, budget=b, outlier_chunks=outlier_chunks, sink_chunks=sink_chunks,
                            local_chunks=local_chunks, generation_window=generation_window,
                            factorization=factorization, dtype=dtype, device="cpu", value_dtype=value_dtype,
                            factor_dtype=factor_dtype, group_score=group_score, chunk_score=chunk_score,
                            extend_block=extend_block or 32)
            slot = store.add_sequences(1)[0]
            positions = torch.arange(S, dtype=torch.int64)[None]
            for i, layer in enumerate(layers):
                lc = capture.layers[layer]
                store.prefill(i, [slot], lc.keys[None], lc.values[None], positions=positions,
                              q_last=lc.q_last[None] if warm else None, keys_post_rope=True)
            prev_sel = {i: store.selected_chunks(i, slot) if warm else [[] for _ in range(hkv)]
                        for i in range(len(layers))}
            store.reset_stats()
            per_layer = {layer: dict(err=[], hits=0, selected=0, mass=[], oracle=[], attended=[]) for layer in layers}
            if extend_block is not None:
                positions_new = torch.arange(S, S + T, dtype=torch.int64)[None]
                for i, layer in enumerate(layers):
                    lc = capture.layers[layer]
                    out = store.extend(i, [slot], lc.q[None], lc.k_new[None], lc.v_new[None], positions=positions_new)
                    for t in range(T):
                        ref = refs[layer][t]
                        per_layer[layer]["err"].append(float((out[0, t].double() - ref).norm() / ref.norm()))
            for t in range(T if extend_block is None else 0):
                pos = torch.tensor([S + t], dtype=torch.int64)
                for i, layer in enumerate(layers):
                    lc = capture.layers[layer]
                    out = store.decode(i, [slot], lc.q[t][None], lc.k_new[t][None], lc.v_new[t][None],
                                       positions=pos)
                    ref = refs[layer][t]
                    acc = per_layer[layer]
                    acc["err"].append(float((out[0].double() - ref).norm() / ref.norm()))
                    sel = store.selected_chunks(i, slot)
                    for h in range(hkv):
                        acc["hits"] += len(set(sel[h]) & set(prev_sel[i][h]))
                        acc["selected"] += len(sel[h])
                    prev_sel[i] = sel
                    info = store.sequence_info(i, slot)
                    outl = store.outlier_chunks(i, slot)
                    # Tokens attended per KV head: outliers, local window, selected chunks, exact generated tokens.
                    acc["attended"].append(float(np.mean([
                        (len(outl[h]) + len(sel[h])) * chunk_size + int(info["local_len"]) +
                        int(info["generated_exact_len"]) for h in range(hkv)])))
                    if mass:
                        cov, orc = [], []
                        for h in range(hkv):
                            c, o = mass_of_head(probs[layer][t][h * g:(h + 1) * g], sel[h], outl[h], info, S,
                                                 chunk_size)
                            cov.append(c)
                            orc.append(o)
                        acc["mass"].append(float(torch.cat(cov).mean()))
                        acc["oracle"].append(float(torch.cat(orc).mean()))
            elapsed = time.perf_counter() - t0
            stats = store.stats()
            run = dict(rank=rank, budget=budget if budget == "full" else b, budget_tokens=b, seconds=elapsed,
                       store_stats=stats, memory=store.memory_report(), layers={})
            errs, hits, sels, masses, oracles = [], 0, 0, [], []
            for layer in layers:
                acc = per_layer[layer]
                entry = dict(rel_err_mean=float(np.mean(acc["err"])) if acc["err"] else 0.0,
                             rel_err_max=float(np.max(acc["err"])) if acc["err"] else 0.0,
                             hit_rate=acc["hits"] / acc["selected"] if acc["selected"] else 0.0,
                             attended_tokens=float(np.mean(acc["attended"])) if acc["attended"] else 0.0)
                if mass and acc["mass"]:
                    entry["mass_covered"] = float(np.mean(acc["mass"]))
                    entry["mass_oracle"] = float(np.mean(acc["oracle"]))
                    masses += acc["mass"]
                    oracles += acc["oracle"]
                run["layers"][str(layer)] = entry
                errs += acc["err"]
                hits += acc["hits"]
                sels += acc["selected"]
            run["overall"] = dict(rel_err_mean=float(np.mean(errs)) if errs else 0.0,
                                  rel_err_max=float(np.max(errs)) if errs else 0.0,
                                  hit_rate=hits / sels if sels else 0.0,
                                  store_hit_rate=float(stats["hit_rate"]),
                                  attended_tokens=float(np.mean([run["layers"][str(l)]["attended_tokens"]
                                                                 for l in layers])))
            if masses:
                run["overall"]["mass_covered"] = float(np.mean(masses))
                run["overall"]["mass_oracle"] = float(np.mean(oracles))
            runs.append(run)
            if verbose:
                o = run["overall"]
                print(f"  rank {rank:4d} budget {str(run['budget']):>5}: rel err {o['rel_err_mean']:.4f} "
                      f"hit rate {o['hit_rate']:.3f} ({elapsed:.1f}s)", file=sys.stderr, flush=True)
    config = dict(chunk_size=chunk_size, outlier_chunks=outlier_chunks, local_chunks=local_chunks,
                  generation_window=generation_window, dtype=dtype, value_dtype=value_dtype or dtype,
                  sink_chunks=sink_chunks, factor_dtype=factor_dtype or "auto", group_score=group_score,
                  chunk_score=chunk_score, extend_block=extend_block,
                  factorization=factorization, warm=warm,
                  budgets=[str(b) for b in budgets], ranks=rank_values, layers=layers, prompt_len=S, steps=T,
                  full_budget_tokens=full_budget, full_rank=full_rank)
    return dict(config=config, energy=energy, runs=runs, checks=capture_checks(capture))


def evaluate(capture: Capture, *args, **kwargs) -> dict:
    """Feeds the capture through a CPU KVStore for every (rank, budget) and compares with full attention.

    budgets: tokens per KV head per step (multiples of chunk_size) or "full" (covers every token). ranks: ints or
    "full" (num_kv_heads * head_dim). Returns a JSON-ready dict: "config", "energy" (per layer: ranks for energy
    shares, key and output error at each rank), "runs" (one per (rank, budget) with per-layer "rel_err_mean",
    "rel_err_max", "hit_rate", "mass_covered", "mass_oracle", and "overall"), "checks" (`capture_checks`)."""
    with _OneThread():
        return _evaluate(capture, *args, **kwargs)

