"""Helpers shared by the Python tests (store construction, seeded data, single-sequence calls, comparisons).

``shadowkv_core`` is imported lazily (inside :func:`store_class`), so the test modules import even before the
extension is built; every test that needs it then fails loudly with the ImportError rather than being skipped.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference as R  # noqa: E402


# --------------------------------------------------------------------------------------------------------------------
# store construction
# --------------------------------------------------------------------------------------------------------------------

def store_class():
    from shadowkv_core import KVStore
    return KVStore


def small_config(**overrides) -> dict:
    """A small, valid ``KVStore`` keyword dict; tests override what they exercise."""
    kw = dict(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, max_batch=4, max_seq_len=1024,
              rope_theta=10000.0, rope_style="half", rank=32, chunk_size=8, budget=48, outlier_chunks=2,
              local_chunks=2, generation_window=32, factorization="gram", dtype="float32", device="cpu")
    kw.update(overrides)
    return kw


def make_store(kw: dict):
    return store_class()(**kw)


def make_reference(kw: dict) -> R.ReferenceStore:
    return R.ReferenceStore(R.RefConfig.from_kwargs(**kw))


def ref_config(kw: dict) -> R.RefConfig:
    return R.RefConfig.from_kwargs(**kw)


# --------------------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------------------

def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def structured_keys(g: torch.Generator, T: int, hkv: int, d: int, latent: int = 24, decay: float = 0.88,
                    noise: float = 0.05, mean_scale: float = 0.5) -> torch.Tensor:
    """Pre-RoPE keys ``[T, Hkv, D]`` float32 like real ones: a per-channel mean, a decaying low-rank part, noise.

    The spectrum decays geometrically (ratio ``decay`` per latent direction) so that the leading singular subspace
    of any rank up to ``latent`` is well separated from the rest (stable across float32/float64 factorisations);
    beyond that the cut falls in the noise bulk, where eigenvalues are nearly equal and the subspace is
    ill-conditioned (two correct factorisations may differ by ~1e-4 relative).
    """
    z = torch.randn(T, latent, generator=g, dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(hkv * d, latent, generator=g, dtype=torch.float64)).Q.T   # [latent, HD]
    sv = 3.0 * decay ** torch.arange(latent, dtype=torch.float64)
    mean = mean_scale * torch.randn(hkv * d, generator=g, dtype=torch.float64)
    k = mean + (z * sv) @ basis * math.sqrt(d) / 2 + noise * torch.randn(T, hkv * d, generator=g, dtype=torch.float64)
    return k.reshape(T, hkv, d).float()


def randn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).float()


def rope(kw_or_cfg, x: torch.Tensor, positions) -> torch.Tensor:
    """Post-RoPE float32 copy of ``x`` ``[T, H, D]`` at ``positions`` ``[T]`` with the config's RoPE."""
    cfg = kw_or_cfg if isinstance(kw_or_cfg, R.RefConfig) else ref_config(kw_or_cfg)
    cos, sin = R.rope_tables(torch.as_tensor(positions), cfg.inv_freq, cfg.attention_scaling)
    return R.apply_rope(x.double(), cos, sin, cfg.rope_style).float()


def unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def orthonormal(g: torch.Generator, d: int, n: int) -> torch.Tensor:
    """``n`` orthonormal float64 vectors of length ``d`` (rows)."""
    return torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64)).Q.T.contiguous()


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as ``x`` ``[B, S, H, D]`` as a non-contiguous view of a ``[B, H, S, D]`` tensor."""
    v = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not v.is_contiguous()
    return v


# --------------------------------------------------------------------------------------------------------------------
# single-sequence calls through the batch API
# --------------------------------------------------------------------------------------------------------------------

def prefill_one(store, layer, slot, keys, values, positions=None, q_last=None, keys_post_rope=False, device="cpu"):
    kwargs = {}
    if positions is not None:
        kwargs["positions"] = torch.as_tensor(positions, dtype=torch.int64).reshape(1, -1).to(device)
    if q_last is not None:
        kwargs["q_last"] = q_last[None].to(device)
    store.prefill(layer, [slot], keys[None].to(device), values[None].to(device), keys_post_rope=keys_post_rope,
                  **kwargs)


def decode_one(store, layer, slot, q, k_new, v_new, position=None, k_new_post_rope=True, device="cpu"):
    kwargs = {}
    if position is not None:
        kwargs["positions"] = torch.tensor([int(position)], dtype=torch.int64, device=device)
    out = store.decode(layer, [slot], q[None].to(device), k_new[None].to(device), v_new[None].to(device),
                       k_new_post_rope=k_new_post_rope, **kwargs)
    assert out.shape == (1,) + tuple(q.shape), f"decode output shape {tuple(out.shape)}"
    return out[0].cpu()


# --------------------------------------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_nontrivial(x: torch.Tensor, what: str, seed):
    assert torch.isfinite(x).all(), f"{what}: non-finite values (seed={seed})"
    assert float(x.double().norm()) > 0, f"{what}: output is all zeros (seed={seed})"


def assert_same_selection(got, ref: R.ReferenceStore, seed, step, score_rtol: float = 1e-4):
    """The store's selection equals the reference's, except that chunks whose reference scores tie with the k-th
    score (within ``score_rtol``) may be exchanged: float32 vs float64 may legitimately order near-ties differently."""
    assert len(got) == len(ref.selected), f"selection has {len(got)} heads, expected {len(ref.selected)}"
    for h, (g_ids, r_ids) in enumerate(zip(got, ref.selected)):
        g_ids = list(g_ids)
        assert g_ids == sorted(g_ids), f"head {h}: selected ids not sorted: {g_ids} (seed={seed}, step={step})"
        assert len(g_ids) == len(r_ids), (
            f"head {h}: {len(g_ids)} chunks selected, reference {len(r_ids)} (seed={seed}, step={step})")
        diff = set(g_ids) ^ set(r_ids)
        if not diff:
            continue
        cand, score = ref.last_scores[h]
        by_id = {int(c): float(s) for c, s in zip(cand, score)}
        kth = min(by_id[c] for c in r_ids)
        bad = [c for c in diff if c not in by_id or abs(by_id[c] - kth) > score_rtol * max(kth, 1e-30)]
        assert not bad, (f"head {h}: selected {g_ids}, reference {r_ids}; chunks {sorted(bad)} are not near-ties "
                         f"(k-th score {kth:.6g}) (seed={seed}, step={step})")


def assert_same_outliers(got, ref: R.ReferenceStore, seed, cos_atol: float = 1e-5):
    """Outliers equal the reference's, except exchanges among chunks whose min-cosine ties within ``cos_atol``."""
    assert len(got) == len(ref.outliers), f"outliers have {len(got)} heads, expected {len(ref.outliers)}"
    for h, (g_ids, r_ids) in enumerate(zip(got, ref.outliers)):
        g_ids = list(g_ids)
        assert g_ids == sorted(g_ids), f"head {h}: outlier ids not sorted: {g_ids} (seed={seed})"
        assert len(g_ids) == len(r_ids), f"head {h}: outliers {g_ids}, reference {r_ids} (seed={seed})"
        diff = set(g_ids) ^ set(r_ids)
        if not diff:
            continue
        m = ref.min_cos[:, h]
        boundary = max(float(m[c]) for c in r_ids)
        bad = [c for c in diff if c >= m.numel() or abs(float(m[c]) - boundary) > cos_atol]
        assert not bad, f"head {h}: outliers {g_ids}, reference {r_ids} (seed={seed})"


SEQUENCE_INFO_KEYS = ("prompt_len", "total_len", "context_chunks", "local_len", "generated_exact_len", "last_position")


def documented_info(info: dict) -> dict:
    """The documented keys of ``sequence_info()`` (the store may report more)."""
    missing = [k for k in SEQUENCE_INFO_KEYS if k not in info]
    assert not missing, f"sequence_info lacks {missing}: {info}"
    return {k: info[k] for k in SEQUENCE_INFO_KEYS}


def memory_kinds():
    return ["low_rank_factors", "landmarks", "outliers", "exact_tokens", "value_store", "selection_cache"]
