"""A selection cache larger than the budget (``cache_tokens``; docs/semantics.md, Decode 6).

* ``cache_tokens=0`` (the default) and ``cache_tokens=budget`` are the same store: outputs, selections, stats and
  memory equal bit for bit over a ragged batch with folds.
* With ``K = cache_tokens / chunk_size > k`` the store equals the float64 reference (tests/python/reference.py, its own
  slot rule) exactly for selections and hits/misses, and to float tolerance for outputs, over many decode steps with
  folds, for random configurations and ragged batches; ``memory_report()["selection_cache"]`` grows with K.
* A full budget with a larger cache is still full attention.
* On a correlated query sequence the hit rate with K = 2k is strictly above K = k (and never below on any sequence).
* Bad values raise ValueError naming ``cache_tokens``; the CUDA backend serves K > k with the CPU backend's slot
  rule (GPU only: selections, hits/misses and memory equal, outputs to float tolerance).

Tolerances as test_reference_parity.py: float32 storage <= 5e-4 relative (the CPU store measures ~1e-6), bfloat16
storage <= 4e-3 (2.5e-3 measured at head_dim 32, the same with cache_tokens = budget: bf16 rounding, not the cache;
attending to a cached but unselected chunk gives ~0.4).
"""

import pytest
import torch

from helpers import (assert_nontrivial, assert_same_selection, decode_one, documented_info, generator, make_reference,
                     make_store, prefill_one, randn, rel_err, rope, small_config, structured_keys)

CHUNK = 8


def queries_like_a_decoder(g, keys_post, upto, hq, hkv, d, n, keep=0.0):
    """``n`` queries ``[n, Hq, D]``, each pulled towards an earlier token's key (peaked scores, as in
    test_reference_parity.py). With ``keep > 0`` each query is ``keep`` times the previous one plus the rest new: a
    correlated sequence, whose selections drift slowly as a real decoder's do."""
    group = hq // hkv
    qs = randn(g, n, hq, d, scale=0.5).double()
    for i in range(n):
        for h in range(hkv):
            t = int(torch.randint(0, upto + i, (1,), generator=g))
            k = keys_post[t, h].double()
            qs[i, h * group:(h + 1) * group] += 3.0 * k / k.norm() * d ** 0.5 / 4
        if keep > 0 and i > 0:
            qs[i] = keep * qs[i - 1] + (1.0 - keep) * qs[i]
    return qs.float()


class Batch:
    """A store and one reference per (layer, slot), fed the same ragged batch (prompt lengths differ), decoding all
    slots together."""

    def __init__(self, kw, lengths, steps, seed, keep=0.0, q_last_slot=0):
        self.kw, self.seed = kw, seed
        hq, hkv, d = kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"]
        g = generator(seed)
        self.store = make_store(kw)
        self.slots = self.store.add_sequences(len(lengths))
        self.refs, self.data = {}, {}
        for i, (slot, length) in enumerate(zip(self.slots, lengths)):
            total = length + steps
            keys_post = rope(kw, structured_keys(g, total, hkv, d), torch.arange(total))
            values = randn(g, total, hkv, d)
            queries = queries_like_a_decoder(g, keys_post, length, hq, hkv, d, steps, keep)
            q_last = queries_like_a_decoder(g, keys_post, length - 4, hq, hkv, d, 1) if i == q_last_slot else None
            self.data[slot] = (length, keys_post, values, queries)
            for layer in range(kw["num_layers"]):
                prefill_one(self.store, layer, slot, keys_post[:length], values[:length], q_last=q_last,
                            keys_post_rope=True, device=kw["device"])
                ref = make_reference(kw)
                ref.prefill(keys_post[:length], values[:length], q_last=q_last, keys_post_rope=True)
                self.refs[layer, slot] = ref

    def step(self, layer, i):
        """Decode step ``i`` of ``layer`` for every slot at once; returns the store's outputs ``[B, Hq, D]`` and the
        references' ``[B, Hq, D]``."""
        q, k, v = a_inputs(self, i)
        out = self.store.decode(layer, self.slots, *(x.to(self.kw["device"]) for x in (q, k, v))).cpu()
        ref = torch.stack([self.refs[layer, s].decode(q[b], k[b], v[b]) for b, s in enumerate(self.slots)])
        return out, ref

    def check_step(self, layer, i, tol):
        """Runs step ``i`` of ``layer`` and asserts what the store and the references must agree on: each slot's
        selection (exactly: the data avoid near-ties) and its output within ``tol`` (relative)."""
        out, ref = self.step(layer, i)
        assert_nontrivial(out, "decode output", self.seed)
        for b, slot in enumerate(self.slots):
            r = self.refs[layer, slot]
            got = self.store.selected_chunks(layer, slot)
            assert_same_selection(got, r, self.seed, step=i)
            assert got == r.selected, (
                f"step {i} layer {layer} slot {slot}: near-tie exchange; the data must avoid it (seed={self.seed})")
            err = rel_err(out[b], ref[b])
            assert err <= tol, (
                f"step {i} layer {layer} slot {slot}: output error {err:.3g} (seed={self.seed}, {self.kw})")

    def ref_stats(self):
        refs = self.refs.values()
        return sum(r.hits for r in refs), sum(r.misses for r in refs)


