"""Planted structure the store must find.

* A needle: one context chunk per KV head whose keys all point along the query's direction. It must be selected
  (after a decode step, and already after prefill when the query is given as q_last) and its value must dominate
  the output: the output equals the needle's value to <= 1e-3 relative (its softmax weight is 1 - e^-100 or so,
  and its keys dominate the spectrum so rank 64 rebuilds them; the reference is 3e-8 away).
* An outlier: one context chunk per KV head whose keys point in opposite directions (+w, -w), so its landmark is
  nearly orthogonal to its members. It must be that head's outlier (the background chunks have min-cosine ~0.8),
  never be selected, and be attended with its exact keys: a query along +w returns the +w tokens' value to 1e-4
  although the rank is far too small to rebuild those keys.
Keys are given post-RoPE so the planted directions are the ones the landmarks see.
"""

import torch

from helpers import (assert_nontrivial, decode_one, generator, make_reference, make_store, orthonormal, prefill_one,
                     rel_err, small_config)

HQ, HKV, D, C, PROMPT = 4, 2, 64, 8, 256            # 32 chunks, 2 local -> 30 context chunks
NEEDLE_CHUNK = {0: 11, 1: 17}                      # per KV head
OUTLIER_CHUNK = {0: 5, 1: 22}


def background(g, kw, n_tokens, dirs):
    """Post-RoPE keys ``[T, Hkv, D]``: a per-head common direction (norm 16) plus noise (0.5 per element)."""
    k = 0.5 * torch.randn(n_tokens, HKV, D, generator=g, dtype=torch.float64)
    for h in range(HKV):
        k[:, h] += 16.0 * dirs[h]
    return k


