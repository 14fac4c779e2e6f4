"""Invalid configurations and arguments raise ValueError with a message naming the problem (matched loosely, by a
keyword), never IndexError or a crash; and a rejected call leaves the store exactly as it was (docs/semantics.md,
"Capacity and errors"): two identical stores ("twins") see the same history, the bad call is made on one of them
only, and afterwards both must report the same state and decode the same outputs (atol 1e-6).
"""

import pytest
import torch

from helpers import (assert_nontrivial, generator, make_store, randn, rope, small_config, structured_keys)

LAYERS, HQ, HKV, D, MAX_SEQ = 2, 4, 2, 64, 100
PROMPTS = (60, 45)                      # slots 0 and 1; slot 2 added but never prefilled; slot 3 released


def config(device, **overrides):
    kw = small_config(num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_batch=4,
                      max_seq_len=MAX_SEQ, rank=32, chunk_size=8, budget=24, outlier_chunks=2, local_chunks=2,
                      generation_window=16, device=device)
    kw.update(overrides)
    return kw


class Twins:
    """Two stores with one history. ``a`` receives the bad calls; ``b`` is what ``a`` must still be."""

    def __init__(self, device, seed, **overrides):
        self.device, self.seed = device, seed
        self.kw = config(device, **overrides)
        g = generator(seed)
        total = MAX_SEQ + 1
        self.keys = [[structured_keys(g, total, HKV, D) for _ in range(LAYERS)] for _ in PROMPTS]
        self.values = [[randn(g, total, HKV, D) for _ in range(LAYERS)] for _ in PROMPTS]
        self.keys_post = [[rope(self.kw, k, torch.arange(total)) for k in ks] for ks in self.keys]
        self.queries = randn(g, total, len(PROMPTS), LAYERS, HQ, D)
        self.t = list(PROMPTS)
        self.a, self.b = make_store(self.kw), make_store(self.kw)
        for store in (self.a, self.b):
            slots = store.add_sequences(4)
            assert slots == [0, 1, 2, 3], f"add_sequences(4) on a fresh store gave {slots}"
            store.release([3])
            for layer in range(LAYERS):
                for s, n in enumerate(PROMPTS):
                    store.prefill(layer, [s], self.keys[s][layer][None, :n].to(device),
                                  self.values[s][layer][None, :n].to(device))
        self.decode_both()
        self.decode_both()

    def inputs(self, slots, layer, step_offset=0):
        """Valid decode inputs for ``slots`` (of 0, 1) at their next positions."""
        q = torch.stack([self.queries[self.t[s] + step_offset, s, layer] for s in slots])
        k = torch.stack([self.keys_post[s][layer][self.t[s] + step_offset] for s in slots])
        v = torch.stack([self.values[s][layer][self.t[s] + step_offset] for s in slots])
        return q.to(self.device), k.to(self.device), v.to(self.device)

    def decode_both(self, slots=(0, 1)):
        outs = []
        for layer in range(LAYERS):
            q, k, v = self.inputs(slots, layer)
            out_a = self.a.decode(layer, list(slots), q, k, v).cpu()
            out_b = self.b.decode(layer, list(slots), q, k, v).cpu()
            assert_nontrivial(out_b, "decode output", self.seed)
            torch.testing.assert_close(out_a, out_b, atol=1e-6, rtol=0,
                                       msg=lambda m: f"store diverged after a rejected call (seed={self.seed}): {m}")
            outs.append(out_a)
        for s in slots:
            self.t[s] += 1
        return outs

    def assert_unchanged(self, what):
        msg = f"after rejected call {what!r} (seed={self.seed})"
        assert self.a.memory_report() == self.b.memory_report(), msg
        sa, sb = self.a.stats(), self.b.stats()
        for key in ("selections", "hits", "misses", "chunks_rebuilt", "bytes_fetched", "decode_steps", "folds"):
            assert sa[key] == sb[key], f"stats[{key}] {sa[key]} != {sb[key]} {msg}"
        for layer in range(LAYERS):
            for s in range(len(PROMPTS)):
                for name in ("sequence_info", "selected_chunks", "outlier_chunks"):
                    got, exp = getattr(self.a, name)(layer, s), getattr(self.b, name)(layer, s)
                    assert got == exp, f"{name}(layer {layer}, slot {s}) {got} != {exp} {msg}"
        self.decode_both()
        # slot 2 is still un-prefilled, slot 3 still released
        with pytest.raises(ValueError):
            self.a.decode(0, [2], *self.inputs([0], 0))
        with pytest.raises(ValueError):
            self.a.decode(0, [3], *self.inputs([0], 0))


