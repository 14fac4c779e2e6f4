"""KVStore.park / resume and save / load from Python (docs/semantics.md, "Fork, park and save"; the file format:
docs/api.md, "Saved sequences").

The equality is the proof: a sequence parked and resumed, or saved and loaded (in this process or in a new one),
continues bit for bit as a twin that was never parked or saved (a second store fed the same tokens): decode and extend
outputs, selections, counters, a truncate that reads the fold journal, and the growth of hits and misses. Every
refusal raises a clear error and leaves the store as it was; none of the calls moves stats().

Parametrised over SHADOWKV_TEST_DEVICES like the other suites. A backend that cannot park or save raises ValueError
("cannot fork, park or save sequences") at the test's first such call, and the test is skipped there (the CPU and
CUDA backends implement them; CUDA's implementation, cuda/backend/keeping.cpp, had not run on a GPU when this was
written).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import generator, make_store, small_config

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
LAYERS = 2
WINDOW = 16

# Store variants whose saved state holds other arrays.
VARIANTS = {
    "plain": {},
    "lru_cache": dict(cache_tokens=48),
    "fp8_values": dict(value_dtype="float8_e4m3"),
    "two_centroids": dict(chunk_score="two_centroids"),
    "bfloat16": dict(dtype="bfloat16"),
}


def store_kwargs(device, **overrides):
    """Two layers, GQA 4/2, D 64, chunks of 8, a budget of 3 chunks, window 16 (a fold every 8 tokens once full),
    extend blocks of 8, four slots."""
    kw = small_config(device=device, num_layers=LAYERS, max_batch=4, max_seq_len=400, budget=24,
                      generation_window=WINDOW, extend_block=8)
    kw.update(overrides)
    return kw


@contextlib.contextmanager
def keeping(device):
    """Wraps a test's first park or save: skips the test where the backend cannot park or save."""
    try:
        yield
    except ValueError as error:
        if "cannot fork, park or save" in str(error):
            pytest.skip(f"the {device} backend does not park or save sequences yet ({error})")
        raise


def _tokens(g, tokens, device):
    q = torch.randn(1, tokens, 4, 64, generator=g)
    k = torch.randn(1, tokens, 2, 64, generator=g)
    v = torch.randn(1, tokens, 2, 64, generator=g)
    return q.to(device), k.to(device), v.to(device)


def prefill(store, slots, device, seed):
    """Prompts of 90 and 71 tokens (one of 90 for one slot) in every layer, with a warm-up query."""
    g = generator(seed)
    batch = len(slots)
    for layer in range(LAYERS):
        keys = torch.randn(batch, 90, 2, 64, generator=g)
        values = torch.randn(batch, 90, 2, 64, generator=g)
        q_last = torch.randn(batch, 4, 64, generator=g)
        store.prefill(layer, slots, keys.to(device), values.to(device), lengths=[90, 71][:batch],
                      q_last=q_last.to(device))


def advance(store, slot, device, seed, extend_tokens=30, decodes=9):
    """An extend (blocks of 8, folds on the way) and decode steps of every layer of `slot`; returns the outputs."""
    g = generator(seed)
    outputs = []
    q, k, v = _tokens(g, extend_tokens, device)
    for layer in range(LAYERS):
        outputs.append(store.extend(layer, slot, q, k, v).cpu())
    for _ in range(decodes):
        q, k, v = _tokens(g, 1, device)
        for layer in range(LAYERS):
            outputs.append(store.decode(layer, slot, q[:, 0], k[:, 0], v[:, 0]).cpu())
    return outputs


def history(store, device):
    """Slots 0 and 1 with prompts, generated tokens, folds, a fold journal and a selection cache."""
    assert store.add_sequences(2) == [0, 1]
    prefill(store, [0, 1], device, seed=17)
    for slot in (0, 1):
        advance(store, slot, device, seed=100 + slot)
    assert store.memory_report()["fold_journal"] > 0
    assert store.stats()["folds"] > 0
    assert all(store.selected_chunks(layer, 0)[0] for layer in range(LAYERS))


