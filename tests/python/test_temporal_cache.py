"""The selection cache (temporal cache) of docs/semantics.md, Decode 6.

Planted data: in every KV head, context chunks 0-7 point along ``u`` and chunks 8-14 along ``v`` (u ⟂ v) with
graded strengths, chunk 15 is an outlier (opposite keys). A query along ``u`` selects 4 chunks of the first group,
one along ``v`` 4 of the second: the same query twice gives 100% hits and rebuilds nothing; switching gives 0% hits.
The cache is per (layer, slot, KV head): another layer, slot or head selecting something else evicts nothing.
Outputs are compared with the reference as well (relative error <= 5e-4), so a cache that keeps stale keys fails.
"""

import torch

from helpers import (assert_nontrivial, decode_one, generator, make_reference, make_store, orthonormal, prefill_one,
                     rel_err, small_config)

HQ, HKV, D, C = 4, 2, 64, 8
PROMPT = 17 * C                      # 16 context chunks + 1 local chunk
K_CHUNKS = 4                         # budget 32 tokens


def config(device, **kw):
    return small_config(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rank=32, chunk_size=C,
                        budget=K_CHUNKS * C, outlier_chunks=1, sink_chunks=0, local_chunks=1, generation_window=64,
                        max_batch=2, device=device, **kw)