def random_config(seed, device):
    """A random small configuration with a real choice of chunks (budget well below the candidates)."""
    g = generator(seed)
    pick = lambda options: options[int(torch.randint(0, len(options), (1,), generator=g))]  # noqa: E731
    hq, hkv = pick([(4, 2), (4, 1), (2, 2), (8, 2)])
    k = pick([3, 4, 6])
    head_dim = pick([32, 64])
    if head_dim == 32 and device != "cpu":
        head_dim = 64  # the CUDA backend's smallest head_dim (the draw is kept so that the other draws stay)
    return small_config(num_layers=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, max_batch=3,
                        rank=24, chunk_size=CHUNK, budget=k * CHUNK, cache_tokens=pick([k + k // 2, 2 * k, 4 * k]) * CHUNK,
                        outlier_chunks=pick([0, 2]), sink_chunks=0, local_chunks=2, generation_window=16,
                        group_score=pick(["mean", "max"]), dtype=pick(["float32", "float32", "bfloat16"]),
                        device=device)


@pytest.mark.parametrize("seed", [7100, 7105, 7106, 7112, 7122, 7124])  # GQA/MQA/MHA, K = 1.5k, 2k, 4k, bf16
def test_larger_cache_matches_reference(seed, device):
    kw = random_config(seed, device)
    steps = 40                                           # a 16-token window: every sequence folds several times
    batch = Batch(kw, lengths=[203, 150, 171], steps=steps, seed=seed, keep=0.6)
    store = batch.store
    tol = 4e-3 if kw["dtype"] == "bfloat16" else 5e-4
    for i in range(steps):
        for layer in range(kw["num_layers"]):
            batch.check_step(layer, i, tol)
            st = store.stats()
            assert (st["hits"], st["misses"]) == batch.ref_stats(), (
                f"step {i} layer {layer}: store hits/misses {st['hits']}/{st['misses']}, reference "
                f"{batch.ref_stats()} (seed={seed}, {kw})")
            assert st["chunks_rebuilt"] == st["misses"], f"{st} (seed={seed})"
    for (layer, slot), r in batch.refs.items():
        assert documented_info(store.sequence_info(layer, slot)) == r.sequence_info(), f"(seed={seed})"
        assert r.folds >= 2, f"layer {layer} slot {slot}: {r.folds} folds (seed={seed})"
    expected = sum(r.memory_report()["selection_cache"] for r in batch.refs.values())
    assert store.memory_report()["selection_cache"] == expected, f"(seed={seed})"
    e = 2 if kw["dtype"] == "bfloat16" else 4
    per_chunk = CHUNK * kw["num_kv_heads"] * kw["head_dim"] * 2 * e
    assert expected == len(batch.refs) * kw["cache_tokens"] // CHUNK * per_chunk, f"(seed={seed})"
    hits, misses = batch.ref_stats()
    assert hits > 0 and misses > 0, f"hits {hits} misses {misses}: cache not exercised (seed={seed})"


def test_default_is_a_cache_of_exactly_the_budget(device):
    """cache_tokens=0 and cache_tokens=budget: the same outputs, selections, stats and memory, bit for bit."""
    seed = 7110
    kw = small_config(num_layers=2, max_batch=3, budget=4 * CHUNK, outlier_chunks=2, sink_chunks=0, local_chunks=2,
                      generation_window=16, device=device)
    a = Batch(kw, lengths=[120, 97, 150], steps=30, seed=seed, keep=0.5)
    b = Batch(dict(kw, cache_tokens=kw["budget"]), lengths=[120, 97, 150], steps=30, seed=seed, keep=0.5)
    assert a.store.config["cache_tokens"] == 0 and b.store.config["cache_tokens"] == kw["budget"]
    for i in range(30):
        for layer in range(2):
            out_a = a.store.decode(layer, a.slots, *(x.to(device) for x in a_inputs(a, i)))
            out_b = b.store.decode(layer, b.slots, *(x.to(device) for x in a_inputs(b, i)))
            assert torch.equal(out_a, out_b), f"step {i} layer {layer} (seed={seed})"
            for slot in a.slots:
                assert a.store.selected_chunks(layer, slot) == b.store.selected_chunks(layer, slot), f"(seed={seed})"
    assert a.store.stats() == b.store.stats(), f"(seed={seed})"
    assert a.store.memory_report() == b.store.memory_report(), f"(seed={seed})"
    assert a.store.stats()["folds"] > 0 and a.store.stats()["hits"] > 0, f"{a.store.stats()} (seed={seed})"


def a_inputs(batch, i):
    """Step ``i``'s queries, new keys and new values of every slot of ``batch``, stacked (on the CPU)."""
    q = torch.stack([batch.data[s][3][i] for s in batch.slots])
    k = torch.stack([batch.data[s][1][batch.data[s][0] + i] for s in batch.slots])
    v = torch.stack([batch.data[s][2][batch.data[s][0] + i] for s in batch.slots])
    return q, k, v


def test_full_budget_with_a_larger_cache_is_full_attention(device):
    """Full rank, a budget covering every chunk and twice that as cache: the output is full attention."""
    from reference import full_attention
    seed = 7120
    hq, hkv, d, prompt, steps = 4, 2, 64, 90, 20
    kw = small_config(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rank=hkv * d, budget=16 * CHUNK,
                      cache_tokens=32 * CHUNK, outlier_chunks=2, local_chunks=2, generation_window=16, device=device)
    g = generator(seed)
    keys = rope(kw, structured_keys(g, prompt + steps, hkv, d), torch.arange(prompt + steps))
    values = randn(g, prompt + steps, hkv, d)
    queries = randn(g, steps, hq, d)
    store = make_store(kw)
    slot = store.add_sequences(1)[0]
    prefill_one(store, 0, slot, keys[:prompt], values[:prompt], keys_post_rope=True, device=device)
    for i in range(steps):
        t = prompt + i
        out = decode_one(store, 0, slot, queries[i], keys[t], values[t], device=device)
        expected = full_attention(queries[i], keys[:t + 1], values[:t + 1])
        assert_nontrivial(out, "decode output", seed)
        err = rel_err(out, expected)
        assert err <= 1e-4, f"step {i}: relative error {err:.3g} vs full attention (seed={seed})"
    assert store.stats()["folds"] > 0


def hit_rates(kw, seed, keep, steps=48):
    """(store, reference) hit rates of one sequence decoding a query sequence with correlation ``keep``."""
    batch = Batch(kw, lengths=[400], steps=steps, seed=seed, keep=keep)
    batch.store.reset_stats()
    for r in batch.refs.values():
        r.hits = r.misses = 0
    for i in range(steps):
        batch.step(0, i)
    hits, misses = batch.ref_stats()
    return batch.store.stats()["hit_rate"], hits / (hits + misses)


def test_twice_the_budget_hits_more_on_correlated_queries(device):
    seed = 7130
    kw = small_config(max_batch=1, budget=6 * CHUNK, outlier_chunks=2, sink_chunks=0, local_chunks=2,
                      generation_window=256, device=device)
    store_k, ref_k = hit_rates(kw, seed, keep=0.7)
    store_2k, ref_2k = hit_rates(dict(kw, cache_tokens=2 * kw["budget"]), seed, keep=0.7)
    assert store_k == pytest.approx(ref_k, abs=1e-12) and store_2k == pytest.approx(ref_2k, abs=1e-12)
    assert 0.05 < store_k < 0.95, f"hit rate {store_k}: the query sequence does not exercise the cache (seed={seed})"
    assert store_2k > store_k + 0.05, f"K=2k hit rate {store_2k:.3f} vs K=k {store_k:.3f} (seed={seed})"
    # Uncorrelated queries: never below K = k either.
    store_k, _ = hit_rates(kw, seed + 1, keep=0.0)
    store_2k, _ = hit_rates(dict(kw, cache_tokens=2 * kw["budget"]), seed + 1, keep=0.0)
    assert store_2k >= store_k, f"K=2k hit rate {store_2k:.3f} below K=k {store_k:.3f} (seed={seed + 1})"


BAD_CACHE_TOKENS = [
    ("not-a-multiple", 4 * CHUNK + 4, ValueError),
    ("below-budget", 2 * CHUNK, ValueError),
    ("negative", -CHUNK, ValueError),
    ("chunks-beyond-c-int", 2 ** 62, ValueError),
    ("beyond-int64", 2 ** 63, ValueError),
    ("float", 64.0, TypeError),
]


@pytest.mark.parametrize("case", BAD_CACHE_TOKENS, ids=[c[0] for c in BAD_CACHE_TOKENS])
def test_bad_cache_tokens_are_rejected(case):
    from shadowkv_core import KVStore
    _, value, error = case
    kw = small_config(budget=4 * CHUNK, cache_tokens=value)
    store = None
    with pytest.raises(error, match="cache_tokens"):
        store = KVStore(**kw)
    assert store is None
    for good in (0, 4 * CHUNK, 5 * CHUNK, 4096 * CHUNK):   # the boundaries are valid (the last one is clamped)
        assert KVStore(**dict(kw, cache_tokens=good)).add_sequences(1) == [0]


def test_cuda_accepts_a_cache_larger_than_the_budget_and_matches_the_cpu():
    """The CUDA backend serves K > k (it used to reject it at construction) with the CPU backend's slot rule: over
    a ragged batch with folds and decoder-like (peaked, correlated) queries, the same selections at every step, the
    same hits and misses, the same memory; outputs to float32 tolerance (2e-4 as test_cuda_parity.py)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import shadowkv_core
    if not shadowkv_core.build_info()["cuda_backend"]:
        pytest.skip("this build has no CUDA backend")
    from shadowkv_core import KVStore
    seed, steps, lengths = 7130, 30, [203, 150, 171]
    for cache_chunks in (8, 16):                      # K = 2k and 4k (k = 4)
        kw = small_config(num_layers=2, head_dim=64, max_batch=3, rank=20, budget=4 * CHUNK,
                          cache_tokens=cache_chunks * CHUNK, outlier_chunks=2, local_chunks=2, generation_window=16)
        stores = {dev: KVStore(**dict(kw, device=dev)) for dev in ("cpu", "cuda:0")}
        assert stores["cuda:0"].config["cache_tokens"] == cache_chunks * CHUNK
        g = generator(seed + cache_chunks)
        hq, hkv, d = kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"]
        data = []
        for length in lengths:
            total = length + steps
            keys_post = rope(kw, structured_keys(g, total, hkv, d), torch.arange(total))
            data.append((length, keys_post, randn(g, total, hkv, d),
                         queries_like_a_decoder(g, keys_post, length, hq, hkv, d, steps, keep=0.6)))
        slots = {dev: s.add_sequences(len(lengths)) for dev, s in stores.items()}
        for layer in range(kw["num_layers"]):
            for dev, store in stores.items():
                for slot, (length, keys_post, values, _) in zip(slots[dev], data):
                    prefill_one(store, layer, slot, keys_post[:length], values[:length], keys_post_rope=True,
                                device=dev)
        for i in range(steps):
            q = torch.stack([x[3][i] for x in data])
            k = torch.stack([x[1][x[0] + i] for x in data])
            v = torch.stack([x[2][x[0] + i] for x in data])
            for layer in range(kw["num_layers"]):
                outs = {dev: s.decode(layer, slots[dev], q.to(dev), k.to(dev), v.to(dev)).float().cpu()
                        for dev, s in stores.items()}
                assert_nontrivial(outs["cuda:0"], "cuda output", seed)
                for a, b in zip(slots["cpu"], slots["cuda:0"]):
                    assert stores["cpu"].selected_chunks(layer, a) == stores["cuda:0"].selected_chunks(layer, b), (
                        f"step {i} layer {layer}: selections differ (K = {cache_chunks}, seed={seed})")
                err = rel_err(outs["cuda:0"], outs["cpu"])
                assert err < 2e-4, f"step {i} layer {layer}: output differs by {err:.2e} (K = {cache_chunks})"
        cpu, gpu = stores["cpu"].stats(), stores["cuda:0"].stats()
        for key in ("hits", "misses", "chunks_rebuilt", "bytes_fetched", "selections", "folds"):
            assert cpu[key] == gpu[key], f"stats[{key}]: cpu {cpu} cuda {gpu} (K = {cache_chunks})"
        assert gpu["hits"] > 0 and gpu["misses"] > 0 and gpu["folds"] > 0, gpu
        assert (stores["cpu"].memory_report()["selection_cache"]
                == stores["cuda:0"].memory_report()["selection_cache"])
