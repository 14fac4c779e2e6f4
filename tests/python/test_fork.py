"""KVStore.fork from Python (docs/semantics.md, "Fork, park and save").

The C++ suite (tests/cpp/test_fork.cpp) proves the equalities on five store variants; these tests hold the Python
surface to them. The proof is an equality: store `a` forks its sequence after a history of decode, extend and truncate
(folds and a fold journal included); store `b` fed the same prompt and tokens to three slots from the start, so its
slots are unshared copies of `a`'s source. Afterwards each sequence of `a` gets its own tokens and must equal its copy
in `b` (outputs, selections, sequence_info), also after the source is released; memory_report() counts the shared
prompt once (against layer_memory_after_prefill's formulas); bad input changes nothing; stats() do not move.
"""

from __future__ import annotations

import pytest
import torch

from helpers import generator, make_store, small_config

PROMPT = 90


def _assert_same_output(x, y, device, what):
    """Bit for bit on the CPU; on CUDA the attention sums the selected chunks in cache-slot order, which a truncate may
    leave different from the other store's: equal up to float32 rounding (as tests/python/test_extend.py)."""
    if device == "cpu":
        assert torch.equal(x, y), what
    else:
        assert (x - y).abs().max().item() <= 1e-5 * max(1.0, y.abs().max().item()), what


def _config(device, **overrides):
    kw = dict(device=device, num_layers=2, max_batch=4, max_seq_len=512, generation_window=16, extend_block=8,
              budget=32, dtype="bfloat16")
    kw.update(overrides)
    return small_config(**kw)


def _tokens(g, batch, tokens, device):
    q = torch.randn(batch, tokens, 4, 64, generator=g)
    k = torch.randn(batch, tokens, 2, 64, generator=g)
    v = torch.randn(batch, tokens, 2, 64, generator=g)
    return q.to(device), k.to(device), v.to(device)


def _rows(tensors, batch):
    """Each tensor's one row repeated `batch` times: every sequence gets the same tokens."""
    return tuple(t.expand(batch, *t.shape[1:]).contiguous() for t in tensors)


def _prefill(store, kw, slots, seed):
    g = generator(seed)
    n = len(slots)
    for layer in range(kw["num_layers"]):
        keys = torch.randn(1, PROMPT, 2, 64, generator=g).expand(n, -1, -1, -1)
        values = torch.randn(1, PROMPT, 2, 64, generator=g).expand(n, -1, -1, -1)
        q_last = torch.randn(1, 4, 64, generator=g).expand(n, -1, -1)
        store.prefill(layer, slots, keys.to(kw["device"]), values.to(kw["device"]), q_last=q_last.to(kw["device"]))


def _source_and_copies(device, **overrides):
    """a: slot 0 after a history (decode, extend, truncate: folds and a fold journal). b: slots 0-2 with that history."""
    kw = _config(device, **overrides)
    a, b = make_store(kw), make_store(kw)
    assert a.add_sequences(1) == [0]
    assert b.add_sequences(3) == [0, 1, 2]
    _prefill(a, kw, [0], seed=1)
    _prefill(b, kw, [0, 1, 2], seed=1)
    g = generator(2)
    for layer in range(kw["num_layers"]):
        for step in range(25):
            q, k, v = _tokens(g, 1, 1, device)
            x = a.decode(layer, [0], q[:, 0], k[:, 0], v[:, 0])
            y = b.decode(layer, [0, 1, 2], *_rows((q[:, 0], k[:, 0], v[:, 0]), 3))
            assert torch.equal(y, x.expand(3, -1, -1)), f"history step {step}"
        q, k, v = _tokens(g, 1, 13, device)
        a.extend(layer, [0], q, k, v)
        b.extend(layer, [0, 1, 2], *_rows((q, k, v), 3))
    a.truncate([0], 4)
    b.truncate([0, 1, 2], 4)
    assert a.memory_report()["fold_journal"] > 0
    assert a.sequence_info(0, 0)["context_chunks"] > PROMPT // 8 - 2  # folds happened
    return a, b, kw


def _info(store, layer, slot):
    info = dict(store.sequence_info(layer, slot))
    del info["shares_prompt_with"]
    return info


def _expect_same_sequences(a, b, kw, slots):
    for layer in range(kw["num_layers"]):
        for slot in slots:
            assert _info(a, layer, slot) == _info(b, layer, slot), (layer, slot)
            assert a.selected_chunks(layer, slot) == b.selected_chunks(layer, slot), (layer, slot)
            assert a.outlier_chunks(layer, slot) == b.outlier_chunks(layer, slot), (layer, slot)