def future(store, slot, device, seed):
    """What a fixed future of `slot` shows: a truncate of a window's worth of tokens first (it undoes folds from the
    fold journal as it was kept), decode steps (folds on the way), extends of several blocks and of one token, another
    truncate and decode steps; each layer's counters and selections on the way; and the growth of the stats (hits and
    misses depend on the selection cache's slots and LRU stamps, which no output shows)."""
    g = generator(seed)
    before = store.stats()
    results = []

    def record():
        for layer in range(LAYERS):
            results.append((store.sequence_info(layer, slot), store.selected_chunks(layer, slot)))

    record()
    folds = store.sequence_info(0, slot)["context_chunks"]
    store.truncate(slot, WINDOW)
    assert store.sequence_info(0, slot)["context_chunks"] < folds, "the truncate undid no fold"
    record()
    for _ in range(11):
        q, k, v = _tokens(g, 1, device)
        for layer in range(LAYERS):
            results.append(store.decode(layer, slot, q[:, 0], k[:, 0], v[:, 0]).cpu())
    record()
    for tokens in (19, 1):
        q, k, v = _tokens(g, tokens, device)
        for layer in range(LAYERS):
            results.append(store.extend(layer, slot, q, k, v).cpu())
    store.truncate(slot, WINDOW)
    for _ in range(5):
        q, k, v = _tokens(g, 1, device)
        for layer in range(LAYERS):
            results.append(store.decode(layer, slot, q[:, 0], k[:, 0], v[:, 0]).cpu())
    record()
    after = store.stats()
    results.append({name: after[name] - before[name] for name in after if name != "hit_rate"})
    return results


def assert_same(x, y, what):
    assert len(x) == len(y), what
    for i, (a, b) in enumerate(zip(x, y)):
        if isinstance(a, torch.Tensor):
            assert torch.isfinite(a).all() and a.norm().item() > 0.05, f"{what}: result {i}"
            assert torch.equal(a, b), f"{what}: result {i} differs"
        else:
            assert a == b, f"{what}: result {i}: {a} != {b}"


def snapshot(store):
    """The store's observable state: active slots, memory report, stats, every sequence's counters."""
    slots = store.active_slots()
    return (slots, store.memory_report(), store.stats(),
            [store.sequence_info(layer, slot) for slot in slots for layer in range(LAYERS)])


def twins(device, **overrides):
    kw = store_kwargs(device, **overrides)
    a, b = make_store(kw), make_store(kw)
    for store in (a, b):
        history(store, device)
    return a, b, kw


# --------------------------------------------------------------------------------------------------------------------
# park and resume
# --------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_park_then_resume_continues_bit_for_bit(device, variant):
    a, b, _ = twins(device, **VARIANTS[variant])
    stats = a.stats()
    memory = a.memory_report()["total"]
    with keeping(device):
        parked = a.park([0])
    assert a.stats() == stats
    (p,) = parked
    assert type(p).__name__ == "ParkedSequence"
    assert p.parked_from == 0 and p.tokens == b.sequence_info(0, 0)["total_len"]
    assert p.host_bytes >= memory - a.memory_report()["total"] > 0
    assert repr(p).startswith(f"ParkedSequence(tokens={p.tokens}, host_bytes={p.host_bytes}")
    assert a.active_slots() == [1]
    q, k, v = _tokens(generator(3), 1, device)
    with pytest.raises(ValueError, match="parked"):
        a.decode(0, 0, q[:, 0], k[:, 0], v[:, 0])
    # The freed slot serves another sequence meanwhile.
    assert a.add_sequences(1) == [0]
    prefill(a, [0], device, seed=99)
    advance(a, 0, device, seed=98, extend_tokens=13, decodes=12)

    assert a.resume(p) == [2]
    assert repr(p) == "ParkedSequence(resumed, parked_from=0)" and p.tokens == 0 and p.host_bytes == 0
    assert_same(future(a, 2, device, 5), future(b, 0, device, 5), "resumed against never parked")
    assert_same(future(a, 1, device, 6), future(b, 1, device, 6), "the other sequence")


