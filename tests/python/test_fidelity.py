"""The attention-fidelity tool (``shadowkv_core.evaluation.fidelity``), on the committed real-model captures and on tiny models.

* Fixtures (tests/fixtures/fidelity_*.npz, fp16 Q/K/V of two full-attention layers of SmolLM2-135M and Gemma-3-270M
  at a 1024-token haystack prompt plus 16 real greedy decode steps; tests/fixtures/make_fidelity_fixtures.sh made
  them): the store at full budget and full rank equals float64 full attention (rel. error < 1e-5); the error falls
  as the budget grows and the attention mass covered never falls; hit rates lie in [0, 1] and equal the store's own
  statistics; the energy ranks are monotone; the store's error at full budget and reduced rank equals an independent
  float64 computation of the rank-r keys.
* Tiny random-weight Llama, Qwen3 and Gemma-3 models (no downloads): the capture path records what the model's attention
  saw (its own decode output is reproduced in float64, pre-RoPE keys recovered by un-rotation), generates the same
  tokens as ``model.generate``, restores the attention implementation, and a capture survives save/load.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from shadowkv_core.evaluation import fidelity as F

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")
FIXTURE_FILES = sorted(glob.glob(os.path.join(FIXTURES, "fidelity_*.npz")))
SMALL = dict(outlier_chunks=4, local_chunks=4, chunk_size=8)


def test_fixtures_present_and_small():
    names = [os.path.basename(p) for p in FIXTURE_FILES]
    assert any("smollm2" in n for n in names) and any("gemma3" in n for n in names), names
    total = sum(os.path.getsize(p) for p in FIXTURE_FILES)
    assert total < 10 * 2**20, f"fixtures take {total} bytes (limit 10 MiB)"


@pytest.fixture(scope="module", params=FIXTURE_FILES, ids=[os.path.basename(p) for p in FIXTURE_FILES])
def capture(request):
    return F.load_capture(request.param)


@pytest.fixture(scope="module")
def sweep(capture):
    """One evaluation of the fixture over budgets 32..full at full rank and at a reduced rank."""
    full_rank = capture.meta["num_kv_heads"] * capture.meta["head_dim"]
    return F.evaluate(capture, budgets=[32, 128, 512, "full"], ranks=["full", full_rank // 2], **SMALL)


def _runs(result, rank):
    return [r for r in result["runs"] if r["rank"] == rank]


def test_fixture_shapes(capture):
    m = capture.meta
    hq, hkv, d = m["num_q_heads"], m["num_kv_heads"], m["head_dim"]
    assert len(capture.layers) >= 2 and capture.prompt_len >= 512 and capture.steps >= 8
    for lc in capture.layers.values():
        S, T = lc.prompt_len, lc.steps
        assert lc.keys.shape == lc.values.shape == (S, hkv, d)
        assert lc.q_last.shape == (hq, d)
        assert lc.q.shape == lc.out.shape == (T, hq, d)
        assert lc.k_new.shape == lc.v_new.shape == (T, hkv, d)
        assert torch.isfinite(lc.keys).all() and torch.isfinite(lc.q).all()
    assert len(m["generated_ids"]) == capture.steps + 1


def test_fixture_is_the_models_attention(capture):
    """float64 attention over the captured tokens reproduces the model's own decode outputs (fp16 rounding only)."""
    for layer, check in F.capture_checks(capture).items():
        assert check["model_output_rel_err_max"] < 5e-3, (layer, check)


def test_full_budget_full_rank_equals_full_attention(capture, sweep):
    (run,) = [r for r in _runs(sweep, sweep["config"]["full_rank"]) if r["budget"] == "full"]
    for layer, entry in run["layers"].items():
        assert entry["rel_err_max"] < 1e-5, (layer, entry)
        assert entry["hit_rate"] == 1.0
        assert entry["mass_covered"] == pytest.approx(1.0, abs=1e-9)
        assert entry["attended_tokens"] == pytest.approx(capture.prompt_len + (capture.steps + 1) / 2)


def test_error_shrinks_as_budget_grows(sweep):
    runs = _runs(sweep, sweep["config"]["full_rank"])
    errors = [r["overall"]["rel_err_mean"] for r in runs]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    # Selection is top-k of one score, so a larger budget attends to a superset: covered mass never falls.
    for layer in runs[0]["layers"]:
        mass = [r["layers"][layer]["mass_covered"] for r in runs]
        assert all(a <= b + 1e-12 for a, b in zip(mass, mass[1:])), (layer, mass)
        for r in runs:
            assert r["layers"][layer]["mass_covered"] <= r["layers"][layer]["mass_oracle"] + 1e-12


