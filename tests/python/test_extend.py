"""KVStore.extend and KVStore.truncate from Python (docs/semantics.md, "Extend" and "Truncate").

The C++ suite (tests/cpp/test_extend.cpp) proves the equalities on five store variants; these tests hold the Python
surface to them: extend of one token is decode, extend at full rank and budget is causal full attention (torch SDPA),
truncate equals a store that never saw the tokens, and bad input raises ValueError changing nothing.
"""

from __future__ import annotations

import pytest
import torch

from helpers import generator, make_store, small_config


def _assert_same_output(x, y, device, what):
    """Bit for bit on the CPU (its attention sums the selected chunks in chunk order); on CUDA the attention sums them
    in cache-slot order, which a truncate may leave different from the other store's: equal up to float32 rounding."""
    if device == "cpu":
        assert torch.equal(x, y), what
    else:
        assert (x - y).abs().max().item() <= 1e-5 * max(1.0, y.abs().max().item()), what


def _prefilled(device, seed=0, **overrides):
    kw = small_config(device=device, max_batch=2, generation_window=16, extend_block=8, **overrides)
    store = make_store(kw)
    slots = store.add_sequences(2)
    g = generator(seed)
    keys = torch.randn(2, 90, 2, 64, generator=g)
    values = torch.randn(2, 90, 2, 64, generator=g)
    for layer in range(kw["num_layers"]):
        store.prefill(layer, slots, keys.to(device), values.to(device), lengths=[90, 71], keys_post_rope=True)
    return store, slots, kw, keys, values


def _tokens(g, batch, tokens, device):
    q = torch.randn(batch, tokens, 4, 64, generator=g)
    k = torch.randn(batch, tokens, 2, 64, generator=g)
    v = torch.randn(batch, tokens, 2, 64, generator=g)
    return q.to(device), k.to(device), v.to(device)


def test_extend_of_one_token_is_decode(device):
    a, slots, _, _, _ = _prefilled(device)
    b, _, _, _, _ = _prefilled(device)
    g = generator(1)
    for step in range(30):  # folds every 8 tokens once 16 are exact
        q, k, v = _tokens(g, 2, 1, device)
        x = a.extend(0, slots, q, k, v)
        y = b.decode(0, slots, q[:, 0], k[:, 0], v[:, 0])
        assert torch.equal(x[:, 0], y), f"step {step}"
        assert a.selected_chunks(0, 0) == b.selected_chunks(0, 0)
    assert a.stats() == b.stats()
    assert a.stats()["folds"] > 0


@pytest.mark.parametrize("tokens", [2, 9, 37])
def test_extend_is_causal_full_attention_at_full_rank_and_budget(device, tokens):
    store, slots, _, keys, values = _prefilled(device, seed=2, rank=128, budget=1024)
    g = generator(3)
    q, k, v = _tokens(g, 2, tokens, device)
    out = store.extend(0, slots, q, k, v, lengths=[tokens, max(1, tokens - 1)])
    for b, (prompt, new) in enumerate([(90, tokens), (71, max(1, tokens - 1))]):
        key = torch.cat([keys[b, :prompt], k[b, :new].cpu()]).transpose(0, 1).double()  # [Hkv, S + T, D]
        value = torch.cat([values[b, :prompt], v[b, :new].cpu()]).transpose(0, 1).double()
        query = q[b, :new].cpu().transpose(0, 1).double()  # [Hq, T, D]
        mask = torch.ones(new, prompt + new, dtype=torch.bool).tril(prompt)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 0), value.repeat_interleave(2, 0), attn_mask=mask)
        got = out[b, :new].cpu().transpose(0, 1).double()
        assert (got - expected).abs().max().item() < 2e-4, f"row {b}"
        assert out[b, new:].abs().sum().item() == 0.0  # rows past the length stay zero


def test_truncate_equals_a_store_that_never_saw_the_tokens(device):
    a, slots, kw, _, _ = _prefilled(device, seed=4, num_layers=2)
    b, _, _, _, _ = _prefilled(device, seed=4, num_layers=2)
    g = generator(5)
    q, k, v = _tokens(g, 2, 33, device)
    for layer in range(2):
        a.extend(layer, slots, q, k, v)  # 33 tokens: 3 folds with a window of 16
        b.extend(layer, slots, q[:, :17], k[:, :17], v[:, :17])
    assert a.memory_report()["fold_journal"] > 0
    with pytest.raises(ValueError, match="at most 16 tokens can be removed now"):
        a.truncate(slots, 21)  # would undo 3 folds; the journal keeps W / C = 2
    a.truncate(slots, 16)
    for layer in range(2):
        for slot in slots:
            assert a.sequence_info(layer, slot) == b.sequence_info(layer, slot)
    for name in ("low_rank_factors", "landmarks", "exact_tokens", "value_store"):
        assert a.memory_report()[name] == b.memory_report()[name], name
    for step in range(20):
        q1, k1, v1 = _tokens(g, 2, 1, device)
        for layer in range(2):
            x = a.decode(layer, slots, q1[:, 0], k1[:, 0], v1[:, 0])
            y = b.decode(layer, slots, q1[:, 0], k1[:, 0], v1[:, 0])
            _assert_same_output(x, y, device, f"step {step} layer {layer}")
            assert a.selected_chunks(layer, 0) == b.selected_chunks(layer, 0)
            assert x.norm().item() > 0.1


