"""End to end through a whole (tiny, random) Llama-family decoder: examples/llama_decoder.py over a dense KV cache
and over a KVStore.

(a) full rank (rank = Hkv*D) and a budget covering every chunk: each decode step's logits equal the dense cache's
    (relative error <= 1e-4 in float32 on the CPU, 1e-3 on CUDA) and greedy tokens are identical for 20 steps; with a
    generation window of 8 the generated tokens are folded into the compressed store along the way (still exact at
    full rank). The prefill's logits are equal too (both run the same SDPA over the prompt).
(b) ragged batch: three prompts of different lengths join one at a time and decode together (as a contiguous slot
    range, and in reversed slot order, which takes the dense cache's per-sequence path); every step equals each
    sequence decoded alone in its own cache (relative 1e-5 on the CPU) and the tokens are identical — for the dense
    cache, the store at full budget and the store at a small budget.
(c) a small budget (2 chunks, rank 8 of 32): logits are finite, not zero, differ from full attention (the budget is
    in effect), and the store counted every decode call.

Model: LlamaConfig.tiny (hidden 64, 2 layers, 4 q / 2 kv heads, head_dim 16, vocab 97), float32, prompts 83-200
tokens, seeded weights and prompts. Runs on the devices of SHADOWKV_TEST_DEVICES (conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from helpers import rel_err

_EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "llama_decoder.py")


def _load_example():
    spec = importlib.util.spec_from_file_location("llama_decoder", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


L = _load_example()
CFG = L.LlamaConfig.tiny()
FULL_RANK = CFG.num_kv_heads * CFG.head_dim
MAX_SEQ = 256
STEPS = 20
SEED = 1234


def tolerance(device) -> float:
    return 1e-4 if device == "cpu" else 1e-3


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    return {}


def model_on(models, device):
    if device not in models:
        models[device] = L.LlamaModel(CFG, device, torch.float32, seed=SEED, prefill_chunk=64)
    return models[device]


def full_decoder(model, max_batch=4):
    return L.LlamaDecoder(model, L.FullAttentionCache(CFG, max_batch, MAX_SEQ, model.device, model.dtype))


STORE_FULL = dict(rank=FULL_RANK, chunk_size=8, budget=MAX_SEQ, outlier_chunks=1, local_chunks=1,
                  generation_window=32)
STORE_SMALL = dict(rank=8, chunk_size=8, budget=16, outlier_chunks=1, local_chunks=1, generation_window=16)


def store_decoder(model, max_batch=4, **kw):
    return L.LlamaDecoder(model, L.ShadowKVCache(model, max_batch=max_batch, max_seq_len=MAX_SEQ, **kw))


@pytest.mark.parametrize("length,window", [(83, 32), (200, 32), (150, 8)])
def test_full_rank_full_budget_equals_full_attention(device, models, length, window):
    model = model_on(models, device)
    p = prompt(length, SEED + length)
    full = full_decoder(model)
    store = store_decoder(model, **dict(STORE_FULL, generation_window=window))
    (slot_f,), tokens_f, logits_f = L.generate(full, [p], STEPS, return_logits=True)
    (slot_s,), tokens_s, logits_s = L.generate(store, [p], STEPS, return_logits=True)
    tol = tolerance(device)
    ctx = f"(length={length}, window={window}, seed={SEED})"
    assert rel_err(store.prompt_logits[slot_s], full.prompt_logits[slot_f]) <= tol, f"prefill logits {ctx}"
    assert logits_s.shape == (STEPS - 1, 1, CFG.vocab_size)
    for i in range(STEPS - 1):
        err = rel_err(logits_s[i], logits_f[i])
        assert err <= tol, f"decode step {i}: logits relative error {err:.3g} > {tol} {ctx}"
    assert torch.equal(tokens_s, tokens_f), f"greedy tokens differ {ctx}: {tokens_s.tolist()} vs {tokens_f.tolist()}"
    assert torch.unique(tokens_f).numel() > 1, f"degenerate test: one token repeated {ctx}"
    stats = store.cache.store.stats()
    assert stats["decode_steps"] == (STEPS - 1) * CFG.num_layers
    if window < STEPS:
        assert stats["folds"] > 0, f"expected folded generated chunks {ctx}: {stats}"


RAGGED = [(83, 11), (150, 12), (117, 13)]


@pytest.mark.parametrize("order", ["ascending", "reversed"])
@pytest.mark.parametrize("kind", ["full", "store_full_budget", "store_small_budget"])
def test_ragged_batch_equals_each_alone(device, models, kind, order):
    model = model_on(models, device)
    prompts = [prompt(n, s) for n, s in RAGGED]

    def make():
        if kind == "full":
            return full_decoder(model)
        return store_decoder(model, **(STORE_FULL if kind == "store_full_budget" else STORE_SMALL))

    together = make()
    slots = [together.add_sequence(p) for p in prompts]  # one at a time, each prefilled alone
    assert len(set(slots)) == 3
    if order == "reversed":
        slots, prompts = slots[::-1], prompts[::-1]
    token = torch.stack([together.prompt_logits[s].argmax() for s in slots])
    batch_logits, batch_tokens = [], [token.cpu()]
    for _ in range(STEPS - 1):
        step = together.decode_step(slots, token)
        token = step.argmax(-1)
        batch_logits.append(step.cpu())
        batch_tokens.append(token.cpu())
    batch_tokens = torch.stack(batch_tokens, dim=1)
    assert [together.cache.length(s) for s in slots] == [p.numel() + STEPS - 1 for p in prompts]

    tol = 1e-5 if device == "cpu" else 1e-3
    for b, p in enumerate(prompts):
        _, tokens_alone, logits_alone = L.generate(make(), [p], STEPS, return_logits=True)
        ctx = f"(kind={kind}, order={order}, prompt {p.numel()} tokens, seed={SEED})"
        for i in range(STEPS - 1):
            err = rel_err(batch_logits[i][b], logits_alone[i][0])
            assert err <= tol, f"step {i}: batched vs alone relative error {err:.3g} {ctx}"
        assert torch.equal(batch_tokens[b], tokens_alone[0]), f"tokens differ {ctx}"

    for s in slots:
        together.release(s)
    assert together.cache.active_slots == []


def test_small_budget_runs_and_is_nontrivial(device, models):
    model = model_on(models, device)
    prompts = [prompt(n, s) for n, s in RAGGED]
    store = store_decoder(model, **STORE_SMALL)
    full = full_decoder(model)
    _, tokens_s, logits_s = L.generate(store, prompts, STEPS, return_logits=True)
    _, _, logits_f = L.generate(full, prompts, STEPS, return_logits=True)
    assert torch.isfinite(logits_s).all(), "non-finite logits"
    assert float(logits_s.abs().max()) > 0, "logits are all zero"
    assert float(logits_s.std(dim=-1).min()) > 0, "constant logits"
    assert ((tokens_s >= 0) & (tokens_s < CFG.vocab_size)).all()
    # rank 8 of 32 and 2 selected chunks: the store must not be secretly attending to everything
    assert rel_err(logits_s, logits_f) > 1e-4, "small budget gives full attention's logits"
    stats = store.cache.store.stats()
    assert stats["decode_steps"] == (STEPS - 1) * CFG.num_layers
    assert 0.0 <= stats["hit_rate"] <= 1.0
    report = store.cache.store.memory_report()
    assert report["value_store"] > 0 and report["low_rank_factors"] > 0
