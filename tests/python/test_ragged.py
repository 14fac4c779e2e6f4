"""Ragged batches: one call over sequences of different lengths (right-padded tensors + ``lengths``) computes what
each sequence computes alone in its own store; slots can be released and re-added; sequences at different generated
lengths decode together; every layer keeps its own state.

Tolerance: outputs atol = rtol = 1e-5 (the same float32 computation, only batched); selections, outliers, sequence
info, memory and statistics must be equal. The padding holds NaN, so a store that reads it fails.
"""

import pytest
import torch

from helpers import (assert_nontrivial, generator, make_store, randn, rope, small_config, strided, structured_keys)

LAYERS, HQ, HKV, D, STEPS = 2, 4, 2, 64, 30


def config(device, max_batch=4):
    return small_config(num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_batch=max_batch,
                        rank=32, chunk_size=8, budget=24, outlier_chunks=2, local_chunks=2, generation_window=16,
                        device=device)


class Seq:
    """One sequence's data for every layer: pre-RoPE keys, values, queries, positions."""

    def __init__(self, g, kw, length, offset=0):
        self.length, self.offset = length, offset
        total = length + STEPS
        self.positions = torch.arange(total, dtype=torch.int64) + offset
        self.keys = [structured_keys(g, total, HKV, D) for _ in range(LAYERS)]
        self.values = [randn(g, total, HKV, D) for _ in range(LAYERS)]
        self.keys_post = [rope(kw, k, self.positions) for k in self.keys]
        self.queries = [randn(g, STEPS, HQ, D) for _ in range(LAYERS)]
        self.step = [0] * LAYERS

    def next_inputs(self, layer):
        i = self.step[layer]
        self.step[layer] += 1
        t = self.length + i
        return self.queries[layer][i], self.keys_post[layer][t], self.values[layer][t], self.positions[t]


def padded(seqs, layer, device):
    """``keys, values [B, S, Hkv, D]`` (NaN padding, non-contiguous), ``lengths``, ``positions [B, S]``."""
    s = max(q.length for q in seqs)
    keys = torch.full((len(seqs), s, HKV, D), float("nan"))
    values = torch.full((len(seqs), s, HKV, D), float("nan"))
    positions = torch.zeros(len(seqs), s, dtype=torch.int64)
    for b, q in enumerate(seqs):
        keys[b, : q.length] = q.keys[layer][: q.length]
        values[b, : q.length] = q.values[layer][: q.length]
        positions[b, : q.length] = q.positions[: q.length]
    return strided(keys).to(device), strided(values).to(device), [q.length for q in seqs], positions.to(device)


class Alone:
    """A sequence in a store of its own (the expected behaviour)."""

    def __init__(self, kw, seq, device, explicit_positions):
        self.store = make_store(kw)
        self.slot = self.store.add_sequences(1)[0]
        self.seq, self.device, self.explicit = seq, device, explicit_positions
        for layer in range(LAYERS):
            kwargs = dict(positions=seq.positions[None, : seq.length].to(device)) if explicit_positions else {}
            self.store.prefill(layer, [self.slot], seq.keys[layer][None, : seq.length].to(device),
                               seq.values[layer][None, : seq.length].to(device), **kwargs, keys_post_rope=False)
        self.step = [0] * LAYERS

    def decode(self, layer):
        i = self.step[layer]
        self.step[layer] += 1
        t = self.seq.length + i
        kwargs = dict(positions=self.seq.positions[t:t + 1].to(self.device)) if self.explicit else {}
        out = self.store.decode(layer, [self.slot], self.seq.queries[layer][i][None].to(self.device),
                                self.seq.keys_post[layer][t][None].to(self.device),
                                self.seq.values[layer][t][None].to(self.device), **kwargs)
        return out[0].cpu()


def batch_decode(store, layer, slots, seqs, device, explicit):
    qs, ks, vs, ps = zip(*(s.next_inputs(layer) for s in seqs))
    kwargs = dict(positions=torch.stack(ps).to(device)) if explicit else {}
    out = store.decode(layer, list(slots), torch.stack(qs).to(device), torch.stack(ks).to(device),
                       torch.stack(vs).to(device), **kwargs)
    assert out.shape == (len(slots), HQ, D)
    return out.cpu()