def test_needle_is_selected_and_dominates(device):
    seed = 5000
    g = generator(seed)
    kw = small_config(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rank=64, chunk_size=C, budget=32,
                      outlier_chunks=2, local_chunks=2, generation_window=64, device=device)
    dirs = orthonormal(g, D, 2 * HKV)               # rows 0..1: background per head, 2..3: needle per head
    keys = background(g, kw, PROMPT + 2, dirs)
    values = torch.randn(PROMPT + 2, HKV, D, generator=g, dtype=torch.float64)
    needle_value = torch.empty(HKV, D, dtype=torch.float64)
    for h, c in NEEDLE_CHUNK.items():
        u = dirs[HKV + h]
        keys[c * C:(c + 1) * C, h] = 48.0 * u + 0.1 * torch.randn(C, D, generator=g, dtype=torch.float64)
        needle_value[h] = 4.0 * torch.randn(D, generator=g, dtype=torch.float64)
        values[c * C:(c + 1) * C, h] = needle_value[h]
    keys, values = keys.float(), values.float()
    q = torch.empty(HQ, D, dtype=torch.float64)
    for j in range(HQ):
        q[j] = 48.0 * dirs[HKV + j // (HQ // HKV)]
    q = q.float()

    store = make_store(kw)
    slot_a, slot_b = store.add_sequences(2)
    # slot a: plain prefill, then one decode step
    prefill_one(store, 0, slot_a, keys[:PROMPT], values[:PROMPT], keys_post_rope=True, device=device)
    out = decode_one(store, 0, slot_a, q, keys[PROMPT], values[PROMPT], device=device)
    assert_nontrivial(out, "needle output", seed)
    selected = store.selected_chunks(0, slot_a)
    for h, c in NEEDLE_CHUNK.items():
        assert c in selected[h], f"head {h}: needle chunk {c} not selected: {selected[h]} (seed={seed})"
        assert len(selected[h]) == 4, f"head {h}: budget 32 tokens = 4 chunks, got {selected[h]} (seed={seed})"
        assert c not in store.outlier_chunks(0, slot_a)[h], f"head {h}: the needle became an outlier (seed={seed})"
    expected = needle_value.repeat_interleave(HQ // HKV, dim=0)
    err = rel_err(out, expected)
    assert err <= 1e-3, f"output is {err:.3g} (relative) away from the needle's value (seed={seed})"

    # slot b: the same prompt with the needle query as q_last: the needle is selected right after prefill
    prefill_one(store, 0, slot_b, keys[:PROMPT], values[:PROMPT], q_last=q, keys_post_rope=True, device=device)
    selected = store.selected_chunks(0, slot_b)
    for h, c in NEEDLE_CHUNK.items():
        assert c in selected[h], f"head {h}: needle chunk {c} not selected by q_last: {selected[h]} (seed={seed})"
    store.reset_stats()
    out_b = decode_one(store, 0, slot_b, q, keys[PROMPT], values[PROMPT], device=device)
    assert rel_err(out_b, expected) <= 1e-3, f"q_last path: output not the needle's value (seed={seed})"
    st = store.stats()
    assert st["misses"] == 0 and st["hits"] == sum(len(s) for s in selected), (
        f"the warm-up selection should make the first decode step all hits: {st} (seed={seed})")


def test_opposite_keys_make_an_outlier_attended_exactly(device):
    seed = 5100
    g = generator(seed)
    kw = small_config(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rank=8, chunk_size=C, budget=32,
                      outlier_chunks=1, sink_chunks=0, local_chunks=2, generation_window=64, device=device)
    dirs = orthonormal(g, D, 2 * HKV)
    keys = background(g, kw, PROMPT + 1, dirs)
    values = torch.randn(PROMPT + 1, HKV, D, generator=g, dtype=torch.float64)
    plus_value = torch.empty(HKV, D, dtype=torch.float64)
    for h, c in OUTLIER_CHUNK.items():
        w = dirs[HKV + h]
        signs = torch.tensor([1.0, -1.0] * (C // 2), dtype=torch.float64)
        keys[c * C:(c + 1) * C, h] = 48.0 * signs[:, None] * w + 0.5 * torch.randn(C, D, generator=g,
                                                                                   dtype=torch.float64)
        plus_value[h] = 4.0 * torch.randn(D, generator=g, dtype=torch.float64)
        values[c * C:(c + 1) * C:2, h] = plus_value[h]          # the +w tokens
    keys, values = keys.float(), values.float()

    ref = make_reference(kw)
    ref.prefill(keys[:PROMPT], values[:PROMPT], keys_post_rope=True)
    for h, c in OUTLIER_CHUNK.items():     # the data is what the test says it is
        others = torch.cat([ref.min_cos[:c, h], ref.min_cos[c + 1:, h]])
        assert ref.min_cos[c, h] < 0.3 and others.min() > 0.6, f"bad test data (seed={seed})"

    store = make_store(kw)
    slot = store.add_sequences(1)[0]
    prefill_one(store, 0, slot, keys[:PROMPT], values[:PROMPT], keys_post_rope=True, device=device)
    outliers = store.outlier_chunks(0, slot)
    assert outliers == [[OUTLIER_CHUNK[h]] for h in range(HKV)], (
        f"outliers {outliers}, planted {OUTLIER_CHUNK} (seed={seed})")

    q = torch.empty(HQ, D, dtype=torch.float64)
    for j in range(HQ):
        q[j] = 48.0 * dirs[HKV + j // (HQ // HKV)]
    out = decode_one(store, 0, slot, q.float(), keys[PROMPT], values[PROMPT], device=device)
    assert_nontrivial(out, "outlier output", seed)
    for h, c in OUTLIER_CHUNK.items():
        assert c not in store.selected_chunks(0, slot)[h], f"head {h}: outlier chunk {c} was selected (seed={seed})"
    expected = plus_value.repeat_interleave(HQ // HKV, dim=0)
    err = rel_err(out, expected)
    assert err <= 1e-4, (f"output {err:.3g} (relative) away from the +w tokens' value: the outlier chunk is not "
                         f"attended with its exact keys (seed={seed})")
    # and rank 8 really cannot rebuild those keys: the low-rank reconstruction of the chunk is far off
    c0 = OUTLIER_CHUNK[0]
    rebuilt = ref.rebuild_keys([c0], 0)[0]
    exact = ref.outlier_keys[c0, :, 0]
    assert rel_err(rebuilt, exact) > 0.1, f"rank 8 rebuilds the outlier too well for this test (seed={seed})"


def test_exact_ties_go_to_the_smaller_chunk_id(device):
    """Identical chunks tie exactly (same landmark, same min-cosine, same score): outliers and selections take the
    smaller chunk id first. Keys are zero in the rotary dims (rotary_dim 2), so un-RoPE/RoPE is exact and the tie
    survives the store's round trip."""
    seed = 5200
    g = generator(seed)
    n_chunks = 12                                          # + 1 local chunk
    kw = small_config(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rotary_dim=2, rank=16, chunk_size=C, budget=C,
                      outlier_chunks=1, sink_chunks=0, local_chunks=1, generation_window=64, device=device)
    base = torch.randn(C, HKV, D, generator=g)             # one pattern for every plain chunk
    base[..., :2] = 0
    strong_dir = torch.zeros(HKV, D)
    strong_dir[:, 2:] = torch.randn(HKV, D - 2, generator=g)
    strong = base + 2.0 * strong_dir                        # chunks 6 and 8
    signs = torch.tensor([1.0, -1.0] * (C // 2))[:, None, None]
    opposite = signs * 3.0 * base.sum(0, keepdim=True)      # chunks 3 and 7: min-cosine -1, the outlier candidates
    keys = base.repeat(n_chunks + 1, 1, 1)
    for c, block in ((6, strong), (8, strong), (3, opposite), (7, opposite)):
        keys[c * C:(c + 1) * C] = block
    values = torch.randn(keys.shape, generator=g)
    q = torch.zeros(HQ, D)
    for j in range(HQ):
        q[j] = 0.05 * strong_dir[j // (HQ // HKV)]
    k_new, v_new = keys[:1].clone()[0], values[:1].clone()[0]

    for budget, expected in ((C, [6]), (3 * C, [0, 6, 8]), (5 * C, [0, 1, 2, 6, 8])):
        store = make_store(dict(kw, budget=budget))
        slot = store.add_sequences(1)[0]
        prefill_one(store, 0, slot, keys, values, keys_post_rope=True, device=device)
        assert store.outlier_chunks(0, slot) == [[3]] * HKV, (
            f"outliers {store.outlier_chunks(0, slot)}: chunks 3 and 7 tie, 3 must win (seed={seed})")
        out = decode_one(store, 0, slot, q, k_new, v_new, device=device)
        assert_nontrivial(out, "decode output", seed)
        assert store.selected_chunks(0, slot) == [expected] * HKV, (
            f"budget {budget // C} chunks: selected {store.selected_chunks(0, slot)}, expected {expected} per head "
            f"(ties to the smaller chunk id) (seed={seed})")