def test_park_several_and_resume_in_another_order(device):
    a, b, _ = twins(device)
    with keeping(device):
        first, second = a.park([1, 0])
    assert (first.parked_from, second.parked_from) == (1, 0)
    assert a.active_slots() == [] and a.memory_report()["total"] == 0
    with pytest.raises(ValueError, match="parked"):
        a.release(0)
    assert a.resume([second, first]) == [0, 1]
    assert_same(future(a, 0, device, 7), future(b, 0, device, 7), "slot 0")
    assert_same(future(a, 1, device, 8), future(b, 1, device, 8), "slot 1")
    # A slot taken again and released no longer names the parked sequence.
    a.release(0)
    q, k, v = _tokens(generator(3), 1, device)
    with pytest.raises(ValueError, match=r"never added, or released"):
        a.decode(0, 0, q[:, 0], k[:, 0], v[:, 0])


def test_park_and_resume_refusals_change_nothing(device):
    a, b, kw = twins(device)
    with keeping(device):
        assert a.resume(a.park(0)) == [0]  # (an exact round trip: the twins stay equal)
    assert a.add_sequences(1) == [2]  # layer 0 only: not parkable
    prefill_one_layer = torch.randn(1, 40, 2, 64, generator=generator(4)).to(device)
    a.prefill(0, 2, prefill_one_layer, prefill_one_layer)
    before = snapshot(a)
    for slots, message in (([], "at least one"), ([3], "holds no sequence"), ([0, 0], "twice"),
                           ([5], "out of range"), ([0, 2], "layer 1 of slot 2 has no prompt")):
        with pytest.raises(ValueError, match=message):
            a.park(slots)
        assert snapshot(a) == before
    with pytest.raises(TypeError, match="slots"):
        a.park("0")

    (p,) = a.park([0])
    parked = snapshot(a)
    with pytest.raises(ValueError, match="at least one"):
        a.resume([])
    with pytest.raises(ValueError, match="same parked sequence"):
        a.resume([p, p])
    with pytest.raises(TypeError, match="ParkedSequence"):
        a.resume([p, 1])
    with pytest.raises(TypeError, match="ParkedSequence"):
        a.resume("p")
    (foreign,) = b.park([1])
    with pytest.raises(ValueError, match="another store"):
        a.resume(foreign)
    with pytest.raises(ValueError, match="another store"):
        a.resume([p, foreign])  # all or nothing: p stays parked
    assert snapshot(a) == parked and p.tokens > 0 and foreign.tokens > 0
    assert a.add_sequences(2) == [0, 3]
    full = snapshot(a)
    with pytest.raises(ValueError, match="slots are free"):
        a.resume(p)
    assert snapshot(a) == full and p.tokens > 0
    a.release([0, 3])
    assert a.resume(p) == [0]
    with pytest.raises(ValueError, match="resumed already"):
        a.resume(p)
    assert b.resume(foreign) == [1]
    assert_same(future(a, 0, device, 9), future(b, 0, device, 9), "slot 0")
    assert_same(future(a, 1, device, 10), future(b, 1, device, 10), "slot 1")


# --------------------------------------------------------------------------------------------------------------------
# save and load
# --------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_save_then_load_in_this_process_continues_bit_for_bit(device, variant, tmp_path):
    a, b, kw = twins(device, **VARIANTS[variant])
    path = tmp_path / "saved.skv"
    before = snapshot(a)
    with keeping(device):
        a.save(0, path)
    assert snapshot(a) == before  # save changes nothing
    assert not (tmp_path / "saved.skv.tmp").exists()
    assert a.load(path) == 2
    c = make_store(kw)
    assert c.load(str(path)) == 0
    assert a.stats() == b.stats() and c.stats()["decode_steps"] == 0  # load moves no counter
    expected = future(b, 0, device, 11)
    assert_same(future(a, 2, device, 11), expected, "loaded into the saving store")
    assert_same(future(c, 0, device, 11), expected, "loaded into a new store")
    assert_same(future(a, 0, device, 11), expected, "the saved sequence itself")


