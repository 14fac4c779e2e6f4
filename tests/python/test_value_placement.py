"""Where values live: value_store = "host" | "device" | "auto" (docs/semantics.md, "Value placement").

"auto" places each sequence's value store in device memory while ``device_value_budget`` lasts, then in host
memory; a sequence is never split, its place is decided when it joins (add_sequences) and freed when it leaves.
The decision is the store's (backend-neutral), so these tests run on every backend (SHADOWKV_TEST_DEVICES): the
places, ``memory_report()``'s split, ``sequence_info()["values_on"]``, and outputs that do not depend on the place.
"""

from __future__ import annotations

import pytest
import torch

import helpers as H

LAYERS, HQ, HKV, D, MAX_LEN, CHUNK = 2, 4, 2, 64, 1000, 8
# One sequence's value store at capacity: layers x (MAX_LEN // CHUNK * CHUNK) tokens x Hkv*D x 4 bytes (float32).
SEQUENCE_VALUE_BYTES = LAYERS * (MAX_LEN // CHUNK * CHUNK) * HKV * D * 4


def _store(device, value_store, budget=None, max_batch=4):
    kw = H.small_config(num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_batch=max_batch,
                        max_seq_len=MAX_LEN, budget=48, device=device, value_store=value_store)
    if budget is not None:
        kw["device_value_budget"] = budget
    return H.make_store(kw)


def _places(store, slots):
    return [store.sequence_info(0, s)["values_on"] for s in slots]


def test_auto_fills_the_budget_then_the_host(device):
    store = _store(device, "auto", budget=2 * SEQUENCE_VALUE_BYTES)
    assert store.device_value_budget == 2 * SEQUENCE_VALUE_BYTES
    assert store.value_bytes_per_sequence == SEQUENCE_VALUE_BYTES
    slots = store.add_sequences(3)
    assert _places(store, slots) == ["device", "device", "host"]
    g = H.generator(11)
    keys = H.randn(g, 3, 300, HKV, D).to(device)
    values = H.randn(g, 3, 300, HKV, D).to(device)
    for layer in range(LAYERS):
        store.prefill(layer, slots, keys, values, keys_post_rope=False)
        assert [store.sequence_info(layer, s)["values_on"] for s in slots] == ["device", "device", "host"]
    per_sequence = LAYERS * (300 // CHUNK - 2) * CHUNK * HKV * D * 4  # 2 local chunks stay exact
    report = store.memory_report()
    assert report["value_store_device"] == 2 * per_sequence, report
    assert report["value_store_host"] == per_sequence, report
    assert report["value_store"] == 3 * per_sequence, report
    store.release([slots[0]])
    assert store.add_sequences(1) == [slots[0]]
    assert _places(store, [slots[0]]) == ["device"], "a released sequence's budget is reused"
    assert _places(store, store.add_sequences(1)) == ["host"]


def test_fixed_policies(device):
    host = _store(device, "host")
    assert _places(host, host.add_sequences(4)) == ["host"] * 4
    on_device = _store(device, "device", budget=0)
    assert _places(on_device, on_device.add_sequences(4)) == ["device"] * 4, "the budget limits only 'auto'"
    nothing = _store(device, "auto", budget=0)
    assert _places(nothing, nothing.add_sequences(2)) == ["host"] * 2
    assert host.config["value_store"] == "host" and nothing.config["value_store"] == "auto"


@pytest.mark.parametrize("bad", [-1, -5, 1.5, 1.0, True, "1"])
def test_bad_budget_is_rejected(bad):
    with pytest.raises((ValueError, TypeError)):
        _store("cpu", "auto", budget=bad)


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="value_store must be"):
        _store("cpu", "disk")
    with pytest.raises(TypeError, match="value_store"):
        _store("cpu", 5)


def test_outputs_do_not_depend_on_the_place(device):
    """The same inputs through a host-placed and a device-placed store give the same outputs, bit for bit (the
    same kernels read the same values from either memory), over decode steps with folds and misses."""
    seed = 12
    g = H.generator(seed)
    stores = {place: _store(device, place) for place in ("host", "device")}
    slots = {place: s.add_sequences(2) for place, s in stores.items()}
    lengths = [420, 260]
    keys = torch.zeros(2, 420, HKV, D)
    values = H.randn(g, 2, 420, HKV, D)
    for b, n in enumerate(lengths):
        keys[b, :n] = H.structured_keys(g, n, HKV, D)
    q_last = H.randn(g, 2, HQ, D, scale=2.0)
    for layer in range(LAYERS):
        for place, store in stores.items():
            store.prefill(layer, slots[place], keys.to(device), values.to(device), lengths=lengths,
                          q_last=q_last.to(device), keys_post_rope=False)
    for step in range(40):
        q = H.randn(g, 2, HQ, D, scale=2.0).to(device)
        k_new = H.randn(g, 2, HKV, D).to(device)
        v_new = H.randn(g, 2, HKV, D).to(device)
        for layer in range(LAYERS):
            outs = {place: s.decode(layer, slots[place], q, k_new, v_new).cpu() for place, s in stores.items()}
            H.assert_nontrivial(outs["device"], "device-placed output", seed)
            assert torch.equal(outs["host"], outs["device"]), f"outputs differ at step {step}, layer {layer}"
    stats = {place: s.stats() for place, s in stores.items()}
    assert stats["host"]["misses"] > 0 and stats["host"]["folds"] > 0, stats
    assert stats["host"] == stats["device"], stats


def test_reserved_bytes_follow_the_place(device):
    """On CUDA, a sequence's value store is reserved when it joins, in the memory of its place, and freed when it
    leaves; the CPU backend reports no reservations."""
    store = _store(device, "auto", budget=SEQUENCE_VALUE_BYTES)
    empty = store.memory_report()
    slots = store.add_sequences(2)
    both = store.memory_report()
    if device.startswith("cuda"):
        assert both["device_reserved"] - empty["device_reserved"] >= SEQUENCE_VALUE_BYTES, both
        assert both["host_reserved"] - empty["host_reserved"] >= SEQUENCE_VALUE_BYTES, both
        store.release(slots)
        assert store.memory_report()["device_reserved"] == empty["device_reserved"]
        assert store.memory_report()["host_reserved"] == empty["host_reserved"]
    else:
        assert both["device_reserved"] == both["host_reserved"] == 0, both