PROMPT_KINDS = ("low_rank_factors", "landmarks", "outliers", "value_store")


def _prompt_bytes(store, kw):
    """The prompt state of one sequence (all layers) by kind, as far as a fork shares it: all of it on the CPU, the
    value store's runs on CUDA (which copies the rest into the child's arena, reserved per slot anyway; semantics.md).
    Right after a prefill a sequence holds its prompt state, its local window and its selection cache;
    layer_memory_after_prefill gives them by kind."""
    one = store.layer_memory_after_prefill(PROMPT)
    kinds = ("value_store",) if str(store.device).startswith("cuda") else PROMPT_KINDS
    return {kind: kw["num_layers"] * one[kind] if kind in kinds else 0 for kind in PROMPT_KINDS}


def _expect_shared_once(a, b, kw, holders):
    prompt = _prompt_bytes(a, kw)
    x, y = a.memory_report(), b.memory_report()
    extra = holders - 1  # copies of the prompt state b holds and a does not
    for kind, bytes_ in prompt.items():
        assert x[kind] + extra * bytes_ == y[kind], kind
    assert x["value_store_host"] + extra * prompt["value_store"] == y["value_store_host"]
    for kind in ("exact_tokens", "selection_cache", "fold_journal", "full_attention_equivalent"):
        assert x[kind] == y[kind], kind
    assert x["total"] + extra * sum(prompt.values()) == y["total"]
    assert x["shared"] == (sum(prompt.values()) if holders > 1 else 0)
    assert y["shared"] == 0


def test_children_equal_unshared_copies(device):
    a, b, kw = _source_and_copies(device)
    stats = a.stats()
    assert a.fork(0, 2) == [1, 2]
    assert a.stats() == stats, "fork changed stats()"
    assert a.active_slots() == [0, 1, 2]
    _expect_same_sequences(a, b, kw, [0, 1, 2])
    _expect_shared_once(a, b, kw, 3)
    for layer in range(kw["num_layers"]):
        assert a.sequence_info(layer, 0)["shares_prompt_with"] == [1, 2]
        assert a.sequence_info(layer, 1)["shares_prompt_with"] == [0, 2]
        assert a.sequence_info(layer, 2)["shares_prompt_with"] == [0, 1]
        assert b.sequence_info(layer, 1)["shares_prompt_with"] == []

    # Each sequence gets its own tokens: decode, extend (ragged) and truncate; each equals its unshared copy.
    g = generator(3)
    slots = [0, 1, 2]
    for round_ in range(2):
        for layer in range(kw["num_layers"]):
            for step in range(10):
                q, k, v = _tokens(g, 3, 1, device)
                x = a.decode(layer, slots, q[:, 0], k[:, 0], v[:, 0])
                y = b.decode(layer, slots, q[:, 0], k[:, 0], v[:, 0])
                _assert_same_output(x, y, device, f"round {round_} layer {layer} step {step}")
                assert x.norm().item() > 0.1
                for slot in slots:
                    assert a.selected_chunks(layer, slot) == b.selected_chunks(layer, slot)
            q, k, v = _tokens(g, 3, 19, device)
            x = a.extend(layer, slots, q, k, v, lengths=[19, 5, 12])
            y = b.extend(layer, slots, q, k, v, lengths=[19, 5, 12])
            _assert_same_output(x, y, device, f"round {round_} layer {layer} extend")
        a.truncate(slots, [2, 9, 0])
        b.truncate(slots, [2, 9, 0])
        _expect_same_sequences(a, b, kw, slots)
        _expect_shared_once(a, b, kw, 3)
    assert len({a.sequence_info(0, s)["total_len"] for s in slots}) == 3  # they evolved apart

    # Releasing the source leaves the children as they were.
    a.release(0)
    b.release(0)
    assert a.sequence_info(0, 1)["shares_prompt_with"] == [2]
    _expect_same_sequences(a, b, kw, [1, 2])
    _expect_shared_once(a, b, kw, 2)
    for step in range(12):
        q, k, v = _tokens(g, 2, 1, device)
        for layer in range(kw["num_layers"]):
            x = a.decode(layer, [1, 2], q[:, 0], k[:, 0], v[:, 0])
            y = b.decode(layer, [1, 2], q[:, 0], k[:, 0], v[:, 0])
            _assert_same_output(x, y, device, f"after release, step {step} layer {layer}")
    _expect_same_sequences(a, b, kw, [1, 2])
    a.release([1])
    b.release([1])
    assert a.sequence_info(0, 2)["shares_prompt_with"] == []
    _expect_shared_once(a, b, kw, 1)