def test_save_then_load_in_a_new_process_continues_bit_for_bit(device, tmp_path):
    a, b, kw = twins(device, **VARIANTS["lru_cache"])
    path = tmp_path / "saved.skv"
    with keeping(device):
        a.save(1, path)
    out = tmp_path / "future.pt"
    script = textwrap.dedent(f"""
        import json, sys
        import torch
        sys.path.insert(0, {TESTS_DIR!r})
        import test_keeping
        from helpers import make_store
        kw = json.loads(sys.argv[1])
        store = make_store(kw)
        slot = store.load(sys.argv[2])
        torch.save({{"slot": slot, "future": test_keeping.future(store, slot, kw["device"], 12)}}, sys.argv[3])
        """)
    subprocess.run([sys.executable, "-c", script, json.dumps(kw), str(path), str(out)], check=True, timeout=600)
    loaded = torch.load(out, weights_only=False)
    assert loaded["slot"] == 0
    assert_same(loaded["future"], future(b, 1, device, 12), "loaded in a new process")


def test_load_into_a_store_of_other_capacity(device, tmp_path):
    a, b, kw = twins(device)
    path = tmp_path / "saved.skv"
    with keeping(device):
        a.save(1, path)
    # max_batch and max_seq_len decide no saved byte.
    small = make_store(dict(kw, max_batch=1, max_seq_len=300))
    assert small.load(path) == 0
    assert_same(future(small, 0, device, 13), future(b, 1, device, 13), "a store of one slot")
    # One that cannot hold the sequence's tokens refuses it.
    tokens = a.sequence_info(0, 1)["total_len"]
    tight = make_store(dict(kw, max_seq_len=tokens - 1))
    with pytest.raises(ValueError, match="more than this store's max_seq_len"):
        tight.load(path)
    assert tight.active_slots() == []


def test_stats_do_not_move(device, tmp_path):
    a, _, _ = twins(device)
    stats = a.stats()
    with keeping(device):
        parked = a.park([0, 1])
    assert a.stats() == stats
    assert a.resume(parked) == [0, 1]
    assert a.stats() == stats
    a.save(0, tmp_path / "saved.skv")
    assert a.stats() == stats
    a.load(tmp_path / "saved.skv")
    assert a.stats() == stats


def _header_size(data: bytes) -> int:
    """The offset of the first section (docs/api.md, "Saved sequences")."""
    at = 12
    at += 4 + struct.unpack_from("<I", data, at)[0]  # layout
    at += 4 + struct.unpack_from("<I", data, at)[0]  # fingerprint
    layers = struct.unpack_from("<I", data, at)[0]
    at += 4 + layers * 8 * 8 + 1
    sections = struct.unpack_from("<I", data, at)[0]
    at += 4
    for _ in range(sections):
        at += 4 + struct.unpack_from("<I", data, at)[0] + 8
    return at


class _SavedFile:
    """A store whose slot 0 was saved, and the file's bytes."""

    def __init__(self, device, tmp_path):
        self.store, _, self.kw = twins(device)
        self.tmp_path = tmp_path
        self.path = tmp_path / "saved.skv"
        with keeping(device):
            self.store.save(0, self.path)
        self.data = self.path.read_bytes()
        self.header = _header_size(self.data)
        assert 1000 < self.header < len(self.data) - 1000

    def refused(self, data: bytes, error, match: str):
        """Loading `data` raises `error` matching `match` and changes nothing."""
        bad = self.tmp_path / "bad.skv"
        bad.write_bytes(data)
        before = snapshot(self.store)
        with pytest.raises(error, match=match):
            self.store.load(bad)
        assert snapshot(self.store) == before


@pytest.mark.parametrize("field,value", [
    ("rank", 16), ("chunk_size", 4), ("dtype", "bfloat16"), ("generation_window", 32), ("num_layers", 3),
    ("rope_theta", 500000.0), ("value_dtype", "float8_e4m3"), ("cache_tokens", 48), ("group_score", "max"),
])
def test_load_refuses_another_configuration_naming_the_field(device, tmp_path, field, value):
    saved = _SavedFile(device, tmp_path)
    other = make_store(dict(saved.kw, **{field: value}))
    name = {"value_dtype": "value_format"}.get(field, field)
    with pytest.raises(ValueError, match=f"another configuration: {name} is "):
        other.load(saved.path)
    assert other.active_slots() == [] and other.memory_report()["total"] == 0