def kv(tw, b=1, s=8, hkv=HKV, d=D, dtype=torch.float32, device=None):
    device = tw.device if device is None else device
    g = generator(1)
    return (torch.randn(b, s, hkv, d, generator=g).to(dtype=dtype).to(device),
            torch.randn(b, s, hkv, d, generator=g).to(dtype=dtype).to(device))


# (id, keyword regex, bad call on store a: f(tw, store))
BAD_PREFILLS = [
    ("keys-head-dim", r"shape|dim|size|keys", lambda tw, st: st.prefill(0, [2], *kv(tw, d=D + 1))),
    ("keys-kv-heads", r"shape|head|size|keys", lambda tw, st: st.prefill(0, [2], *kv(tw, hkv=HKV + 1))),
    ("keys-3d", r"shape|dim|rank|size|keys", lambda tw, st: st.prefill(0, [2], kv(tw)[0][0], kv(tw)[1][0])),
    ("values-shape", r"shape|value|size", lambda tw, st: st.prefill(0, [2], kv(tw, s=8)[0], kv(tw, s=9)[1])),
    ("keys-int-dtype", r"dtype|type|float|int", lambda tw, st: st.prefill(0, [2], *kv(tw, dtype=torch.int32))),
    ("keys-meta-device", r"device|meta", lambda tw, st: st.prefill(0, [2], *kv(tw, device="meta"))),
    ("batch-vs-slots", r"slot|batch|shape|size",
     lambda tw, st: st.prefill(0, [2], *kv(tw, b=2))),
    ("unknown-slot", r"slot", lambda tw, st: st.prefill(0, [17], *kv(tw))),
    ("negative-slot", r"slot", lambda tw, st: st.prefill(0, [-1], *kv(tw))),
    ("released-slot", r"slot|released", lambda tw, st: st.prefill(0, [3], *kv(tw))),
    ("one-bad-slot-of-two", r"slot", lambda tw, st: st.prefill(0, [2, 3], *kv(tw, b=2))),
    ("layer-too-large", r"layer", lambda tw, st: st.prefill(LAYERS, [2], *kv(tw))),
    ("layer-negative", r"layer", lambda tw, st: st.prefill(-1, [2], *kv(tw))),
    ("prompt-too-long", r"max_seq_len|capacity|long|length",
     lambda tw, st: st.prefill(0, [2], *kv(tw, s=MAX_SEQ + 1))),
    ("length-above-padded", r"length", lambda tw, st: st.prefill(0, [2], *kv(tw, s=8), lengths=[9])),
    ("length-zero", r"length|empty", lambda tw, st: st.prefill(0, [2], *kv(tw, s=8), lengths=[0])),
    ("lengths-count", r"length", lambda tw, st: st.prefill(0, [2], *kv(tw, s=8), lengths=[8, 8])),
    ("positions-shape", r"position|shape",
     lambda tw, st: st.prefill(0, [2], *kv(tw, s=8), positions=torch.arange(7, device=tw.device)[None])),
    ("positions-float", r"position|dtype|type|int64",
     lambda tw, st: st.prefill(0, [2], *kv(tw, s=8), positions=torch.arange(8.0, device=tw.device)[None])),
    ("q-last-shape", r"q_last|shape|query",
     lambda tw, st: st.prefill(0, [2], *kv(tw, s=8), q_last=torch.zeros(1, HQ + 1, D, device=tw.device))),
    ("duplicate-slots", r"slot|duplicate", lambda tw, st: st.prefill(0, [2, 2], *kv(tw, b=2))),
]


def bad_decode(tw, st, slots=(0,), layer=0, q=None, k=None, v=None, **kw):
    q0, k0, v0 = tw.inputs([0] * len(slots), 0)
    st.decode(layer, list(slots), q0 if q is None else q, k0 if k is None else k, v0 if v is None else v, **kw)


def dev(tw, *shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype, device=tw.device)


