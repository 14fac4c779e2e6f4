"""Attention sinks (sink_chunks, docs/semantics.md "Outliers"): of the outlier chunks of each KV head, the first
min(sink_chunks, outliers) are the prompt's first chunks, always; the rest follow the min-cosine rule. Checked on every
backend against the float64 reference (which implements the rule independently)."""

from __future__ import annotations

import pytest

import helpers as H


@pytest.mark.parametrize("sinks,outliers", [(0, 3), (1, 3), (2, 3), (5, 3), (1, 0)])
def test_sinks_are_the_first_outliers(device, sinks, outliers):
    seed = 41 + sinks
    g = H.generator(seed)
    kw = H.small_config(outlier_chunks=outliers, sink_chunks=sinks, device=device)
    store, ref = H.make_store(kw), H.make_reference(kw)
    keys, values = H.structured_keys(g, 300, 2, 64), H.randn(g, 300, 2, 64)
    slot = store.add_sequences(1)[0]
    H.prefill_one(store, 0, slot, keys, values, device=device)
    ref.prefill(keys, values)
    got = store.outlier_chunks(0, slot)
    assert got == ref.outliers, f"outliers {got} != reference {ref.outliers} (seed={seed})"
    for head in got:
        assert len(head) == outliers
        assert head[: min(sinks, outliers)] == list(range(min(sinks, outliers))), f"sinks missing from {head}"


def test_default_is_one_sink_and_negative_is_rejected():
    store = H.make_store(H.small_config())
    assert store.config["sink_chunks"] == 1
    with pytest.raises(ValueError, match="sink_chunks"):
        H.make_store(H.small_config(sink_chunks=-1))


def test_attended_chunks_are_outliers_sinks_and_the_selection(device):
    seed = 47
    g = H.generator(seed)
    kw = H.small_config(outlier_chunks=3, sink_chunks=1, budget=32, device=device)
    store = H.make_store(kw)
    slot = store.add_sequences(1)[0]
    H.prefill_one(store, 0, slot, H.structured_keys(g, 300, 2, 64), H.randn(g, 300, 2, 64), device=device)
    for _ in range(3):
        H.decode_one(store, 0, slot, H.randn(g, 4, 64, scale=2.0), H.randn(g, 2, 64), H.randn(g, 2, 64),
                     device=device)
        attended = store.attended_chunks(0, slot)
        outliers, selected = store.outlier_chunks(0, slot), store.selected_chunks(0, slot)
        for h in range(2):
            assert attended[h] == sorted(set(outliers[h]) | set(selected[h])), (attended, outliers, selected)
            assert 0 in attended[h], "the sink chunk is attended every step"
            assert len(attended[h]) == 3 + 4, "outliers and selection are disjoint"
