"""The fidelity tool's measures, in float64: exact attention, key energy, attention mass covered by a selection,
the error of rank alone, and the sanity checks of a capture.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ..rope import rope, unrope
from .capture import Capture, LayerCapture

__all__ = ["DEFAULT_FRACTIONS", "capture_checks", "chunk_starts", "energy_ranks", "full_attention", "mass_of_head",
           "rank_only_error"]

DEFAULT_FRACTIONS = (0.95, 0.99, 0.999)


def full_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   return_probs: bool = False):
    """Exact attention in float64 of one query token q [Hq, D] over keys/values [N, Hkv, D] (GQA: query head j
    reads KV head j // G). Returns the output [Hq, D] (and the probabilities [Hq, N])."""
    hq, hkv, d = q.shape[0], keys.shape[1], q.shape[-1]
    g = hq // hkv
    qg = q.double().reshape(hkv, g, d)                                        # query head j = h*G + i
    logits = torch.einsum("hgd,nhd->hgn", qg, keys.double()) * scale
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgn,nhd->hgd", probs, values.double()).reshape(hq, d)
    probs = probs.reshape(hq, -1)
    return (out, probs) if return_probs else out


def energy_ranks(keys_pre: torch.Tensor, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                 ranks: Sequence[int] = ()) -> dict:
    """Singular-value energy of pre-RoPE keys [S, Hkv, D] (heads concatenated, not centred, float64).

    Returns {"rank_for": {"0.99": r, ...} (smallest r whose leading r singular values hold that share of
    sum(σ²)), "kept_at_rank": {"r": share of energy kept}, "key_error_at_rank": {"r": relative Frobenius error of
    the best rank-r approximation = sqrt(1 - kept)}, "full_rank": Hkv*D}."""
    k = keys_pre.double().reshape(keys_pre.shape[0], -1)
    sv = torch.linalg.svdvals(k)
    energy = sv.square()
    cum = torch.cumsum(energy, 0) / energy.sum()
    rank_for = {}
    for f in fractions:
        idx = int(torch.searchsorted(cum, torch.tensor(f, dtype=cum.dtype) - 1e-12).item())
        rank_for[f"{f:g}"] = min(idx + 1, k.shape[1])
    kept, err = {}, {}
    for r in ranks:
        r = int(r)
        share = 1.0 if r >= cum.numel() else float(cum[r - 1].item())
        kept[str(r)] = share
        err[str(r)] = math.sqrt(max(0.0, 1.0 - share))
    return {"rank_for": rank_for, "kept_at_rank": kept, "key_error_at_rank": err, "full_rank": int(k.shape[1])}


def chunk_starts(ids: torch.Tensor, n_prompt_ctx: int, prompt_len: int, chunk_size: int) -> torch.Tensor:
    """First token index of context chunks `ids`: prompt chunk c holds [c*C, (c+1)*C); a folded chunk (id >=
    n_prompt_ctx) holds generated tokens, the i-th folded chunk [S + i*C, S + (i+1)*C) (docs/semantics.md)."""
    return torch.where(ids < n_prompt_ctx, ids * chunk_size, prompt_len + (ids - n_prompt_ctx) * chunk_size)


def mass_of_head(p: torch.Tensor, selected: List[int], outliers: List[int], info: dict, prompt_len: int,
                  chunk_size: int) -> tuple:
    """(covered, oracle) [G] for one KV head: p [G, N] are the full-attention probabilities of its query heads over
    all N tokens. covered = mass on what the store attends to (outliers, local window, selected chunks, exact
    generated tokens); oracle = the same with the selected chunks replaced by the best choice of as many
    candidate chunks (the top chunks by summed mass of the group)."""
    C = chunk_size
    n_prompt_ctx = (prompt_len - int(info["local_len"])) // C
    n_ctx = int(info["context_chunks"])
    total = p.shape[1]
    ids = torch.arange(n_ctx)
    starts = chunk_starts(ids, n_prompt_ctx, prompt_len, C)
    token_idx = (starts[:, None] + torch.arange(C)[None, :]).reshape(-1)
    chunk_mass = p[:, token_idx].reshape(p.shape[0], n_ctx, C).sum(-1)          # [G, n_ctx]
    is_outlier = torch.zeros(n_ctx, dtype=torch.bool)
    if outliers:
        is_outlier[torch.tensor(outliers, dtype=torch.long)] = True
    fixed = chunk_mass[:, is_outlier].sum(-1)
    fixed = fixed + p[:, n_prompt_ctx * C: prompt_len].sum(-1)                  # local window
    gen_exact = int(info["generated_exact_len"])
    if gen_exact:
        fixed = fixed + p[:, total - gen_exact:].sum(-1)
    sel = torch.tensor(selected, dtype=torch.long)
    covered = fixed + (chunk_mass[:, sel].sum(-1) if len(selected) else 0.0)
    cand = chunk_mass[:, ~is_outlier]
    k = min(len(selected), cand.shape[1])
    oracle = fixed + (cand[:, cand.sum(0).topk(k).indices].sum(-1) if k else 0.0)
    return covered, oracle


def rank_only_error(lc: LayerCapture, keys_pre: torch.Tensor, rank: int, inv_freq: torch.Tensor, meta: dict,
                     chunk_size: int, local_chunks: int, refs: List[torch.Tensor],
                     exact_chunks: Optional[List[List[int]]] = None) -> float:
    """Mean over decode steps of the relative error of full attention (float64, independent of the store) when the
    context tokens' keys are replaced by their best rank-`rank` approximation (the store's own basis: leading right
    singular vectors of the prompt's pre-RoPE keys, re-rotated) and every other token stays exact.

    With `exact_chunks` (per KV head, chunk ids kept exact: the store's outliers) this is what the store computes
    with a budget that covers everything, so it checks the store's rank error independently; without, it is the
    effect of the rank alone on every context key."""
    S, T = lc.prompt_len, lc.steps
    if T == 0:
        return 0.0
    k = keys_pre.double().reshape(S, -1)
    if rank >= k.shape[1]:
        approx = k
    else:
        vecs = torch.linalg.eigh(k.T @ k).eigenvectors[:, -rank:]               # leading right singular vectors
        approx = k @ vecs @ vecs.T
    n = max(0, S // chunk_size - local_chunks) * chunk_size
    approx = approx.reshape(S, lc.keys.shape[1], -1)[:n]
    post = rope(approx, torch.arange(n), inv_freq, meta["attention_scaling"])
    for h, chunks in enumerate(exact_chunks or []):
        for c in chunks:
            post[c * chunk_size:(c + 1) * chunk_size, h] = lc.keys[c * chunk_size:(c + 1) * chunk_size, h].double()
    keys = torch.cat((post, lc.keys[n:].double(), lc.k_new.double()), 0)
    values = torch.cat((lc.values, lc.v_new), 0).double()
    errs = []
    for t in range(T):
        o = full_attention(lc.q[t], keys[: S + t + 1], values[: S + t + 1], float(meta["softmax_scale"]))
        errs.append(float((o - refs[t]).norm() / refs[t].norm()))
    return float(np.mean(errs))


def capture_checks(capture: Capture) -> Dict[str, dict]:
    """Sanity of a capture, per layer: relative error of the float64 full attention over the captured tokens vs the
    model's own attention output at each decode step (max over steps; ~1e-6 in float32), and relative error of the
    pre-RoPE keys recovered with `unrope` vs the model's own pre-RoPE keys (when captured)."""
    m = capture.meta
    inv_freq = torch.tensor(m["inv_freq"], dtype=torch.float32)
    checks = {}
    for layer, lc in capture.layers.items():
        entry = {}
        if lc.out is not None and lc.steps:
            errs = []
            keys, values = lc.keys, lc.values
            for t in range(lc.steps):
                k = torch.cat((keys, lc.k_new[: t + 1]), 0)
                v = torch.cat((values, lc.v_new[: t + 1]), 0)
                ref = full_attention(lc.q[t], k, v, m["softmax_scale"])
                errs.append(float((lc.out[t].double() - ref).norm() / ref.norm()))
            entry["model_output_rel_err_max"] = max(errs)
        if lc.keys_pre is not None:
            pos = torch.arange(lc.prompt_len)
            rec = unrope(lc.keys, pos, inv_freq, m["attention_scaling"])
            entry["unrope_rel_err"] = float((rec - lc.keys_pre.double()).norm() / lc.keys_pre.double().norm())
        checks[str(layer)] = entry
    return checks