def assert_same_state(store, layer, slot, alone, seed, what):
    for name in ("selected_chunks", "outlier_chunks", "sequence_info"):
        got = getattr(store, name)(layer, slot)
        exp = getattr(alone.store, name)(layer, alone.slot)
        assert got == exp, f"{what}, layer {layer}: {name} {got} != alone {exp} (seed={seed})"


def assert_memory_is_sum(store, alones, seed, what):
    rep = store.memory_report()
    for kind, nbytes in rep.items():
        if kind.endswith("_reserved"):  # the store's own reservations (arenas for max_batch) are not per sequence
            continue
        expected = sum(a.store.memory_report()[kind] for a in alones)
        assert nbytes == expected, f"{what}: memory_report[{kind}] {nbytes} != sum of alone {expected} (seed={seed})"


@pytest.mark.parametrize("variant", ["list-lengths-default-positions", "tensor-lengths-explicit-positions"])
def test_ragged_batch_equals_each_alone(variant, device):
    seed = 7000 if variant.startswith("list") else 7001
    explicit = "explicit" in variant
    kw = config(device)
    g = generator(seed)
    lengths, offsets = [53, 64, 20], ([0, 7, 300] if explicit else [0, 0, 0])
    seqs = [Seq(g, kw, n, o) for n, o in zip(lengths, offsets)]
    alones = [Alone(kw, s, device, explicit) for s in seqs]
    store = make_store(kw)
    slots = store.add_sequences(3)
    assert len(set(slots)) == 3, f"add_sequences returned {slots}"
    for layer in range(LAYERS):
        keys, values, lens, positions = padded(seqs, layer, device)
        if variant.startswith("tensor"):
            lens = torch.tensor(lens, dtype=torch.int64)
        kwargs = dict(positions=positions) if explicit else {}
        store.prefill(layer, slots, keys, values, lengths=lens, **kwargs, keys_post_rope=False)
    for layer in range(LAYERS):
        for slot, alone in zip(slots, alones):
            assert_same_state(store, layer, slot, alone, seed, f"after prefill, slot {slot}")
    assert_memory_is_sum(store, alones, seed, "after prefill")

    order = [2, 0, 1]                       # slots need not come in order
    for step in range(STEPS):
        for layer in range(LAYERS):
            idx = order if step % 2 else [0, 1, 2]
            out = batch_decode(store, layer, [slots[i] for i in idx], [seqs[i] for i in idx], device, explicit)
            for row, i in enumerate(idx):
                exp = alones[i].decode(layer)
                assert_nontrivial(out[row], f"sequence {i}", seed)
                torch.testing.assert_close(out[row], exp, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"step {step} layer {layer} seq {i} (seed={seed}): {m}")
                assert_same_state(store, layer, slots[i], alones[i], seed, f"step {step}, sequence {i}")
    assert_memory_is_sum(store, alones, seed, "after decoding")
    st, st_alone = store.stats(), [a.store.stats() for a in alones]
    for key in ("hits", "misses", "chunks_rebuilt", "bytes_fetched"):
        assert st[key] == sum(s[key] for s in st_alone), f"stats[{key}]: {st} vs alone {st_alone} (seed={seed})"
    # the short prompt has no context chunk until the generated region folds; then it selects
    info = store.sequence_info(0, slots[2])
    assert info["prompt_len"] == 20 and info["context_chunks"] == 2, f"{info} (seed={seed})"
    assert store.sequence_info(1, slots[1])["total_len"] == 64 + STEPS, f"(seed={seed})"