@pytest.mark.parametrize("children", [1, 3])
def test_memory_counts_the_prompt_once(device, children):
    kw = _config(device)
    store = make_store(kw)
    store.add_sequences(1)
    _prefill(store, kw, [0], seed=5)
    g = generator(6)
    for _ in range(20):
        q, k, v = _tokens(g, 1, 1, device)
        store.decode(0, [0], q[:, 0], k[:, 0], v[:, 0])
    one = store.memory_report()
    prompt = _prompt_bytes(store, kw)
    assert one["shared"] == 0
    assert store.fork(0, children) == list(range(1, children + 1))
    report = store.memory_report()
    copies = children + 1
    assert report["shared"] == sum(prompt.values())
    for kind in ("low_rank_factors", "landmarks", "outliers", "value_store"):
        assert report[kind] == copies * one[kind] - children * prompt[kind], kind
    for kind in ("exact_tokens", "selection_cache", "fold_journal", "full_attention_equivalent"):
        assert report[kind] == copies * one[kind], kind
    assert report["total"] == copies * one["total"] - children * sum(prompt.values())


def test_bad_input_changes_nothing(device):
    kw = _config(device)
    store = make_store(kw)
    assert store.add_sequences(3) == [0, 1, 2]
    _prefill(store, kw, [0], seed=7)
    g = generator(8)
    store.prefill(0, [1], torch.randn(1, 40, 2, 64, generator=g).to(device),
                  torch.randn(1, 40, 2, 64, generator=g).to(device))  # slot 1: layer 0 only; slot 2: no prompt
    assert store.fork(0) == [3]
    store.release(3)

    def state():
        return (store.memory_report(), store.stats(), store.active_slots(),
                [store.sequence_info(layer, s) for layer in range(2) for s in store.active_slots()])

    before = state()
    with pytest.raises(ValueError, match="slot 3 holds no sequence"):
        store.fork(3)
    with pytest.raises(ValueError, match="out of range"):
        store.fork(4)
    with pytest.raises(ValueError, match="layer 1 of slot 1 has no prompt"):
        store.fork(1)
    with pytest.raises(ValueError, match="layer 0 of slot 2 has no prompt"):
        store.fork(2)
    with pytest.raises(ValueError, match="count >= 1"):
        store.fork(0, 0)
    with pytest.raises(ValueError, match=r"into 2 sequences: only 1 of max_batch=4 slots are free"):
        store.fork(0, 2)
    with pytest.raises(TypeError, match="count"):
        store.fork(0, "1")
    with pytest.raises(TypeError, match="slot"):
        store.fork(0.0)
    with pytest.raises(ValueError, match="slot"):
        store.fork(2**40)
    assert state() == before