BAD_DECODES = [
    ("q-heads", r"shape|head|size|\bq\b|query", lambda tw, st: bad_decode(tw, st, q=dev(tw, 1, HQ + 1, D))),
    ("q-head-dim", r"shape|dim|size|\bq\b|query", lambda tw, st: bad_decode(tw, st, q=dev(tw, 1, HQ, D - 1))),
    ("q-2d", r"shape|dim|rank|size|\bq\b|query", lambda tw, st: bad_decode(tw, st, q=dev(tw, HQ, D))),
    ("k-new-shape", r"shape|k_new|key|size", lambda tw, st: bad_decode(tw, st, k=dev(tw, 1, HKV + 1, D))),
    ("v-new-shape", r"shape|v_new|value|size", lambda tw, st: bad_decode(tw, st, v=dev(tw, 1, HKV, D + 1))),
    ("q-int-dtype", r"dtype|type|float|int",
     lambda tw, st: bad_decode(tw, st, q=dev(tw, 1, HQ, D, dtype=torch.int64))),
    ("k-int-dtype", r"dtype|type|float|int",
     lambda tw, st: bad_decode(tw, st, k=dev(tw, 1, HKV, D, dtype=torch.int32))),
    ("q-meta-device", r"device|meta",
     lambda tw, st: bad_decode(tw, st, q=torch.ones(1, HQ, D, device="meta"))),
    ("batch-mismatch", r"slot|batch|shape|size", lambda tw, st: bad_decode(tw, st, slots=(0,),
                                                                          q=dev(tw, 2, HQ, D))),
    ("positions-shape", r"position|shape|size",
     lambda tw, st: bad_decode(tw, st, positions=torch.zeros(2, dtype=torch.int64, device=tw.device))),
    ("positions-float", r"position|dtype|type|int64",
     lambda tw, st: bad_decode(tw, st, positions=torch.zeros(1, device=tw.device))),
    ("unknown-slot", r"slot", lambda tw, st: bad_decode(tw, st, slots=(9,))),
    ("released-slot", r"slot|released", lambda tw, st: bad_decode(tw, st, slots=(3,))),
    ("layer-too-large", r"layer", lambda tw, st: bad_decode(tw, st, layer=LAYERS)),
    ("layer-negative", r"layer", lambda tw, st: bad_decode(tw, st, layer=-1)),
    ("before-prefill", r"prefill", lambda tw, st: bad_decode(tw, st, slots=(2,))),
    # a batch in which only one sequence is bad: the good one must not advance either
    ("one-unprefilled-of-two", r"prefill", lambda tw, st: bad_decode(tw, st, slots=(0, 2))),
    ("one-released-of-two", r"slot|released", lambda tw, st: bad_decode(tw, st, slots=(1, 3))),
    ("duplicate-slots", r"slot|duplicate", lambda tw, st: bad_decode(tw, st, slots=(0, 0))),
]

BAD_OTHERS = [
    ("release-unknown", r"slot", lambda tw, st: st.release([42])),
    ("release-released", r"slot|released", lambda tw, st: st.release([3])),
    ("release-one-bad-of-two", r"slot|released", lambda tw, st: st.release([0, 3])),
    ("add-beyond-max-batch", r"max_batch|capacity|slot|batch", lambda tw, st: st.add_sequences(2)),
    ("selected-bad-slot", r"slot", lambda tw, st: st.selected_chunks(0, 3)),
    ("outliers-bad-layer", r"layer", lambda tw, st: st.outlier_chunks(LAYERS, 0)),
    ("info-bad-slot", r"slot", lambda tw, st: st.sequence_info(0, 99)),
]

ALL_BAD = ([("prefill-" + c[0],) + c[1:] for c in BAD_PREFILLS] + [("decode-" + c[0],) + c[1:] for c in BAD_DECODES]
           + [("other-" + c[0],) + c[1:] for c in BAD_OTHERS])


@pytest.mark.parametrize("case", ALL_BAD, ids=[c[0] for c in ALL_BAD])
def test_bad_call_raises_value_error_and_changes_nothing(case, device):
    name, pattern, call = case
    seed = 9000
    tw = Twins(device, seed)
    with pytest.raises(ValueError, match=f"(?i){pattern}"):
        call(tw, tw.a)
    tw.assert_unchanged(name)


def test_after_rejections_the_free_slot_is_still_free(device):
    tw = Twins(device, 9001)
    with pytest.raises(ValueError):
        tw.a.add_sequences(2)               # 3 live of max_batch 4
    assert tw.a.add_sequences(1) == tw.b.add_sequences(1), f"a rejected add_sequences consumed a slot (seed={tw.seed})"
    with pytest.raises(ValueError):
        tw.a.add_sequences(1)
    tw.assert_unchanged("add_sequences")