def test_bad_input_changes_nothing(device):
    store, slots, _, _, _ = _prefilled(device, seed=6)
    g = generator(7)
    q, k, v = _tokens(g, 2, 5, device)
    store.extend(0, slots, q, k, v)
    before = (store.memory_report(), store.stats(), [store.sequence_info(0, s) for s in slots])

    def same():
        return (store.memory_report(), store.stats(), [store.sequence_info(0, s) for s in slots]) == before

    with pytest.raises(ValueError, match="at least one new token"):
        store.extend(0, slots, q[:, :0], k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="lengths"):
        store.extend(0, slots, q, k, v, lengths=[5, 6])
    with pytest.raises(ValueError, match="max_seq_len"):
        big = _tokens(g, 2, 1000, device)
        store.extend(0, slots, *big)
    with pytest.raises(ValueError, match="prompt cannot be truncated"):
        store.truncate(slots, [6, 1])
    with pytest.raises(ValueError, match=">= 0"):
        store.truncate(slots, -1)
    with pytest.raises(ValueError, match="one entry per slot"):
        store.truncate(slots, [1])
    assert same()
    store.truncate(slots, 0)
    assert same()


def test_extend_takes_numpy_and_positions(device):
    if device != "cpu":
        pytest.skip("numpy arrays live on the host")
    import numpy as np

    store, slots, _, _, _ = _prefilled(device, seed=8)
    g = generator(9)
    q, k, v = (t.numpy() for t in _tokens(g, 2, 4, device))
    positions = np.arange(500, 504, dtype=np.int64)[None].repeat(2, 0)
    out = store.extend(0, slots, q, k, v, positions=positions)
    assert isinstance(out, np.ndarray) and out.shape == (2, 4, 4, 64)
    assert store.sequence_info(0, 0)["last_position"] == 503


@pytest.mark.parametrize("dtype,tolerance", [("float32", 2e-4), ("bfloat16", 3e-2)])
def test_cuda_extend_and_truncate_match_the_cpu_backend(dtype, tolerance):
    """The CUDA backend's extend (block attention through cuBLAS) and truncate against the CPU reference, at a small
    budget (selection matters) with ragged lengths and folds on the way."""
    import shadowkv_core

    if "cuda" not in shadowkv_core.build_info()["backends"] or not torch.cuda.is_available():
        pytest.skip("needs the CUDA backend and a GPU")
    outputs = {}
    for device in ("cpu", "cuda"):
        store, slots, _, _, _ = _prefilled(device, seed=11, num_layers=2, dtype=dtype)
        g = generator(12)
        results = []
        for tokens, lengths in ((37, [37, 20]), (5, [5, 3]), (1, [1, 1])):
            q, k, v = _tokens(g, 2, tokens, device)
            for layer in range(2):
                q_, k_, v_ = (t.to(getattr(torch, dtype)) for t in (q, k, v))
                results.append(store.extend(layer, slots, q_, k_, v_, lengths=lengths).float().cpu())
        store.truncate(slots, [9, 4])
        for layer in range(2):
            results.append(torch.tensor([store.sequence_info(layer, s)["last_position"] for s in slots]).float())
            q, k, v = _tokens(g, 2, 1, device)
            q_, k_, v_ = (t.to(getattr(torch, dtype)) for t in (q, k, v))
            results.append(store.decode(layer, slots, q_[:, 0], k_[:, 0], v_[:, 0]).float().cpu())
        outputs[device] = (results, [store.selected_chunks(l, s) for l in range(2) for s in slots],
                           store.memory_report()["fold_journal"], store.stats()["folds"])
    cpu, gpu = outputs["cpu"], outputs["cuda"]
    for i, (x, y) in enumerate(zip(cpu[0], gpu[0])):
        scale = max(1.0, x.abs().max().item())
        assert (x - y).abs().max().item() <= tolerance * scale, f"result {i}"
        assert x.norm().item() > 0
    assert cpu[1] == gpu[1]
    assert cpu[2] == gpu[2] and cpu[3] == gpu[3]
