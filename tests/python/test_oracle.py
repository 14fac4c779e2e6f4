"""The best-possible chunk selection of the accuracy harness (``shadowkv_core.evaluation.oracle``).

* `oracle_attention_forward` against a loop-by-loop reference written here: per (KV head, query token) the softmax
  over all earlier keys, each whole prompt chunk's mass averaged over the group's query heads, the sink and local
  chunks always kept, the `chosen_chunks` others with the most mass, every token after the last whole prompt chunk;
  then the exact softmax over that set (several query tokens at once, as a conversation's next turn feeds them).
* With as many chosen chunks as the prompt has, it is full causal attention.
* Through the harness (`--selection oracle`, tiny random Llama and Gemma-3 models): the oracle path runs on the
  store's layers only, the records say `selection: oracle`, and at a budget covering the prompt the answers equal
  full attention's.
"""

from __future__ import annotations

import json

import pytest
import torch

from shadowkv_core.evaluation.oracle import OracleSpec, oracle_attention_forward


def _reference(query, key, value, spec: OracleSpec, scaling: float) -> torch.Tensor:
    """[B, q, Hq, D] by loops over (batch, KV head, query token), float64."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    chunk = spec.chunk_size
    whole = min(spec.prompt_length, total) // chunk
    out = torch.zeros(batch, q_len, q_heads, dim, dtype=torch.float64)
    q64, k64, v64 = query.double(), key.double(), value.double()
    for b in range(batch):
        for h in range(kv_heads):
            for i in range(q_len):
                position = total - q_len + i
                heads = range(h * group, (h + 1) * group)
                probs = {j: torch.softmax((k64[b, h, :position + 1] @ q64[b, j, i]) * scaling, dim=0) for j in heads}
                always = set(range(min(spec.sink_chunks, whole))) | set(range(max(0, whole - spec.local_chunks), whole))
                mass = {c: sum(float(probs[j][c * chunk:(c + 1) * chunk].sum()) for j in heads) / group
                        for c in range(whole) if c not in always and c * chunk <= position}
                ranked = sorted(mass, key=lambda c: -mass[c])[:spec.chosen_chunks]
                keep = always | set(ranked)
                allowed = [t for t in range(position + 1) if t >= whole * chunk or t // chunk in keep]
                for j in heads:
                    logits = (k64[b, h, allowed] @ q64[b, j, i]) * scaling
                    out[b, i, j] = torch.softmax(logits, dim=0) @ v64[b, h, allowed]
    return out


@pytest.mark.parametrize("q_len", [1, 3])
def test_oracle_matches_the_loop_reference(q_len):
    torch.manual_seed(5)
    batch, kv_heads, group, dim = 2, 2, 3, 8
    prompt, total = 70, 75 + q_len - 1  # 8 whole chunks and 6 tail tokens, then generated tokens
    query = torch.randn(batch, kv_heads * group, q_len, dim)
    key = torch.randn(batch, kv_heads, total, dim) * 1.5
    value = torch.randn(batch, kv_heads, total, dim)
    spec = OracleSpec(prompt_length=prompt, budget_tokens=16, chunk_size=8, outlier_chunks=3, sink_chunks=1,
                      local_chunks=2)
    assert spec.chosen_chunks == 4  # of the 5 chunks that are neither sink nor local
    out, weights = oracle_attention_forward(None, query, key, value, spec, scaling=0.4)
    assert weights is None and out.shape == (batch, q_len, kv_heads * group, dim)
    torch.testing.assert_close(out.double(), _reference(query, key, value, spec, 0.4), atol=1e-5, rtol=1e-5)


def test_oracle_with_every_chunk_is_full_attention():
    torch.manual_seed(6)
    query, key, value = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 90, 16), torch.randn(1, 2, 90, 16)
    spec = OracleSpec(prompt_length=80, budget_tokens=80, chunk_size=8, outlier_chunks=4, sink_chunks=1,
                      local_chunks=4)
    out, _ = oracle_attention_forward(None, query, key, value, spec, scaling=0.25)
    mask = torch.ones(2, 90, dtype=torch.bool).tril(diagonal=88)  # query tokens at positions 88 and 89
    full = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(2, 1),
                                                            value.repeat_interleave(2, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, full.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_bad_oracle_settings_are_rejected():
    with pytest.raises(ValueError, match="sink_chunks"):
        OracleSpec(prompt_length=10, budget_tokens=8, outlier_chunks=1, sink_chunks=2)
    with pytest.raises(ValueError, match="chunk_size"):
        OracleSpec(prompt_length=10, budget_tokens=8, chunk_size=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_harness_oracle_selection(tmp_path, monkeypatch, family):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import test_eval as te

    from shadowkv_core.evaluation import accuracy as ev
    from shadowkv_core.evaluation import haystack, oracle

    monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: te.HAYSTACK)
    calls = []
    real = oracle.oracle_attention_forward

    def spy(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(oracle, "oracle_attention_forward", spy)
    tokenizer = te._tokenizer()
    model = (te._llama if family == "llama" else te._gemma3)(len(tokenizer))
    out = tmp_path / "run"
    assert ev.main(["--tasks", "niah,multiturn", "--lengths", "400", "--depths", "0.5", "--samples", "1",
                    "--budgets", "16,200%", "--selection", "oracle", "--max-new-tokens", "4", "--no-plots",
                    "--out", str(out)], model=model, tokenizer=tokenizer) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["selection"] == "oracle" and results["complete"]
    store_layers = {1, 3} if family == "gemma3" else {0, 1}  # Gemma-3's sliding layers stay dense
    assert calls and set(calls) == store_layers
    for rec in results["records"]:
        assert [r["selection"] for r in rec["store"]] == ["oracle", "oracle"]
        # a budget covering the prompt: every chunk chosen, so full attention's answers
        assert rec["store"][1]["answers"] == rec["full"]["answers"], rec["task"]