def test_load_refuses_truncated_files(device, tmp_path):
    saved = _SavedFile(device, tmp_path)
    n, header = len(saved.data), saved.header
    for size in (0, 5, 8, 14, 40, header // 2, header - 3, header, header + 77, n // 2, n - 9, n - 1):
        saved.refused(saved.data[:size], ValueError, "truncated")
    saved.refused(saved.data[:-100], ValueError, f"truncated: expected {n} bytes, the file has {n - 100}")
    saved.refused(saved.data + b"x", ValueError, "corrupted")


def test_load_refuses_a_flipped_byte_anywhere(device, tmp_path):
    saved = _SavedFile(device, tmp_path)
    n, header = len(saved.data), saved.header
    positions = list(range(0, header, 5)) + list(range(header, n, (n - header) // 40)) + list(range(n - 8, n))
    for i in positions:
        flipped = bytearray(saved.data)
        flipped[i] ^= 0x10
        # Any refusal (the magic, the version, a length, the checksum); past the header it is the checksum.
        saved.refused(bytes(flipped), ValueError, "checksum" if i >= header else "load")


def test_load_refuses_magic_version_and_a_full_store(device, tmp_path):
    saved = _SavedFile(device, tmp_path)
    saved.refused(b"X" + saved.data[1:], ValueError, "not a saved sequence")
    saved.refused(saved.data[:8] + struct.pack("<I", 2) + saved.data[12:], ValueError, "format version 2")
    assert saved.store.add_sequences(2) == [2, 3]
    saved.refused(saved.data, ValueError, "no free slot")


def test_files_that_cannot_be_read_or_written(device, tmp_path):
    saved = _SavedFile(device, tmp_path)
    store = saved.store
    before = snapshot(store)
    with pytest.raises(FileNotFoundError):
        store.load(tmp_path / "missing.skv")
    with pytest.raises(IsADirectoryError):
        store.load(tmp_path)
    missing_dir = tmp_path / "no_such_dir" / "saved.skv"
    with pytest.raises(FileNotFoundError):
        store.save(0, missing_dir)
    assert not (tmp_path / "no_such_dir").exists()
    a_directory = tmp_path / "a_directory"
    a_directory.mkdir()
    with pytest.raises(OSError):
        store.save(0, a_directory)
    assert a_directory.is_dir() and not (tmp_path / "a_directory.tmp").exists()
    assert snapshot(store) == before
    with pytest.raises(TypeError, match="path"):
        store.save(0, 12)
    with pytest.raises(TypeError, match="path"):
        store.load(None)
    with pytest.raises(ValueError, match="holds no sequence"):
        store.save(3, saved.path)
    assert store.add_sequences(1) == [2]
    with pytest.raises(ValueError, match="no prompt"):
        store.save(2, saved.path)
    assert saved.path.read_bytes() == saved.data  # the earlier file is intact
    # str, bytes and os.PathLike paths alike.
    store.release(2)
    assert store.load(os.fsencode(str(saved.path))) == 2
    assert store.load(pathlib.PurePath(saved.path)) == 3


def test_parked_sequences_alive_at_interpreter_exit_leak_nothing():
    """A ParkedSequence held at exit (by a daemon thread, a cycle, a global) is freed by the package's exit handler,
    as stores are: nanobind reports no leaked instance."""
    script = textwrap.dedent("""
        import threading, time
        import torch
        from shadowkv_core import KVStore
        store = KVStore(1, 4, 2, 64, max_batch=4, max_seq_len=256, rank=8, budget=16, dtype="float32")
        slots = store.add_sequences(3)
        store.prefill(0, slots, torch.randn(3, 40, 2, 64), torch.randn(3, 40, 2, 64))
        first, second, third = store.park(slots)
        threading.Thread(target=lambda p=first: time.sleep(600), daemon=True).start()
        class Holder: pass
        h = Holder(); h.self = h; h.parked = second
        del first, second, h
        kept = third
        print("ok")
        """)
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
    assert "leaked" not in result.stderr, result.stderr