def test_hit_rates_in_unit_interval_and_match_store_stats(sweep):
    for run in sweep["runs"]:
        assert 0.0 <= run["overall"]["hit_rate"] <= 1.0
        assert run["overall"]["hit_rate"] == pytest.approx(run["store_stats"]["hit_rate"], abs=1e-12)
        for entry in run["layers"].values():
            assert 0.0 <= entry["hit_rate"] <= 1.0


def test_energy_rank_monotone(capture, sweep):
    full_rank = sweep["config"]["full_rank"]
    for layer, e in sweep["energy"].items():
        ranks = [e["rank_for"][f] for f in ("0.95", "0.99", "0.999")]
        assert 1 <= ranks[0] <= ranks[1] <= ranks[2] <= full_rank, (layer, ranks)
        assert e["key_error_at_rank"][str(full_rank)] == 0.0
        assert e["output_err_at_rank"][str(full_rank)] < 1e-9
    lc = next(iter(capture.layers.values()))
    pre = F.unrope(lc.keys, torch.arange(lc.prompt_len), torch.tensor(capture.meta["inv_freq"]),
                   capture.meta["attention_scaling"])
    kept = F.energy_ranks(pre, ranks=range(1, full_rank + 1))["kept_at_rank"]
    values = [kept[str(r)] for r in range(1, full_rank + 1)]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:])) and values[-1] == pytest.approx(1.0)


def test_store_rank_error_matches_float64_low_rank_attention(sweep):
    """At full budget only the rank is approximate: the store's error equals full attention (float64) over rank-r
    context keys with the store's outlier chunks exact."""
    half = sweep["config"]["ranks"][1]
    (run,) = [r for r in _runs(sweep, half) if r["budget"] == "full"]
    for layer, entry in run["layers"].items():
        expected = sweep["energy"][layer]["output_err_at_rank_outliers_exact"][str(half)]
        assert expected > 1e-4  # the rank really is lossy here
        assert entry["rel_err_mean"] == pytest.approx(expected, rel=5e-3, abs=1e-4), (layer, entry, expected)


def test_save_load_roundtrip(capture, tmp_path):
    path = tmp_path / "again.npz"
    F.save_capture(capture, path)
    again = F.load_capture(path)
    assert sorted(again.layers) == sorted(capture.layers)
    for layer, lc in capture.layers.items():
        torch.testing.assert_close(again.layers[layer].keys, lc.keys, rtol=0, atol=0)  # fp16 -> fp16 is exact
        torch.testing.assert_close(again.layers[layer].q, lc.q, rtol=0, atol=0)


def test_table_mentions_every_run(sweep):
    text = F.format_tables(sweep)
    assert text.count("\n| ") >= len(sweep["runs"]) * 2
    assert "rank@0.99" in text


# ---------------------------------------------------------------------------------------------------------------------
# maths
# ---------------------------------------------------------------------------------------------------------------------

def test_energy_ranks_known_spectrum():
    g = torch.Generator().manual_seed(7)
    u = torch.linalg.qr(torch.randn(200, 16, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64)).Q
    sv = torch.tensor([10.0, 5.0, 2.0, 1.0] + [0.01] * 12, dtype=torch.float64)
    k = (u * sv) @ v.T
    e = F.energy_ranks(k.reshape(200, 2, 8), fractions=(0.5, 0.99, 0.9999999), ranks=(1, 4, 16))
    total = float((sv ** 2).sum())
    assert e["rank_for"] == {"0.5": 1, "0.99": 3, "0.9999999": 16} or e["rank_for"]["0.99"] == 3
    assert e["kept_at_rank"]["1"] == pytest.approx(100.0 / total)
    assert e["key_error_at_rank"]["4"] == pytest.approx((12 * 1e-4 / total) ** 0.5)
    assert e["full_rank"] == 16


def test_rope_unrope_roundtrip_and_transformers_convention():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    pre = torch.randn(20, 2, 32, generator=g)
    pos = torch.arange(100, 120)
    post = F.rope(pre, pos, inv_freq)
    freqs = pos[:, None].float() * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)
    q_hf, k_hf = apply_rotary_pos_emb(pre.transpose(0, 1)[None], pre.transpose(0, 1)[None], emb.cos()[None],
                                      emb.sin()[None])
    torch.testing.assert_close(post.float(), k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.unrope(post, pos, inv_freq), pre.double(), rtol=1e-9, atol=1e-9)
    # partial rotary: dims past 2*len(inv_freq) pass through
    post_partial = F.rope(pre, pos, inv_freq[:8])
    torch.testing.assert_close(post_partial[..., 16:], pre[..., 16:].double())
    torch.testing.assert_close(F.unrope(post_partial, pos, inv_freq[:8]), pre.double(), rtol=1e-9, atol=1e-9)
    del transformers


# ---------------------------------------------------------------------------------------------------------------------
# the capture path on tiny random models
# ---------------------------------------------------------------------------------------------------------------------