def test_release_and_readd(device):
    seed = 7100
    kw = config(device, max_batch=3)
    g = generator(seed)
    seqs = [Seq(g, kw, n) for n in (48, 61, 40)]
    alones = [Alone(kw, s, device, False) for s in seqs]
    store = make_store(kw)
    slots = store.add_sequences(3)
    for layer in range(LAYERS):
        keys, values, lens, _ = padded(seqs, layer, device)
        store.prefill(layer, slots, keys, values, lengths=lens, keys_post_rope=False)
    for _ in range(5):
        for layer in range(LAYERS):
            out = batch_decode(store, layer, slots, seqs, device, False)
            for b in range(3):
                torch.testing.assert_close(out[b], alones[b].decode(layer), atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"sequence {b} (seed={seed}): {m}")

    before = store.memory_report()["total"]
    store.release([slots[1]])
    assert store.memory_report()["total"] < before, f"release freed nothing (seed={seed})"
    assert_memory_is_sum(store, [alones[0], alones[2]], seed, "after release")
    kept = [slots[0], slots[2]]
    for _ in range(3):
        for layer in range(LAYERS):
            out = batch_decode(store, layer, kept, [seqs[0], seqs[2]], device, False)
            for row, b in ((0, 0), (1, 2)):
                torch.testing.assert_close(out[row], alones[b].decode(layer), atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"after release, sequence {b} (seed={seed}): {m}")

    # a new sequence takes the free slot; nothing of the released one leaks into it
    newcomer = Seq(g, kw, 33)
    fresh = Alone(kw, newcomer, device, False)
    new_slot = store.add_sequences(1)
    assert len(new_slot) == 1 and new_slot[0] not in kept, f"add_sequences gave {new_slot}, live {kept}"
    new_slot = new_slot[0]
    for layer in range(LAYERS):
        store.prefill(layer, [new_slot], newcomer.keys[layer][None, :33].to(device),
                      newcomer.values[layer][None, :33].to(device), keys_post_rope=False)
        assert store.sequence_info(layer, new_slot) == fresh.store.sequence_info(layer, fresh.slot), f"(seed={seed})"
    live = [slots[0], new_slot, slots[2]]
    for step in range(20):
        for layer in range(LAYERS):
            out = batch_decode(store, layer, live, [seqs[0], newcomer, seqs[2]], device, False)
            for row, a in enumerate([alones[0], fresh, alones[2]]):
                assert_nontrivial(out[row], "decode output", seed)
                torch.testing.assert_close(out[row], a.decode(layer), atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"step {step} layer {layer} row {row} (seed={seed}): {m}")
            assert_same_state(store, layer, new_slot, fresh, seed, f"re-added slot, step {step}")
    assert_memory_is_sum(store, [alones[0], fresh, alones[2]], seed, "after re-add")


def test_different_generated_lengths_decode_together(device):
    seed = 7200
    kw = config(device)
    g = generator(seed)
    seqs = [Seq(g, kw, n) for n in (45, 45, 70)]
    alones = [Alone(kw, s, device, False) for s in seqs]
    store = make_store(kw)
    slots = store.add_sequences(3)
    for layer in range(LAYERS):
        for b in range(3):      # one prefill call per sequence this time
            store.prefill(layer, [slots[b]], seqs[b].keys[layer][None, : seqs[b].length].to(device),
                          seqs[b].values[layer][None, : seqs[b].length].to(device), keys_post_rope=False)

    def run(members, steps, layers=tuple(range(LAYERS))):
        for _ in range(steps):
            for layer in layers:
                out = batch_decode(store, layer, [slots[b] for b in members], [seqs[b] for b in members], device,
                                   False)
                for row, b in enumerate(members):
                    assert_nontrivial(out[row], "decode output", seed)
                    torch.testing.assert_close(out[row], alones[b].decode(layer), atol=1e-5, rtol=1e-5,
                                               msg=lambda m: f"sequence {b} layer {layer} (seed={seed}): {m}")
                    assert_same_state(store, layer, slots[b], alones[b], seed, f"sequence {b}")

    run([0], 9)             # sequence 0 alone: 9 generated tokens
    run([2, 0], 4)          # sequence 2 joins
    run([1, 2, 0], 14)      # all three at 0 / 4 / 13 generated tokens; folds happen at different steps
    gen = [store.sequence_info(0, s)["total_len"] - store.sequence_info(0, s)["prompt_len"] for s in slots]
    assert gen == [27, 14, 18], f"generated lengths {gen} (seed={seed})"
    # the default position is per layer: layer 0 decoded once more than layer 1
    run([1], 1, layers=(0,))
    last = [store.sequence_info(layer, slots[1])["last_position"] for layer in range(LAYERS)]
    assert last == [44 + 15, 44 + 14], f"last positions per layer {last} (seed={seed})"
