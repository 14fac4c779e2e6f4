"""bfloat16 low-rank factors (`factor_dtype`, docs/semantics.md "Low-rank factors"): the default follows the store's
dtype; the store with bf16 factors equals the float64 reference that rounds B, then A, where the semantics say; the
rounding is real (its outputs differ from float32 factors' by more than the tolerance); memory_report halves
`low_rank_factors` by the documented formula; folds project onto B as held."""

import pytest
import torch

from helpers import (assert_nontrivial, decode_one, generator, make_reference, make_store, prefill_one, randn,
                     rel_err, rope, small_config, structured_keys)

PROMPT, STEPS = 203, 40  # generation_window 16: the steps fold the generated region twice over


def test_default_follows_the_store_dtype_and_can_be_set():
    for dtype, expected in (("bfloat16", "bfloat16"), ("float16", "bfloat16"), ("float32", "float32")):
        store = make_store(small_config(dtype=dtype))
        assert store.config["factor_dtype"] == expected, (dtype, store.config)
        assert store.config["factor_format"] == "auto"
    assert make_store(small_config(dtype="bfloat16", factor_dtype="float32")).config["factor_dtype"] == "float32"
    assert make_store(small_config(dtype="float32", factor_dtype=torch.bfloat16)).config["factor_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="factor_dtype"):
        make_store(small_config(factor_dtype="float16"))


def _run(kw, device, seed):
    """Prefill PROMPT tokens, decode STEPS; returns (store outputs, reference outputs, store, slot, reference)."""
    g = generator(seed)
    hq, hkv, d = kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"]
    total = PROMPT + STEPS
    keys_pre = structured_keys(g, total, hkv, d)
    values = randn(g, total, hkv, d)
    keys_post = rope(kw, keys_pre, torch.arange(total))
    queries = randn(g, STEPS, hq, d, scale=2.0)
    store, ref = make_store(kw), make_reference(kw)
    slot = store.add_sequences(1)[0]
    prefill_one(store, 0, slot, keys_pre[:PROMPT], values[:PROMPT], device=device)
    ref.prefill(keys_pre[:PROMPT], values[:PROMPT])
    outs, ref_outs = [], []
    for i in range(STEPS):
        t = PROMPT + i
        outs.append(decode_one(store, 0, slot, queries[i], keys_post[t], values[t], device=device).double())
        ref_outs.append(ref.decode(queries[i], keys_post[t], values[t]))
        # Same chunks attended: the output comparison below is then the factors' arithmetic alone.
        assert store.selected_chunks(0, slot) == ref.selected, f"step {i}: selection differs (seed={seed})"
    return torch.stack(outs), torch.stack(ref_outs), store, slot, ref


def test_bf16_factors_match_the_reference_and_differ_from_float32_factors(device):
    """float32 storage, so that the factors are the only bf16 rounding: the store with bf16 factors equals the
    reference rounding them (CPU measured ~1e-6), and sits measurably away from float32 factors."""
    seed = 9100
    base = small_config(rank=24, budget=48, outlier_chunks=3, local_chunks=2, generation_window=16, dtype="float32",
                        device=device)
    out16, ref16, store, slot, ref = _run(dict(base, factor_dtype="bfloat16"), device, seed)
    out32, ref32, _, _, _ = _run(dict(base, factor_dtype="float32"), device, seed)
    assert_nontrivial(out16, "bf16-factor outputs", seed)
    tolerance = 1e-4
    assert rel_err(out16, ref16) <= tolerance, f"bf16 factors vs reference {rel_err(out16, ref16):.3g} (seed={seed})"
    assert rel_err(out32, ref32) <= tolerance, f"float32 factors vs reference {rel_err(out32, ref32):.3g}"
    assert rel_err(ref16, ref32) > 3 * tolerance, "bf16 factors do not change the outputs: no rounding happened?"
    assert rel_err(ref16, ref32) < 2e-2, f"bf16 factors moved the outputs by {rel_err(ref16, ref32):.3g}"
    info = store.sequence_info(0, slot)
    assert info["context_chunks"] > PROMPT // 8 - 2, f"no fold happened: {info}"
    report = store.memory_report()
    assert report["low_rank_factors"] == ref.memory_report()["low_rank_factors"]
    r, width = base["rank"], base["num_kv_heads"] * base["head_dim"]
    assert report["low_rank_factors"] == (info["context_chunks"] * 8 * r + r * width) * 2


def test_bf16_factors_halve_the_factor_bytes(device):
    kw = small_config(dtype="bfloat16", device=device)
    g = generator(9200)
    keys, values = structured_keys(g, 300, 2, 64), randn(g, 300, 2, 64)
    reports = {}
    for factor in ("bfloat16", "float32"):
        store = make_store(dict(kw, factor_dtype=factor))
        slot = store.add_sequences(1)[0]
        prefill_one(store, 0, slot, keys, values, device=device)
        reports[factor] = store.memory_report()
    assert 2 * reports["bfloat16"]["low_rank_factors"] == reports["float32"]["low_rank_factors"], reports
    for kind in ("landmarks", "outliers", "exact_tokens", "value_store", "selection_cache"):
        assert reports["bfloat16"][kind] == reports["float32"][kind], kind