def planted(seed):
    """Post-RoPE keys/values ``[PROMPT + 16, Hkv, D]`` and the two directions ``u``, ``v``, ``w`` (outlier)."""
    g = generator(seed)
    u, v, w = orthonormal(g, D, 3)
    n = PROMPT + 16
    keys = 0.3 * torch.randn(n, HKV, D, generator=g, dtype=torch.float64)
    for c in range(16):
        if c < 8:
            keys[c * C:(c + 1) * C] += 8.0 * (1.0 + 0.1 * c) * u             # strengths 1.0 .. 1.7
        elif c < 15:
            keys[c * C:(c + 1) * C] += 8.0 * (1.05 + 0.1 * (c - 8)) * v      # strengths 1.05 .. 1.65
        else:
            signs = torch.tensor([1.0, -1.0] * (C // 2), dtype=torch.float64)
            keys[c * C:(c + 1) * C] += 16.0 * signs[:, None, None] * w
    keys[PROMPT - C:PROMPT] += 8.0 * u                                       # the local chunk
    values = torch.randn(n, HKV, D, generator=g, dtype=torch.float64)
    return keys.float(), values.float(), u, v


def query(dir_for_kv_head):
    """``[Hq, D]``: query heads of KV head h point along ``dir_for_kv_head[h]`` (norm 6)."""
    q = torch.stack([6.0 * dir_for_kv_head[j // (HQ // HKV)] for j in range(HQ)])
    return q.float()


TOP_U = [4, 5, 6, 7]                 # the 4 strongest u chunks
TOP_V = [11, 12, 13, 14]             # the 4 strongest v chunks
BYTES_PER_MISS = C * D * 4           # float32 values of one chunk of one head


class Harness:
    """A store and one reference per (layer, slot), decoding the planted data."""

    def __init__(self, device, seed):
        self.device, self.seed = device, seed
        self.keys, self.values, self.u, self.v = planted(seed)
        kw = config(device)
        self.store = make_store(kw)
        self.slots = self.store.add_sequences(2)
        self.refs = {}
        self.t = {}
        for layer in range(2):
            for slot in self.slots:
                prefill_one(self.store, layer, slot, self.keys[:PROMPT], self.values[:PROMPT], keys_post_rope=True,
                            device=device)
                ref = make_reference(kw)
                ref.prefill(self.keys[:PROMPT], self.values[:PROMPT], keys_post_rope=True)
                self.refs[layer, slot] = ref
                self.t[layer, slot] = PROMPT
        assert all(ref.outliers == [[15], [15]] for ref in self.refs.values()), f"bad test data (seed={seed})"

    def step(self, layer, slot, dirs):
        """One decode step; returns the stats delta of that step alone."""
        t = self.t[layer, slot]
        self.t[layer, slot] = t + 1
        q = query(dirs)
        self.store.reset_stats()
        out = decode_one(self.store, layer, slot, q, self.keys[t], self.values[t], device=self.device)
        ref_out = self.refs[layer, slot].decode(q, self.keys[t], self.values[t])
        assert_nontrivial(out, "decode output", self.seed)
        err = rel_err(out, ref_out)
        assert err <= 5e-4, f"layer {layer} slot {slot}: output error {err:.3g} vs reference (seed={self.seed})"
        return self.store.stats()

    def selected(self, layer, slot):
        return self.store.selected_chunks(layer, slot)


def assert_stats(st, hits, misses, seed, what):
    msg = f"{what}: stats {st} (seed={seed})"
    assert st["hits"] == hits and st["misses"] == misses, msg
    assert st["chunks_rebuilt"] == misses, msg
    assert st["bytes_fetched"] == misses * BYTES_PER_MISS, msg
    assert abs(st["hit_rate"] - hits / (hits + misses)) < 1e-12, msg
    assert st["selections"] >= 1, msg


def test_same_query_twice_hits_everything(device):
    seed = 6000
    h = Harness(device, seed)
    st = h.step(0, h.slots[0], [h.u, h.u])
    assert h.selected(0, h.slots[0]) == [TOP_U, TOP_U], f"{h.selected(0, h.slots[0])} (seed={seed})"
    assert_stats(st, 0, HKV * K_CHUNKS, seed, "first selection (cold cache)")
    st = h.step(0, h.slots[0], [h.u, h.u])
    assert h.selected(0, h.slots[0]) == [TOP_U, TOP_U], f"{h.selected(0, h.slots[0])} (seed={seed})"
    assert_stats(st, HKV * K_CHUNKS, 0, seed, "same query again")
    assert st["hit_rate"] == 1.0, f"{st} (seed={seed})"


def test_disjoint_selection_misses_everything(device):
    seed = 6001
    h = Harness(device, seed)
    h.step(0, h.slots[0], [h.u, h.u])
    st = h.step(0, h.slots[0], [h.v, h.v])
    assert h.selected(0, h.slots[0]) == [TOP_V, TOP_V], f"{h.selected(0, h.slots[0])} (seed={seed})"
    assert_stats(st, 0, HKV * K_CHUNKS, seed, "disjoint selection")
    assert st["hit_rate"] == 0.0, f"{st} (seed={seed})"
    # and back: the u chunks were evicted, so they miss again
    st = h.step(0, h.slots[0], [h.u, h.u])
    assert_stats(st, 0, HKV * K_CHUNKS, seed, "back to the first selection")


def test_partial_overlap(device):
    """A query along (u + v)/sqrt(2) selects the two strongest of each group: 2 hits and 2 misses per head."""
    seed = 6002
    h = Harness(device, seed)
    h.step(0, h.slots[0], [h.u, h.u])
    mix = (h.u + h.v) / 2 ** 0.5
    st = h.step(0, h.slots[0], [mix, mix])
    assert h.selected(0, h.slots[0]) == [[6, 7, 13, 14]] * HKV, f"{h.selected(0, h.slots[0])} (seed={seed})"
    assert_stats(st, 2 * HKV, 2 * HKV, seed, "half overlap")


def test_cache_is_per_layer_slot_and_head(device):
    seed = 6003
    h = Harness(device, seed)
    s0, s1 = h.slots
    h.step(0, s0, [h.u, h.v])                               # KV head 0 -> u chunks, head 1 -> v chunks
    assert h.selected(0, s0) == [TOP_U, TOP_V], f"{h.selected(0, s0)} (seed={seed})"
    # other layer and other slot select the opposite: must not evict (0, s0)'s entries
    assert_stats(h.step(1, s0, [h.v, h.u]), 0, HKV * K_CHUNKS, seed, "layer 1 cold")
    assert_stats(h.step(0, s1, [h.v, h.u]), 0, HKV * K_CHUNKS, seed, "slot 1 cold")
    assert_stats(h.step(0, s0, [h.u, h.v]), HKV * K_CHUNKS, 0, seed, "layer 0 slot 0 again")
    # swapping the heads' directions: head 0's cache holds u chunks only, so v chunks all miss (no sharing)
    assert_stats(h.step(0, s0, [h.v, h.u]), 0, HKV * K_CHUNKS, seed, "heads swapped")
    # both layer-1 and slot-1 caches still hold what they selected
    assert_stats(h.step(1, s0, [h.v, h.u]), HKV * K_CHUNKS, 0, seed, "layer 1 again")
    assert_stats(h.step(0, s1, [h.v, h.u]), HKV * K_CHUNKS, 0, seed, "slot 1 again")


def test_prefill_q_last_warms_the_cache(device):
    seed = 6004
    keys, values, u, v = planted(seed)
    store = make_store(config(device))
    slot = store.add_sequences(1)[0]
    q = query([u, v])
    store.reset_stats()
    prefill_one(store, 0, slot, keys[:PROMPT], values[:PROMPT], q_last=q, keys_post_rope=True, device=device)
    assert store.selected_chunks(0, slot) == [TOP_U, TOP_V], f"{store.selected_chunks(0, slot)} (seed={seed})"
    assert_stats(store.stats(), 0, HKV * K_CHUNKS, seed, "q_last selection counts like a decode step's")
    store.reset_stats()
    zero = store.stats()
    assert zero["hits"] == zero["misses"] == zero["chunks_rebuilt"] == zero["bytes_fetched"] == 0, (
        f"reset_stats left {zero} (seed={seed})")
    out = decode_one(store, 0, slot, q, keys[PROMPT], values[PROMPT], device=device)
    assert_nontrivial(out, "decode output", seed)
    assert_stats(store.stats(), HKV * K_CHUNKS, 0, seed, "first decode after a warm prefill")