def test_fork_into_the_device_budget(device):
    """value_store="auto": a child's values are where its source's are, and a child on the device takes only its own
    runs of device_value_budget (the prompt's runs are shared); when they do not fit, MemoryError, nothing changed."""
    kw = _config(device, value_store="auto")
    per_sequence = make_store(kw).value_bytes_per_sequence
    prompt_runs = _prompt_bytes(make_store(kw), kw)["value_store"]
    store = make_store(dict(kw, device_value_budget=2 * per_sequence - prompt_runs // 2))
    store.add_sequences(1)
    _prefill(store, kw, [0], seed=9)
    assert store.fork(0) == [1]
    assert store.sequence_info(1, 1)["values_on"] == "device"
    assert store.memory_report()["value_store_device"] == prompt_runs
    before = (store.memory_report(), store.active_slots())
    with pytest.raises(MemoryError, match="device_value_budget"):
        store.fork(0)
    assert (store.memory_report(), store.active_slots()) == before
    assert store.add_sequences(1) == [2]
    assert store.sequence_info(0, 2)["values_on"] == "host"


def _run_alike(a, b, kw, slots, seed):
    """Decode, a ragged extend and a truncate of `slots` in both stores, each sequence its own tokens: equal outputs."""
    device = kw["device"]
    g = generator(seed)
    n = len(slots)
    for layer in range(kw["num_layers"]):
        for step in range(8):
            q, k, v = _tokens(g, n, 1, device)
            x = a.decode(layer, slots, q[:, 0], k[:, 0], v[:, 0])
            y = b.decode(layer, slots, q[:, 0], k[:, 0], v[:, 0])
            _assert_same_output(x, y, device, f"layer {layer} step {step}")
        q, k, v = _tokens(g, n, 17, device)
        lengths = [17 - 5 * (i % 3) for i in range(n)]
        _assert_same_output(a.extend(layer, slots, q, k, v, lengths=lengths),
                            b.extend(layer, slots, q, k, v, lengths=lengths), device, f"layer {layer} extend")
    removed = [2 + 3 * (i % 3) for i in range(n)]
    a.truncate(slots, removed)
    b.truncate(slots, removed)
    _expect_same_sequences(a, b, kw, slots)


def test_parked_family_members_keep_sharing_and_resume_as_unshared_copies(device):
    """A parked child, then its parked source: the live members share the prompt (memory_report()["shared"] counts
    live sharers only), the parked ones keep it by reference; resumed (in the other order) they are a family again,
    each equal to its unshared copy in b."""
    a, b, kw = _source_and_copies(device)
    assert a.fork(0, 2) == [1, 2]
    _run_alike(a, b, kw, [0, 1, 2], seed=21)
    child, child_copy = a.park(1)[0], b.park(1)[0]
    assert a.sequence_info(0, 0)["shares_prompt_with"] == [2]
    _expect_shared_once(a, b, kw, 2)
    _run_alike(a, b, kw, [0, 2], seed=22)
    source, source_copy = a.park(0)[0], b.park(0)[0]
    assert a.sequence_info(0, 2)["shares_prompt_with"] == []
    _expect_shared_once(a, b, kw, 1)
    if device == "cpu":  # the shared prompt is not the parked objects' own while others hold it
        assert child.host_bytes < child_copy.host_bytes and source.host_bytes < source_copy.host_bytes
    assert a.resume([child, source]) == [0, 1]
    assert b.resume([child_copy, source_copy]) == [0, 1]
    for layer in range(kw["num_layers"]):
        assert a.sequence_info(layer, 0)["shares_prompt_with"] == [1, 2]
    _expect_same_sequences(a, b, kw, [0, 1, 2])
    _expect_shared_once(a, b, kw, 3)
    _run_alike(a, b, kw, [0, 1, 2], seed=23)
    _expect_shared_once(a, b, kw, 3)


def test_a_saved_child_loads_unshared(device, tmp_path):
    """save writes a child's whole state (the shared prompt too): on the CPU its file is its unshared copy's, byte for
    byte; load gives an unshared sequence (family of its own) that continues as the copy."""
    a, b, kw = _source_and_copies(device)
    assert a.fork(0, 2) == [1, 2]
    _run_alike(a, b, kw, [0, 1, 2], seed=31)
    a.save(1, tmp_path / "child.skv")
    b.save(1, tmp_path / "copy.skv")
    if device == "cpu":
        assert (tmp_path / "child.skv").read_bytes() == (tmp_path / "copy.skv").read_bytes()
    a.release(1)
    b.release(1)
    assert a.load(tmp_path / "child.skv") == 1
    assert b.load(tmp_path / "copy.skv") == 1
    assert a.sequence_info(0, 1)["shares_prompt_with"] == []
    assert a.sequence_info(0, 0)["shares_prompt_with"] == [2]
    _expect_same_sequences(a, b, kw, [0, 1, 2])
    _expect_shared_once(a, b, kw, 2)  # the family's prompt once, the loaded child's own once more
    _run_alike(a, b, kw, [0, 1, 2], seed=32)


def test_parked_members_and_the_device_budget(device):
    """value_store="auto": a parked sequence holds no device budget; parking the member that carries the shared runs
    passes their charge to a live member (as release does), and a member resumed beside a live one is charged as a
    child."""
    kw = _config(device, value_store="auto")
    per_sequence = make_store(kw).value_bytes_per_sequence
    prompt_runs = _prompt_bytes(make_store(kw), kw)["value_store"]
    store = make_store(dict(kw, device_value_budget=2 * per_sequence - prompt_runs // 2))
    store.add_sequences(1)
    _prefill(store, kw, [0], seed=9)
    assert store.fork(0) == [1]
    source = store.park(0)
    assert store.memory_report()["value_store_device"] == prompt_runs
    assert store.add_sequences(1) == [0]  # no room on the device: the child carries the shared runs now
    assert store.sequence_info(0, 0)["values_on"] == "host"
    store.release(0)
    assert store.resume(source) == [0]  # beside the child: a child's charge, which fits
    assert store.sequence_info(0, 0)["values_on"] == "device"
    assert store.sequence_info(0, 0)["shares_prompt_with"] == [1]
    family = store.park([0, 1])
    assert store.add_sequences(1) == [0]
    assert store.sequence_info(0, 0)["values_on"] == "device"
    with pytest.raises(MemoryError, match="device_value_budget"):
        store.resume(family)
    assert all(p.tokens > 0 for p in family)  # nothing changed
    store.release(0)
    assert store.resume(family) == [0, 1]
    assert store.sequence_info(0, 1)["shares_prompt_with"] == [0]
