"""group_score (docs/semantics.md, Decode 4): a chunk's score is the max or the mean over the group's query heads of
their softmax probabilities. The store equals the float64 reference under both rules (same selections, outputs at the
reference-parity tolerance), the two rules select differently on GQA data (so the option is not a no-op), and a bad
name is rejected naming the argument."""

import pytest
import torch

from helpers import (assert_nontrivial, assert_same_selection, decode_one, generator, make_reference, make_store,
                     prefill_one, randn, rel_err, rope, small_config, structured_keys)

PROMPT, STEPS = 203, 24


def _queries(g, keys_post, upto, hq, hkv, d, n):
    """Noise plus a pull of each query head towards a different earlier key, so that the group's heads disagree."""
    group = hq // hkv
    qs = randn(g, n, hq, d, scale=0.5).double()
    for i in range(n):
        for j in range(hq):
            t = int(torch.randint(0, upto + i, (1,), generator=g))
            k = keys_post[t, j // group].double()
            qs[i, j] += 2.5 * k / k.norm() * d ** 0.5 / 4
    return qs.float()


def _run(group_score, device, seed=7100):
    kw = small_config(num_q_heads=8, num_kv_heads=2, head_dim=64, rank=24, chunk_size=8, budget=48, outlier_chunks=3,
                      local_chunks=2, generation_window=16, dtype="float32", device=device, group_score=group_score)
    g = generator(seed)
    total = PROMPT + STEPS
    keys_pre = structured_keys(g, total, 2, 64)
    values = randn(g, total, 2, 64)
    keys_post = rope(kw, keys_pre, torch.arange(total))
    queries = _queries(g, keys_post, PROMPT, 8, 2, 64, STEPS)
    store, ref = make_store(kw), make_reference(kw)
    slot = store.add_sequences(1)[0]
    prefill_one(store, 0, slot, keys_pre[:PROMPT], values[:PROMPT], device=device)
    ref.prefill(keys_pre[:PROMPT], values[:PROMPT])
    selections = []
    for i in range(STEPS):
        t = PROMPT + i
        out = decode_one(store, 0, slot, queries[i], keys_post[t], values[t], device=device).double()
        ref_out = ref.decode(queries[i], keys_post[t], values[t])
        assert_same_selection(store.selected_chunks(0, slot), ref, seed, step=i)
        if store.selected_chunks(0, slot) == ref.selected:
            assert rel_err(out, ref_out) <= 5e-4, f"{group_score} step {i}: {rel_err(out, ref_out):.3g} (seed={seed})"
        assert_nontrivial(out, f"{group_score} output", seed)
        selections.append(ref.selected)
    return selections


def test_store_equals_reference_under_both_rules_and_they_differ(device):
    by_max = _run("max", device)
    by_mean = _run("mean", device)
    differing = sum(a != b for a, b in zip(by_max, by_mean))
    assert differing > 0, "group_score='mean' selected exactly what 'max' selected at every step"


def test_unknown_group_score_is_rejected():
    with pytest.raises(ValueError, match="group_score"):
        make_store(small_config(group_score="median"))
    assert make_store(small_config(group_score="max")).config["group_score"] == "max"
    assert make_store(small_config()).config["group_score"] == "mean", "the default is the mean (docs/fidelity.md)"
