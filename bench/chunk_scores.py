"""Chunk scores compared on real Q/K/V: how much of the exact attention mass each rule's selection covers.

The store selects, per KV head and decode step, the top-k context chunks by a *chunk score*; today that score is
the query times the chunk's landmark (mean of its post-RoPE keys), normalised by a softmax over the candidates per
query head and combined over the KV head's query group by the mean (group_score="mean", the default; "max" was the
default until then and is this script's base rule: docs/semantics.md, Decode 4). This script
replays captured decode steps (`shadowkv_core.evaluation.fidelity` captures: the test fixtures, or a live capture of a
packaged model) and, for each rule below, selects exactly as the store does with only the score changed, then
measures the share of full attention's probability mass on the attended tokens (outliers incl. sinks, local
window, selected chunks, exact generated tokens) against the best set of the same size, with
`shadowkv_core.evaluation.fidelity`'s own metric (`mass_of_head`: per query head, mean over heads, steps and layers).

Rules (per query head j, chunk c; `k_t` the chunk's exact post-RoPE keys, `L` their mean; every rule is a logit,
scaled by the softmax scale, softmaxed over the candidates, then combined over the group by max unless noted):

* landmark        q·L (the store; also checked against the store's own `selected_chunks` step by step)
* landmark-mean   q·L with the group combined by the mean of the softmaxes instead of the max
* quest           Σ_d max(q_d·min_t k_td, q_d·max_t k_td) (Quest's per-channel bound; 2 vectors a chunk)
* quest-fp8       quest with min and max stored as e4m3 with one float32 scale per (chunk, head): today's bytes
* radius          q·L + |q|·R, R = max_t |k_t − L| (a bound of max_t q·k_t; 1 scalar a chunk)
* radius-half     q·L + 0.5·|q|·R
* lse-iso         q·L + scale/2 · |q|² · V/D, V = mean_t |k_t − L|² (log of the mean exp of q·k_t for keys spread
                  isotropically around L; 1 scalar a chunk)
* lse-diag        q·L + scale/2 · Σ_d q_d² var_t(k_td) (the same with per-channel variances; 2 vectors a chunk)
* halves          max(q·L1, q·L2), L1/L2 the means of the chunk's two halves (2 vectors a chunk)
* halves-lse      log-mean-exp of the two half logits (the halves' mass estimate)
* centroids2-max  max over two centroids of the chunk's keys (2-means from its two farthest keys, 8 iterations)
* centroids2-lse  log of the count-weighted mean exp of the two centroid logits (the 2-cluster mass estimate;
                  2 vectors and a count a chunk)
* centroids2-lse-fp8  the same with the centroids stored as e4m3 with a float32 scale each: today's bytes + 3%
* lowrank-max     max_t q·k̂_t, k̂ the store's rank-r rebuilt keys rope(A·B) (every key rebuilt: upper reference)
* lowrank-lse     log-sum-exp_t q·k̂_t (the chunk's mass under the rank-r keys)
* latent-max      S4R's latent-space relevance (papers/002): the pre-RoPE query against the rank-r pre-RoPE keys
                  A·B (no rotation), max-pooled over the chunk (reads A, no rebuild)
* exact-lse       log-sum-exp_t q·k_t over the exact keys, group combined by the mean: the best possible chunk
                  ranking for this metric (its coverage must equal the "best" column; a check, not a candidate)

    PYTHONPATH=python python bench/chunk_scores.py --capture tests/fixtures/fidelity_gemma3_1k.npz \\
        --budgets 32,64,128 --json docs/results/chunk_scores_gemma3_1k.json
    PYTHONPATH=python python bench/chunk_scores.py --model smollm2 --tokens 4096 --steps 32 \\
        --save-capture /tmp/smollm2_4k.npz --json docs/results/chunk_scores_smollm2_4k.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from shadowkv_core import KVStore
from shadowkv_core.evaluation import fidelity as F
from shadowkv_core.evaluation import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def capture_live(model_name: str, tokens: int, steps: int, save: Optional[str]) -> F.Capture:
    """A fresh capture of every full-attention layer of a packaged model (float32), saved as float32 if asked."""
    model, tokenizer = models.load_model(model_name)
    ids = F.haystack_ids(tokenizer, tokens)
    capture = F.capture_model(model, ids, None, steps, verbose=True)
    capture.meta.update(model=model_name, prompt=f"haystack text ({F.LICENSES_DIR}) + suffix",
                        prompt_suffix=F.PROMPT_SUFFIX)
    if save:
        size = F.save_capture(capture, save, dtype="float32")
        print(f"saved capture {save} ({size / 1e6:.1f} MB)", file=sys.stderr, flush=True)
    return capture



# ---------------------------------------------------------------------------------------------------------------------
# per-layer chunk statistics (what each rule would store at prefill)
# ---------------------------------------------------------------------------------------------------------------------

F8_MAX = 448.0


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] rounded to OCP e4m3 with one scale per row (amax/448, as the fp8 value store does), as float64."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / F8_MAX, torch.ones_like(amax)).float().double()
    return (x / scale).float().to(torch.float8_e4m3fn).double() * scale


class LayerStats:
    """The chunk statistics of one captured layer, float64. Keys are the stored post-RoPE keys (float32, as the store
    keeps them with dtype float32); the landmark is their mean rounded to float32 (docs/semantics.md, Prefill 3).

    n context chunks of C tokens, Hkv heads, D dims: kp [n, C, Hkv, D]; landmark [n, Hkv, D]; the low-rank keys use
    the store's factorisation (leading eigenvectors of K_preᵀK_pre, A = K_pre·V_r, B = V_rᵀ, float32)."""

    def __init__(self, lc: F.LayerCapture, meta: dict, chunk_size: int, local_chunks: int, rank: int):
        S = lc.prompt_len
        C = chunk_size
        self.S, self.C = S, C
        self.n = n = max(0, S // C - local_chunks)
        self.hkv, self.d = lc.keys.shape[1], lc.keys.shape[2]
        self.inv_freq = torch.tensor(meta["inv_freq"], dtype=torch.float32)
        self.att_scaling = float(meta["attention_scaling"])
        keys = lc.keys.float().double()                                     # [S, Hkv, D] as stored (float32)
        self.keys = keys
        kp = keys[: n * C].reshape(n, C, self.hkv, self.d)
        self.kp = kp
        self.landmark = kp.mean(1).float().double()                         # [n, Hkv, D]
        dev = kp - self.landmark[:, None]
        self.radius = dev.norm(dim=-1).amax(1)                              # [n, Hkv]
        self.spread = dev.square().sum(-1).mean(1)                          # [n, Hkv] mean |k - L|^2
        self.var = dev.square().mean(1)                                     # [n, Hkv, D]
        self.kmin, self.kmax = kp.amin(1), kp.amax(1)                       # [n, Hkv, D]
        self.kmin8, self.kmax8 = fp8_round(self.kmin), fp8_round(self.kmax)
        self.landmark8 = fp8_round(self.landmark)
        h = C // 2
        self.half1, self.half2 = kp[:, :h].mean(1).float().double(), kp[:, h:].mean(1).float().double()
        # the store's factorisation of the un-rotated keys it is given (keys_post_rope=True)
        pos = torch.arange(S)
        k_pre = F.unrope(lc.keys.float(), pos, self.inv_freq, self.att_scaling).float().double()
        flat = k_pre.reshape(S, -1)
        r = min(rank, flat.shape[1])
        evals, evecs = torch.linalg.eigh(flat.T @ flat)
        v_r = evecs[:, torch.argsort(evals, descending=True, stable=True)[:r]]
        B = v_r.T.float().double()                                          # [r, Hkv*D]
        A = (flat[: n * C] @ B.T).float().double()                          # [n*C, r]
        self.rank = r
        self.k_pre_lowrank = (A @ B).reshape(n * C, self.hkv, self.d)       # [n*C, Hkv, D] pre-RoPE
        self.k_lowrank = F.rope(self.k_pre_lowrank, pos[: n * C], self.inv_freq, self.att_scaling)

    def unrope_query(self, q: torch.Tensor, position: int) -> torch.Tensor:
        return F.unrope(q[None].float(), torch.tensor([position]), self.inv_freq, self.att_scaling)[0]


def _group_view(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """q [Hq, D] -> [Hkv, G, D] (query head j = h*G + i reads KV head h)."""
    return q.reshape(hkv, q.shape[0] // hkv, q.shape[1])


def _lme(logits: torch.Tensor, scale: float, dim: int) -> torch.Tensor:
    """log-mean-exp in logit units: log(mean exp(scale*x)) / scale."""
    return (torch.logsumexp(scale * logits, dim=dim) - math.log(logits.shape[dim])) / scale


def _token_logits(q: torch.Tensor, keys: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """q [Hkv, G, D], keys [n*C, Hkv, D] -> [Hkv, G, n, C]."""
    return torch.einsum("hgd,nhd->hgn", q, keys).reshape(q.shape[0], q.shape[1], n, C)


# Rules: (layer stats, post-RoPE query [Hq, D] float64, position, scale) -> chunk logits [Hkv, G, n] (logit units:
# an estimate of a key's q·k in the chunk; log-mean-exp rules estimate log(mean_t exp(scale q·k_t)) / scale).
Rule = Callable[[LayerStats, torch.Tensor, int, float], torch.Tensor]


def rule_landmark(st, q, pos, scale):
    return torch.einsum("hgd,nhd->hgn", _group_view(q, st.hkv), st.landmark)


def rule_landmark_fp8(st, q, pos, scale):
    return torch.einsum("hgd,nhd->hgn", _group_view(q, st.hkv), st.landmark8)


def _quest(q, kmin, kmax):
    return (torch.einsum("hgd,nhd->hgn", q.clamp_min(0), kmax) + torch.einsum("hgd,nhd->hgn", q.clamp_max(0), kmin))


def rule_quest(st, q, pos, scale):
    return _quest(_group_view(q, st.hkv), st.kmin, st.kmax)


def rule_quest_fp8(st, q, pos, scale):
    return _quest(_group_view(q, st.hkv), st.kmin8, st.kmax8)


def _radius(c):
    def rule(st, q, pos, scale):
        qg = _group_view(q, st.hkv)
        return rule_landmark(st, q, pos, scale) + c * qg.norm(dim=-1)[..., None] * st.radius.T[:, None, :]
    return rule


def rule_lse_iso(st, q, pos, scale):
    qg = _group_view(q, st.hkv)
    corr = 0.5 * scale * qg.square().sum(-1)[..., None] * (st.spread.T / st.d)[:, None, :]
    return rule_landmark(st, q, pos, scale) + corr


def rule_lse_diag(st, q, pos, scale):
    qg = _group_view(q, st.hkv)
    return rule_landmark(st, q, pos, scale) + 0.5 * scale * torch.einsum("hgd,nhd->hgn", qg.square(), st.var)


def rule_halves(st, q, pos, scale):
    qg = _group_view(q, st.hkv)
    return torch.maximum(torch.einsum("hgd,nhd->hgn", qg, st.half1), torch.einsum("hgd,nhd->hgn", qg, st.half2))


def rule_halves_lse(st, q, pos, scale):
    qg = _group_view(q, st.hkv)
    both = torch.stack((torch.einsum("hgd,nhd->hgn", qg, st.half1), torch.einsum("hgd,nhd->hgn", qg, st.half2)), -1)
    return _lme(both, scale, -1)


def rule_lowrank_max(st, q, pos, scale):
    return _token_logits(_group_view(q, st.hkv), st.k_lowrank, st.n, st.C).amax(-1)


def rule_lowrank_lse(st, q, pos, scale):
    return _lme(_token_logits(_group_view(q, st.hkv), st.k_lowrank, st.n, st.C), scale, -1)


def rule_latent_max(st, q, pos, scale):
    q_pre = st.unrope_query(q, pos)
    return _token_logits(_group_view(q_pre, st.hkv), st.k_pre_lowrank, st.n, st.C).amax(-1)


def rule_exact_lse(st, q, pos, scale):
    return _lme(_token_logits(_group_view(q, st.hkv), st.kp.reshape(-1, st.hkv, st.d), st.n, st.C), scale, -1)


def _centroids2(kp: torch.Tensor, iters: int = 8):
    """Two centroids per (chunk, head) by 2-means over the chunk's keys, started from its two farthest keys, and
    the share of keys each holds. kp [n, C, Hkv, D] -> centroids [n, 2, Hkv, D], weights [n, 2, Hkv]."""
    x = kp.permute(0, 2, 1, 3)                                              # [n, Hkv, C, D]
    dist = torch.cdist(x, x)                                                # [n, Hkv, C, C]
    far = dist.flatten(-2).argmax(-1)
    i, j = far // x.shape[2], far % x.shape[2]
    cent = torch.stack((torch.gather(x, 2, i[..., None, None].expand(-1, -1, 1, x.shape[3])),
                        torch.gather(x, 2, j[..., None, None].expand(-1, -1, 1, x.shape[3]))), 2)[:, :, :, 0]
    for _ in range(iters):
        assign = torch.cdist(x, cent).argmin(-1)                            # [n, Hkv, C]
        onehot = torch.nn.functional.one_hot(assign, 2).double()            # [n, Hkv, C, 2]
        count = onehot.sum(2)                                               # [n, Hkv, 2]
        new = torch.einsum("nhck,nhcd->nhkd", onehot, x) / count.clamp_min(1)[..., None]
        cent = torch.where(count[..., None] > 0, new, cent)
    weight = count / x.shape[2]
    return cent.permute(0, 2, 1, 3).float().double(), weight.permute(0, 2, 1)


def _centroid_logits(st, q, fp8: bool):
    if not hasattr(st, "cent2"):
        st.cent2, st.cent2_w = _centroids2(st.kp)
        st.cent2_8 = fp8_round(st.cent2)
    return torch.einsum("hgd,nkhd->hgnk", _group_view(q, st.hkv), st.cent2_8 if fp8 else st.cent2)


def _centroids2_lse(fp8: bool):
    def rule(st, q, pos, scale):
        logits = _centroid_logits(st, q, fp8)
        w = st.cent2_w.permute(2, 0, 1)[:, None]                            # [Hkv, 1, n, 2]
        return torch.logsumexp(scale * logits + torch.log(w.clamp_min(1e-300)), -1) / scale
    return rule


def rule_centroids2_max(st, q, pos, scale):
    return _centroid_logits(st, q, False).amax(-1)


# name -> rule; a name may end in "@max" (the store's group combination, the default), "@mean" or "@mass"
RULES: Dict[str, Rule] = {
    "landmark": rule_landmark,
    "landmark-fp8": rule_landmark_fp8,
    "quest": rule_quest,
    "quest-fp8": rule_quest_fp8,
    "radius": _radius(1.0),
    "radius-half": _radius(0.5),
    "lse-iso": rule_lse_iso,
    "lse-diag": rule_lse_diag,
    "halves": rule_halves,
    "halves-lse": rule_halves_lse,
    "centroids2-max": rule_centroids2_max,
    "centroids2-lse": _centroids2_lse(False),
    "centroids2-lse-fp8": _centroids2_lse(True),
    "lowrank-max": rule_lowrank_max,
    "lowrank-lse": rule_lowrank_lse,
    "latent-max": rule_latent_max,
    "exact-lse": rule_exact_lse,
}
COMBINES = ("max", "mean", "mass")


def parse_rule(name: str):
    """'quest@mean' -> (rule_quest, 'mean'); the combination defaults to the store's max ('exact-lse': mass)."""
    base, _, combine = name.partition("@")
    if base not in RULES:
        raise ValueError(f"unknown rule {base!r} (known: {', '.join(RULES)})")
    combine = combine or ("mass" if base == "exact-lse" else "max")
    if combine not in COMBINES:
        raise ValueError(f"unknown group combination {combine!r} (known: {', '.join(COMBINES)})")
    return RULES[base], combine


DEFAULT_RULES = ",".join(list(RULES) + ["landmark@mean", "landmark@mass", "quest@mean", "lse-diag@mean",
                                          "halves-lse@mean", "centroids2-lse@mean", "centroids2-lse-fp8@mean",
                                          "quest-fp8@mean", "lowrank-lse@mean", "latent-max@mean"])


def rank_chunks(logits: torch.Tensor, candidates: List[torch.Tensor], scale: float, combine: str,
                exact_logits: Optional[List[torch.Tensor]] = None, chunk_size: int = 8) -> List[List[int]]:
    """Candidate chunk ids per KV head in the order the store would pick them (docs/semantics.md, Decode 4-5; the
    top-k selection is the first k) from `logits` [Hkv, G, n]: per query head a softmax over the head's candidates,
    combined over the group by `combine`:
    "max" (the store), "mean", or "mass": each chunk's estimated share of the head's whole attention, C·exp(scale·s)
    normalised together with the exact tokens the step attends anyway (`exact_logits` [Hkv] of [G, N_exact]: outliers,
    local window, generated), summed over the group. Ties: smaller chunk id first."""
    out = []
    for h, cand in enumerate(candidates):
        if cand.numel() == 0:
            out.append([])
            continue
        z = scale * logits[h][:, cand]                                                  # [G, Nc]
        if combine == "mass":
            est = z + math.log(chunk_size)
            norm = torch.logsumexp(torch.cat((est, scale * exact_logits[h]), -1), -1, keepdim=True)
            score = torch.exp(est - norm).sum(0)
        else:
            p = torch.softmax(z, -1)
            score = p.amax(0) if combine == "max" else p.mean(0)
        order = torch.sort(score, descending=True, stable=True).indices
        out.append(cand[order].tolist())
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the measurement
# ---------------------------------------------------------------------------------------------------------------------

def _store_kwargs(meta: dict, S: int, T: int, chunk_size: int, outlier_chunks: int, sink_chunks: int,
                  local_chunks: int) -> dict:
    """KVStore arguments of `shadowkv_core.evaluation.fidelity.evaluate`'s runs (float32, CPU, full rank: rank does not change
    the selection)."""
    return dict(num_q_heads=meta["num_q_heads"], num_kv_heads=meta["num_kv_heads"], head_dim=meta["head_dim"],
                max_batch=1, max_seq_len=S + T, inv_freq=torch.tensor(meta["inv_freq"], dtype=torch.float32),
                rotary_dim=meta["rotary_dim"], rope_style="half", attention_scaling=meta["attention_scaling"],
                softmax_scale=float(meta["softmax_scale"]), rank=meta["num_kv_heads"] * meta["head_dim"],
                chunk_size=chunk_size, outlier_chunks=outlier_chunks, sink_chunks=sink_chunks,
                local_chunks=local_chunks, generation_window=256, factorization="gram", dtype="float32",
                device="cpu")


def store_selections(capture: F.Capture, layers: Sequence[int], budget: int, kw: dict) -> Dict[int, List[list]]:
    """The store's own selections (`selected_chunks`) at every decode step, per layer: [step][KV head] -> ids."""
    S, T = capture.prompt_len, capture.steps
    # group_score="max": the "landmark" rule it is compared with combines the group by the max (the store's default
    # is the mean since the CUDA path passed parity; that rule is "landmark-mean" here).
    store = KVStore(num_layers=len(layers), budget=budget, group_score="max", **kw)
    slot = store.add_sequences(1)[0]
    for i, layer in enumerate(layers):
        lc = capture.layers[layer]
        store.prefill(i, [slot], lc.keys[None], lc.values[None], positions=torch.arange(S)[None],
                      q_last=lc.q_last[None], keys_post_rope=True)
    out: Dict[int, list] = {layer: [] for layer in layers}
    for t in range(T):
        pos = torch.tensor([S + t], dtype=torch.int64)
        for i, layer in enumerate(layers):
            lc = capture.layers[layer]
            store.decode(i, [slot], lc.q[t][None], lc.k_new[t][None], lc.v_new[t][None], positions=pos)
            out[layer].append(store.selected_chunks(i, slot))
    return out


def store_outliers(capture: F.Capture, layers: Sequence[int], kw: dict) -> Dict[int, list]:
    """The store's outlier chunks (sinks included) per layer: [KV head] -> ids (they depend on the prompt only)."""
    store = KVStore(num_layers=len(layers), budget=kw["chunk_size"], **kw)
    slot = store.add_sequences(1)[0]
    out = {}
    for i, layer in enumerate(layers):
        lc = capture.layers[layer]
        store.prefill(i, [slot], lc.keys[None], lc.values[None], keys_post_rope=True)
        out[layer] = store.outlier_chunks(i, slot)
    return out


def measure(capture: F.Capture, budgets: Sequence[int], rules: Sequence[str], chunk_size: int = 8,
            outlier_chunks: int = 4, sink_chunks: int = 1, local_chunks: int = 4, rank: int = 160,
            store_check: bool = True, layers: Optional[Sequence[int]] = None, log=None) -> dict:
    """Attention mass covered by each rule's selection, and by the best choice of as many chunks, per budget (tokens
    per KV head) and layer: means over query heads and decode steps (shadowkv_core.evaluation.fidelity's metric). With
    `store_check` the store itself runs each budget and its selections are compared with the "landmark" rule's."""
    m = capture.meta
    hq, hkv, d = m["num_q_heads"], m["num_kv_heads"], m["head_dim"]
    g, C = hq // hkv, chunk_size
    scale = float(m["softmax_scale"])
    layers = sorted(capture.layers) if layers is None else [int(l) for l in layers]
    S, T = capture.prompt_len, capture.steps
    kw = _store_kwargs(m, S, T, chunk_size, outlier_chunks, sink_chunks, local_chunks)
    if T > kw["generation_window"]:
        raise ValueError(f"{T} decode steps would fold generated chunks into the store; this replay assumes none "
                         f"(at most {kw['generation_window']} steps)")
    ks = [int(b) // C for b in budgets]

    # the store's outliers (incl. sinks), and its own selections for the check
    store_sel = {b: store_selections(capture, layers, int(b), kw) for b in budgets} if store_check else {}
    outliers = store_outliers(capture, layers, kw)

    acc = {r: {b: {l: [] for l in layers} for b in budgets} for r in rules}
    best = {b: {l: [] for l in layers} for b in budgets}
    fixed_only = {l: [] for l in layers}
    mismatches = {b: 0 for b in budgets}
    compared = 0
    times = {r: 0.0 for r in rules}
    for layer in layers:
        lc = capture.layers[layer]
        t0 = time.perf_counter()
        st = LayerStats(lc, m, C, local_chunks, rank)
        n = st.n
        outl = outliers[layer]
        cand = []
        for h in range(hkv):
            mask = torch.ones(n, dtype=torch.bool)
            if outl[h]:
                mask[torch.tensor(outl[h])] = False
            cand.append(torch.arange(n)[mask])
        keys_all = torch.cat((lc.keys, lc.k_new), 0).double()
        values_all = torch.cat((lc.values, lc.v_new), 0).double()
        for t in range(T):
            q = lc.q[t].double()
            _, p = F.full_attention(q, keys_all[: S + t + 1], values_all[: S + t + 1], scale, return_probs=True)
            info = dict(local_len=S - n * C, context_chunks=n, generated_exact_len=t + 1)
            qg = _group_view(q, hkv)
            exact = []
            for h in range(hkv):      # keys the step attends exactly: outliers, local window, generated
                rows = [torch.arange(c * C, (c + 1) * C) for c in outl[h]] + [torch.arange(n * C, S + t + 1)]
                exact.append(qg[h] @ keys_all[torch.cat(rows), h].T)
            # the fixed part alone, and the best choice of k chunks (both independent of the rule)
            fixed, orc = [], {b: [] for b in budgets}
            for h in range(hkv):
                ph = p[h * g:(h + 1) * g]
                fixed.append(F.mass_of_head(ph, [], outl[h], info, S, C)[0])
                for b, k in zip(budgets, ks):   # mass_of_head's oracle: the best len(selected) candidates
                    orc[b].append(F.mass_of_head(ph, cand[h][:k].tolist(), outl[h], info, S, C)[1])
            fixed_only[layer].append(float(torch.cat(fixed).mean()))
            for b in budgets:
                best[b][layer].append(float(torch.cat(orc[b]).mean()))
            for r in rules:
                t1 = time.perf_counter()
                rule, combine = parse_rule(r)
                logits = rule(st, q, S + t, scale)
                order = rank_chunks(logits, cand, scale, combine, exact, C)
                for b, k in zip(budgets, ks):
                    sel = [sorted(o[:k]) for o in order]
                    cov = [F.mass_of_head(p[h * g:(h + 1) * g], sel[h], outl[h], info, S, C)[0] for h in range(hkv)]
                    acc[r][b][layer].append(float(torch.cat(cov).mean()))
                    if r == "landmark" and store_check:
                        theirs = store_sel[b][layer][t]
                        mismatches[b] += sum(sel[h] != theirs[h] for h in range(hkv))
                        compared += hkv if b == budgets[0] else 0
                times[r] += time.perf_counter() - t1
        if log:
            log(f"  layer {layer}: {time.perf_counter() - t0:.1f}s")

    def mean_over(d):
        return float(np.mean([v for vals in d.values() for v in vals]))

    result = dict(
        config=dict(chunk_size=C, outlier_chunks=outlier_chunks, sink_chunks=sink_chunks, local_chunks=local_chunks,
                    rank=st.rank, budgets=[int(b) for b in budgets], layers=layers, prompt_len=S, steps=T,
                    num_q_heads=hq, num_kv_heads=hkv, head_dim=d, store_dtype="float32"),
        fixed_only=dict(overall=mean_over(fixed_only),
                        layers={str(l): float(np.mean(v)) for l, v in fixed_only.items()}),
        best={str(b): dict(overall=mean_over(best[b]), layers={str(l): float(np.mean(v)) for l, v in best[b].items()})
              for b in budgets},
        rules={r: {str(b): dict(overall=mean_over(acc[r][b]),
                                layers={str(l): float(np.mean(v)) for l, v in acc[r][b].items()})
                   for b in budgets} for r in rules},
        rule_seconds=times,
        store_check=dict(done=store_check, compared_per_budget=compared,
                         mismatched_head_steps={str(b): v for b, v in mismatches.items()}) if store_check else None)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# bytes and a GPU cost estimate
# ---------------------------------------------------------------------------------------------------------------------

# Bytes one (chunk, KV head) needs for the rule, for head_dim D, element size e (bf16: 2), rank r, chunk C, Hkv heads
# (the low-rank factor A is shared by the heads of a layer and is float32 in the store). The landmark is D*e.
def rule_bytes(name: str, D: int, e: int = 2, r: int = 160, C: int = 8, hkv: int = 8) -> Optional[float]:
    base = name.partition("@")[0]
    table = {
        "landmark": D * e, "landmark-fp8": D + 4, "quest": 2 * D * e, "quest-fp8": 2 * D + 4,
        "radius": D * e + e, "radius-half": D * e + e, "lse-iso": D * e + e, "lse-diag": 2 * D * e,
        "halves": 2 * D * e, "halves-lse": 2 * D * e, "centroids2-max": 2 * D * e,
        "centroids2-lse": 2 * D * e + 1, "centroids2-lse-fp8": 2 * D + 2 * 4 + 1,
        "lowrank-max": C * r * 4 / hkv, "lowrank-lse": C * r * 4 / hkv, "latent-max": C * r * 4 / hkv,
        "exact-lse": C * D * e,
    }
    return table.get(base)


# docs/performance.md / docs/performance.md: Llama-3-8B attention (Hq 32, Hkv 8, D 128, r 160, C 8, bf16), B=24, S=122880.
GPU_SHAPE = dict(B=24, S=122880, hq=32, hkv=8, D=128, r=160, C=8, e=2)
HBM_BYTES_PER_S = 4.2e12          # docs/performance.md: landmark bytes at the measured HBM rate (755 MB -> 180 us)
LOGITS_KERNEL_BYTES_PER_S = 755e6 / 423e-6   # today's landmark-logits kernel (docs/performance.md, 423 us at B=24)


def gpu_estimate(name: str, shape: dict = GPU_SHAPE) -> dict:
    """Bytes the selection reads per layer and decode step at `shape`, and the time at the HBM rate and at the rate
    today's landmark-logits kernel reaches; the rebuild rules add their GEMM's FLOPs."""
    B, S, hkv, D, r, C, e = (shape[k] for k in ("B", "S", "hkv", "D", "r", "C", "e"))
    per = rule_bytes(name, D, e, r, C, hkv)
    chunks = S // C
    total = B * chunks * hkv * per
    out = dict(bytes_per_chunk_head=per, ratio=per / (D * e), bytes=total, floor_us=total / HBM_BYTES_PER_S * 1e6,
               today_kernel_us=total / LOGITS_KERNEL_BYTES_PER_S * 1e6)
    base = name.partition("@")[0]
    if base.startswith("lowrank"):
        out["rebuild_gflop"] = 2.0 * B * S * r * hkv * D / 1e9       # every key: A[S, r] · B[r, Hkv*D]
    if base == "latent-max":
        out["latent_gflop"] = 2.0 * B * S * r * shape["hq"] / 1e9   # A[S, r] · (B_h q_h) for every query head
    if name.endswith("@mass"):
        out["note"] = "plus the exact tokens' logits (outliers, local, generated: ~700 keys a head, ~4% more bytes)"
    return out


# ---------------------------------------------------------------------------------------------------------------------
# report and command line
# ---------------------------------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    cfg = result["config"]
    budgets = [str(b) for b in cfg["budgets"]]
    lines = [f"{result.get('source', 'capture')}: prompt {cfg['prompt_len']}, {cfg['steps']} decode steps, layers "
             f"{cfg['layers']}, chunk {cfg['chunk_size']}, outliers {cfg['outlier_chunks']} (sinks "
             f"{cfg['sink_chunks']}), local {cfg['local_chunks']} chunks, low-rank rules at rank {cfg['rank']}", ""]
    lines.append("| rule | bytes / landmark (this model; Llama-3-8B) | " +
                 " | ".join(f"{b} tokens: covered (/ best)" for b in budgets) + " |")
    lines.append("| --- | ---: | " + " | ".join("---:" for _ in budgets) + " |")
    lines.append("| outliers + local alone | | " + " | ".join(f"{result['fixed_only']['overall']:.3f}" for _ in budgets)
                 + " |")
    lines.append("| best possible | | " + " | ".join(f"{result['best'][b]['overall']:.3f}" for b in budgets) + " |")
    D = cfg["head_dim"]
    for name, per_b in result["rules"].items():
        ratio = rule_bytes(name, D, 2, cfg["rank"], cfg["chunk_size"], cfg["num_kv_heads"]) / (2 * D)
        cells = [f"{per_b[b]['overall']:.3f} ({per_b[b]['overall'] / result['best'][b]['overall']:.3f})"
                 for b in budgets]
        lines.append(f"| {name} | {ratio:.2f}; {gpu_estimate(name)['ratio']:.2f} | " + " | ".join(cells) + " |")
    check = result.get("store_check")
    if check:
        lines += ["", f"store check: 'landmark' selections vs the store's selected_chunks, mismatched (head, step) "
                      f"of {check['compared_per_budget']} per budget: {check['mismatched_head_steps']}"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/chunk_scores.py", description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--capture",
                     help="a capture (.npz) written by shadowkv_core.evaluation.fidelity or by --save-capture")
    src.add_argument("--model", choices=models.available_models(),
                     help="capture a packaged model live (shadowkv_core.evaluation.models)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--save-capture", help="with --model: save the capture (float32 .npz) here")
    parser.add_argument("--budgets", default="64,128,256", help="tokens per KV head (default 64,128,256)")
    parser.add_argument("--rules", default=DEFAULT_RULES, help="comma-separated rule names (see the docstring)")
    parser.add_argument("--outlier-chunks", type=int, default=4)
    parser.add_argument("--sink-chunks", type=int, default=1)
    parser.add_argument("--local-chunks", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=160, help="rank of the low-rank rules (the store's default)")
    parser.add_argument("--no-store-check", action="store_true", help="skip the store's own selections")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the result JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    started = time.perf_counter()
    if args.model:
        capture = capture_live(args.model, args.tokens, args.steps, args.save_capture)
        source = f"{args.model} (live capture)"
    else:
        capture = F.load_capture(args.capture)
        inside = os.path.abspath(args.capture).startswith(ROOT + os.sep)
        source = os.path.relpath(args.capture, ROOT) if inside else args.capture
    t0 = time.perf_counter()
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    for r in rules:
        parse_rule(r)
    budgets = [int(b) for b in args.budgets.split(",")]
    result = measure(capture, budgets, rules, chunk_size=args.chunk_size, outlier_chunks=args.outlier_chunks,
                     sink_chunks=args.sink_chunks, local_chunks=args.local_chunks, rank=args.rank,
                     store_check=not args.no_store_check, log=log)
    result["source"] = source
    result["gpu_estimate"] = dict(shape=GPU_SHAPE, hbm_bytes_per_s=HBM_BYTES_PER_S,
                                  logits_kernel_bytes_per_s=LOGITS_KERNEL_BYTES_PER_S,
                                  rules={r: gpu_estimate(r) for r in rules})
    result["times"] = dict(measure_s=time.perf_counter() - t0, total_s=time.perf_counter() - started)
    result["command"] = "python bench/chunk_scores.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result["environment"] = dict(torch=torch.__version__, python=platform.python_version(), threads=args.threads,
                                 date=time.strftime("%Y-%m-%d"))
    print(format_table(result))
    print(f"\ntimes: measure {result['times']['measure_s']:.1f}s, total {result['times']['total_s']:.1f}s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            fh.write(json.dumps(result, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
