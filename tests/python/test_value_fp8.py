"""fp8 values (value_dtype="float8_e4m3", or value_store="host_fp8"): the value store holds e4m3 codes and one float32
scale per (chunk, KV head) run, amax / 448 (docs/semantics.md "Value format"); fetched values are dequantized to the
store's dtype. Checked on every backend (SHADOWKV_TEST_DEVICES) against an oracle written here with torch's own
float8_e4m3fn conversion (independent of the store's codec):

* full rank and a budget covering every chunk: the output is float64 attention over the values the format
  promises (context chunks quantized per run, outliers, the local window and generated tokens exact);
* memory_report and bytes_fetched count C*D + 4 bytes per run;
* at a real budget the output stays close to the same store with bf16 values;
* the options are validated.
"""

from __future__ import annotations

import pytest
import torch

import helpers as H
import reference as R

HQ, HKV, D, CHUNK, PROMPT, STEPS = 4, 2, 64, 8, 90, 12
CONTEXT_CHUNKS = PROMPT // CHUNK - 2  # 2 local chunks stay exact


def _config(device, **overrides):
    kw = H.small_config(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rank=HKV * D, chunk_size=CHUNK, budget=1024,
                        outlier_chunks=2, local_chunks=2, generation_window=64, device=device,
                        value_dtype="float8_e4m3")
    kw.update(overrides)
    return kw


def fp8_roundtrip(run: torch.Tensor) -> torch.Tensor:
    """The documented rule, through torch's float8_e4m3fn cast: scale = amax / 448 (1 if all zero), codes =
    e4m3(v / scale) rounded to nearest even (saturating: clamped first), values = code * scale (float32)."""
    run = run.float()
    amax = run.abs().max()
    scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
    codes = (run / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.float() * scale


def test_full_budget_attends_over_the_quantized_values(device):
    seed = 31
    g = H.generator(seed)
    kw = _config(device)
    store = H.make_store(kw)
    slot = store.add_sequences(1)[0]
    total = PROMPT + STEPS
    keys_pre = H.structured_keys(g, total, HKV, D)
    values = H.randn(g, total, HKV, D, scale=3.0)
    keys_post = H.rope(kw, keys_pre, torch.arange(total))
    H.prefill_one(store, 0, slot, keys_pre[:PROMPT], values[:PROMPT], device=device)
    outliers = store.outlier_chunks(0, slot)
    promised = values.clone()
    for c in range(CONTEXT_CHUNKS):
        for h in range(HKV):
            if c not in outliers[h]:
                promised[c * CHUNK:(c + 1) * CHUNK, h] = fp8_roundtrip(values[c * CHUNK:(c + 1) * CHUNK, h])
    assert H.rel_err(promised, values) > 1e-3, "the quantization must be visible for this test to mean anything"
    scale = H.ref_config(kw).softmax_scale
    worst, worst_exact = 0.0, 0.0
    for i in range(STEPS):
        t = PROMPT + i
        q = H.randn(g, HQ, D, scale=2.0)
        out = H.decode_one(store, 0, slot, q, keys_post[t], values[t], device=device)
        H.assert_nontrivial(out, "fp8-valued output", seed)
        want = R.full_attention(q, keys_post[: t + 1], promised[: t + 1], scale)
        exact = R.full_attention(q, keys_post[: t + 1], values[: t + 1], scale)
        worst = max(worst, H.rel_err(out, want))
        worst_exact = max(worst_exact, H.rel_err(out, exact))
    assert worst < 1e-4, f"output vs attention over the promised fp8 values: {worst:.2e} (seed={seed})"
    assert worst_exact > 10 * worst, f"the test cannot tell fp8 from exact values ({worst_exact:.2e}, seed={seed})"


def test_memory_and_fetched_bytes_count_codes_and_scales(device):
    g = H.generator(32)
    store = H.make_store(_config(device, budget=16, rank=32, num_layers=1))
    slot = store.add_sequences(1)[0]
    H.prefill_one(store, 0, slot, H.structured_keys(g, PROMPT, HKV, D), H.randn(g, PROMPT, HKV, D), device=device)
    run_bytes = CHUNK * D + 4
    report = store.memory_report()
    assert report["value_store"] == CONTEXT_CHUNKS * HKV * run_bytes, report
    for _ in range(6):
        H.decode_one(store, 0, slot, H.randn(g, HQ, D, scale=2.0), H.randn(g, HKV, D), H.randn(g, HKV, D),
                     device=device)
    stats = store.stats()
    assert stats["misses"] > 0 and stats["bytes_fetched"] == stats["misses"] * run_bytes, stats


def test_close_to_bf16_values_at_a_real_budget(device):
    seed = 33
    g = H.generator(seed)
    common = dict(dtype="bfloat16", budget=48, rank=48, generation_window=16)
    stores = {fmt: H.make_store(_config(device, value_dtype=fmt, **common)) for fmt in (None, "float8_e4m3")}
    keys = H.structured_keys(g, 600, HKV, D)
    values = H.randn(g, 600, HKV, D)
    for s in stores.values():
        s.add_sequences(1)
        H.prefill_one(s, 0, 0, keys, values, device=device)
    worst = 0.0
    for _ in range(30):  # with folds: folded chunks are quantized too
        q, k, v = H.randn(g, HQ, D, scale=2.0), H.randn(g, HKV, D), H.randn(g, HKV, D)
        outs = {fmt: H.decode_one(s, 0, 0, q, k, v, device=device).float() for fmt, s in stores.items()}
        worst = max(worst, H.rel_err(outs["float8_e4m3"], outs[None]))
    assert 1e-4 < worst < 0.05, f"fp8 vs bf16 values: {worst:.3e} (seed={seed})"
    assert stores["float8_e4m3"].stats()["folds"] > 0


def test_options():
    store = H.make_store(H.small_config(value_store="host_fp8", dtype="bfloat16"))
    assert store.config["value_format"] == "float8_e4m3" and store.config["value_store"] == "host"
    assert H.make_store(H.small_config(value_dtype=torch.float8_e4m3fn)).config["value_format"] == "float8_e4m3"
    assert H.make_store(H.small_config(value_dtype="float32")).config["value_format"] == "same"
    with pytest.raises(ValueError, match="value format"):
        H.make_store(H.small_config(value_dtype="int4"))
    with pytest.raises(ValueError, match="contradicts"):
        H.make_store(H.small_config(value_store="host_fp8", value_dtype="bfloat16"))