def _tiny(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32,
                  max_position_embeddings=1024, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None)
    torch.manual_seed(99)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, num_hidden_layers=2,
                                                                       num_key_value_heads=2))
    elif family == "qwen3":  # k_norm before the head transpose
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, num_hidden_layers=2,
                                                                       num_key_value_heads=2))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, num_hidden_layers=4, num_key_value_heads=1, sliding_window=16, query_pre_attn_scalar=48,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=False))
    model.set_attn_implementation("sdpa")
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_capture_tiny_model(family, tmp_path):
    model = _tiny(family)
    full_layers = F.full_attention_layers(model)
    assert full_layers == ([1, 3] if family == "gemma3" else [0, 1])
    ids = torch.randint(3, 256, (1, 83), generator=torch.Generator().manual_seed(5))
    steps = 6
    cap = F.capture_model(model, ids, steps=steps)
    assert model.config._attn_implementation == "sdpa"
    assert sorted(cap.layers) == full_layers
    # The capture loop generates what model.generate generates.
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                             do_sample=False)
    assert cap.meta["generated_ids"] == ref[0, ids.shape[1]:].tolist()
    m = cap.meta
    for lc in cap.layers.values():
        assert lc.keys.shape == (83, m["num_kv_heads"], 32) and lc.q.shape == (steps, 4, 32)
        assert lc.keys_pre is not None and lc.keys_pre.shape == lc.keys.shape
    for layer, check in F.capture_checks(cap).items():
        assert check["model_output_rel_err_max"] < 1e-5, (layer, check)
        assert check["unrope_rel_err"] < 1e-5, (layer, check)
    result = F.evaluate(cap, budgets=[8, 16, "full"], ranks=["full", 8], outlier_chunks=1, local_chunks=2)
    full = [r for r in result["runs"] if r["budget"] == "full" and r["rank"] == result["config"]["full_rank"]][0]
    assert full["overall"]["rel_err_max"] < 1e-5
    for run in result["runs"]:
        assert 0.0 <= run["overall"]["hit_rate"] <= 1.0
    small = [r for r in result["runs"] if r["budget"] == 8 and r["rank"] == 8][0]
    assert small["overall"]["rel_err_mean"] > 1e-3  # the store's approximation is exercised
    # save (fp16) / load, then the same evaluation at full budget and rank still matches full attention
    size = F.save_capture(cap, tmp_path / "tiny.npz", keys_pre=True)
    assert size < 200_000
    again = F.load_capture(tmp_path / "tiny.npz")
    assert again.layers[full_layers[0]].keys_pre is not None
    res2 = F.evaluate(again, budgets=["full"], ranks=["full"], outlier_chunks=1, local_chunks=2)
    assert res2["runs"][0]["overall"]["rel_err_max"] < 1e-5


def test_capture_rejects_sliding_layer():
    model = _tiny("gemma3")
    with pytest.raises(ValueError, match="not full-attention"):
        F.capture_model(model, torch.arange(3, 40)[None], layers=[0], steps=1)


def test_haystack_prompt_length():
    class Tok:  # a byte-level stand-in tokenizer
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([1] if add_special_tokens else []) + list(text.encode("utf-8"))}

    if not os.path.isdir(F.LICENSES_DIR):
        pytest.skip(f"{F.LICENSES_DIR} is missing")
    ids = F.haystack_ids(Tok(), 3000)
    assert ids.shape == (1, 3000) and ids[0, 0] == 1
    assert bytes(ids[0, -len(F.PROMPT_SUFFIX.encode()):].tolist()).decode() == F.PROMPT_SUFFIX


def test_extend_replay(capture):
    """--extend-block: blocks of one token are the decode replay; at full rank and budget any block is full attention;
    larger blocks at a small budget cost accuracy (docs/eval.md measures how much)."""
    full_rank = capture.meta["num_kv_heads"] * capture.meta["head_dim"]
    decode = F.evaluate(capture, budgets=[64, "full"], ranks=["full"], mass=False, **SMALL)
    ones = F.evaluate(capture, budgets=[64, "full"], ranks=["full"], extend_block=1, **SMALL)
    blocks = F.evaluate(capture, budgets=[64, "full"], ranks=["full"], extend_block=8, **SMALL)
    for a, b in zip(decode["runs"], ones["runs"]):
        assert a["overall"]["rel_err_mean"] == b["overall"]["rel_err_mean"]
    (full,) = [r for r in blocks["runs"] if r["budget"] == "full"]
    assert full["overall"]["rel_err_max"] < 1e-5 and full["rank"] == full_rank
    (small,) = [r for r in blocks["runs"] if r["budget"] == 64]
    assert 0.0 < small["overall"]["rel_err_mean"] < 1.0