def test_decode_beyond_max_seq_len(device):
    """A sequence at max_seq_len tokens cannot decode; the others can, and it can still be read and released."""
    seed = 9002
    tw = Twins(device, seed)
    while tw.t[0] < MAX_SEQ:                 # fill slot 0 (prompt 60) up to capacity, on both twins
        tw.decode_both(slots=(0,))
    info = tw.a.sequence_info(0, 0)
    assert info["total_len"] == MAX_SEQ, f"{info} (seed={seed})"
    for layer in range(LAYERS):
        with pytest.raises(ValueError, match=r"(?i)max_seq_len|capacity|full|length"):
            tw.a.decode(layer, [1, 0], *tw.inputs([1, 0], layer))
    assert tw.a.sequence_info(0, 0) == info, f"(seed={seed})"
    tw.decode_both(slots=(1,))              # the other sequence is untouched by the rejected batch
    tw.a.release([0])
    tw.b.release([0])
    tw.decode_both(slots=(1,))


BAD_CONFIGS = [
    ("budget-not-multiple", r"budget", dict(budget=20)),
    ("budget-zero", r"budget", dict(budget=0)),
    ("budget-negative", r"budget", dict(budget=-8)),
    ("rotary-dim-odd", r"rotary", dict(rotary_dim=31)),
    ("rotary-dim-too-large", r"rotary", dict(rotary_dim=D + 2)),
    ("heads-not-divisible", r"head", dict(num_q_heads=6, num_kv_heads=4)),
    ("kv-heads-zero", r"head", dict(num_kv_heads=0)),
    ("rank-zero", r"rank", dict(rank=0)),
    ("rank-negative", r"rank", dict(rank=-1)),
    ("rank-above-kv-width", r"rank", dict(rank=HKV * D + 1)),     # no orthonormal basis of more than Hkv*D vectors
    ("chunk-size-zero", r"chunk", dict(chunk_size=0)),
    ("generation-window-not-multiple", r"window|generation", dict(generation_window=20)),
    ("generation-window-zero", r"window|generation", dict(generation_window=0)),
    ("head-dim-zero", r"head_dim|dim", dict(head_dim=0)),
    ("layers-zero", r"layer", dict(num_layers=0)),
    ("max-batch-zero", r"batch", dict(max_batch=0)),
    ("max-seq-len-zero", r"max_seq_len|seq", dict(max_seq_len=0)),
    ("outlier-chunks-negative", r"outlier", dict(outlier_chunks=-1)),
    ("local-chunks-negative", r"local", dict(local_chunks=-1)),
    ("rope-style-unknown", r"rope|style", dict(rope_style="spiral")),
    ("factorization-unknown", r"factori", dict(factorization="qr")),
    ("dtype-unknown", r"dtype|type|float|int", dict(dtype="int8")),
    ("inv-freq-length", r"inv_freq|rotary|length", dict(inv_freq=torch.ones(D // 2 + 1))),
    ("device-unknown", r"device", dict(device="abacus:0")),
]


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_invalid_config_raises_value_error(case):
    name, pattern, overrides = case
    kw = config("cpu")
    kw.update(overrides)
    with pytest.raises(ValueError, match=f"(?i){pattern}"):
        make_store(kw)


def test_valid_edge_configs_construct():
    """The boundaries of the checks above are valid: the error tests are not passing because everything raises."""
    for overrides in (dict(budget=8), dict(rotary_dim=2), dict(rotary_dim=D), dict(num_q_heads=HKV),
                      dict(num_q_heads=4, num_kv_heads=1), dict(rank=HKV * D), dict(rank=1),
                      dict(generation_window=8), dict(outlier_chunks=0), dict(local_chunks=0),
                      dict(inv_freq=torch.ones(D // 2)), dict(dtype="bfloat16"), dict(dtype="float16"),
                      dict(rope_style="interleaved"), dict(factorization="svd")):
        store = make_store(config("cpu", **overrides))
        assert store.add_sequences(1) == [0], f"config {overrides}"


def test_decode_pipeline_parts_is_range_checked():
    from shadowkv_core import KVStore
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="decode_pipeline_parts"):
            KVStore(1, 4, 2, 64, rank=32, decode_pipeline_parts=bad)
    with pytest.raises(TypeError, match="decode_pipeline_parts"):
        KVStore(1, 4, 2, 64, rank=32, decode_pipeline_parts=2.0)
    assert KVStore(1, 4, 2, 64, rank=32, decode_pipeline_parts=3).config["decode_pipeline_parts"] == 3
