"""The API's defaults and the small defects of issue 51 (items 5 and 6):

* one RoPE convention: with defaults only, prefill and decode take post-RoPE keys, and at full rank and budget the
  output equals exact attention over those keys;
* the default rank is min(160, Hkv*D), valid for every shape; an explicit rank above Hkv*D stays a ValueError;
* MemoryFootprintWarning when a configuration holds more bytes per token than full attention (with the numbers);
* an ``out=`` whose elements overlap (``expand``) is a ValueError, the store unchanged;
* wrongly typed arguments (``slots=None`` first) name themselves;
* no nanobind "leaked instances" warning at interpreter exit, whatever holds a store then;
* an allocation failure while the bindings convert a slot list is a MemoryError, not an abort.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import helpers as H
import reference as R
import shadowkv_core
from shadowkv_core import KVStore, MemoryFootprintWarning

PYTHON_DIR = os.path.dirname(os.path.dirname(shadowkv_core.__file__))


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


# --- one RoPE convention ---------------------------------------------------------------------------------------------
def test_defaults_take_post_rope_keys_in_prefill_and_decode(device):
    seed = 5101
    g = H.generator(seed)
    hq, hkv, d, prompt, steps = 4, 2, 64, 150, 24
    store = KVStore(1, hq, hkv, d, max_seq_len=256, rank=hkv * d, budget=256, outlier_chunks=2, local_chunks=2,
                    generation_window=16, dtype="float32", device=device)
    slot = store.add_sequences(1)[0]
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rope_theta=10000.0)
    keys = H.rope(kw, H.randn(g, prompt, hkv, d) + H.randn(g, 1, hkv, d, scale=0.5), torch.arange(prompt))
    values = H.randn(g, prompt, hkv, d)
    store.prefill(0, [slot], keys[None].to(device), values[None].to(device))  # defaults only
    all_keys, all_values = [keys], [values]
    for step in range(steps):  # folds on the way (window 16)
        q = H.randn(g, hq, d)
        k = H.rope(kw, H.randn(g, 1, hkv, d), torch.tensor([prompt + step]))[0]
        v = H.randn(g, hkv, d)
        out = store.decode(0, [slot], q[None].to(device), k[None].to(device), v[None].to(device))[0].cpu()
        all_keys.append(k[None])
        all_values.append(v[None])
        expected = R.full_attention(q, torch.cat(all_keys), torch.cat(all_values))
        H.assert_nontrivial(out, "decode output", seed)
        torch.testing.assert_close(out.double(), expected, atol=2e-4 if device != "cpu" else 5e-5, rtol=0,
                                   msg=f"seed {seed} step {step}: defaults are not one post-RoPE convention")


# --- default rank ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hkv, d, expected", [(2, 64, 128), (1, 64, 64), (3, 64, 160), (8, 128, 160)])
def test_default_rank_fits_every_shape(hkv, d, expected):
    store = KVStore(num_layers=1, num_q_heads=2 * hkv, num_kv_heads=hkv, head_dim=d)
    assert store.config["rank"] == expected
    assert KVStore(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, rank=None).config["rank"] == 128


def test_explicit_rank_above_kv_width_is_still_an_error():
    with pytest.raises(ValueError, match="rank"):
        KVStore(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, rank=129)
    with pytest.raises(ValueError, match="rank"):  # the default is spelled None in Python
        KVStore(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, rank=0)
    with pytest.raises(TypeError, match="rank"):
        KVStore(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, rank="64")


# --- footprint warning ----------------------------------------------------------------------------------------------
def test_footprint_warning_when_a_store_holds_more_than_full_attention():
    with pytest.warns(MemoryFootprintWarning) as record:  # SmolLM2-135M's attention at 4K with the defaults
        store = KVStore(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, max_seq_len=4096)
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    report = store.layer_memory_after_prefill(4096)
    ratio = report["total"] / report["full_attention_equivalent"]
    assert 1.5 < ratio < 1.7
    for text in (f"{ratio:.2f}x", str(report["total"]), str(report["full_attention_equivalent"]), "rank=160",
                 "budget=2048", "max_seq_len=4096"):
        assert text in message, (text, message)
    assert record[0].filename == __file__, "the warning points at the caller's line"
    assert issubclass(MemoryFootprintWarning, ResourceWarning)


def test_no_footprint_warning_where_the_store_saves_memory():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryFootprintWarning)
        store = KVStore(num_layers=1, num_q_heads=32, num_kv_heads=8, head_dim=128, max_seq_len=65536)
        KVStore(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, max_seq_len=4096, rank=32, budget=256)
    report = store.layer_memory_after_prefill(65536)
    assert report["total"] < report["full_attention_equivalent"]


def test_layer_memory_after_prefill_is_what_a_prefill_holds():
    seed = 5102
    g = H.generator(seed)
    kw = H.small_config(max_seq_len=256)
    for length in (5, 60, 256):
        store = H.make_store(kw)
        slot = store.add_sequences(1)[0]
        keys = H.randn(g, 1, length, kw["num_kv_heads"], kw["head_dim"])
        store.prefill(0, [slot], keys, keys)
        got, want = store.memory_report(), store.layer_memory_after_prefill(length)
        assert {k: got[k] for k in H.memory_kinds()} == {k: want[k] for k in H.memory_kinds()}, (seed, length)
        assert got["full_attention_equivalent"] == want["full_attention_equivalent"]
    with pytest.raises(ValueError, match="prompt_tokens"):
        store.layer_memory_after_prefill(257)


def test_footprint_warning_is_shown_by_default():
    result = _run_python("""
        from shadowkv_core import KVStore
        KVStore(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, max_seq_len=4096)
    """)
    assert result.returncode == 0, result.stderr
    assert "MemoryFootprintWarning" in result.stderr and "1.59x" in result.stderr, result.stderr


# --- out= of overlapping elements ----------------------------------------------------------------------------------
def test_decode_refuses_an_out_whose_elements_overlap(device):
    seed = 5103
    g = H.generator(seed)
    kw = H.small_config()
    hq, hkv, d = kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"]
    stores = [H.make_store(dict(kw, device=device)) for _ in range(2)]
    keys, values = H.randn(g, 2, 80, hkv, d).to(device), H.randn(g, 2, 80, hkv, d).to(device)
    for s in stores:
        s.add_sequences(2)
        s.prefill(0, [0, 1], keys, values)
    q, k, v = (H.randn(g, 2, h, d).to(device) for h in (hq, hkv, hkv))
    subject, twin = stores
    for bad in (torch.empty(1, hq, d, device=device).expand(2, hq, d),
                torch.empty(2, 1, d, device=device).expand(2, hq, d),
                torch.empty(2, hq, 1, device=device).expand(2, hq, d)):
        with pytest.raises(ValueError, match="overlap"):
            subject.decode(0, [0, 1], q, k, v, out=bad)
        assert subject.sequence_info(0, 0) == twin.sequence_info(0, 0), "a refused call changes nothing"
    # Distinct elements in another layout ([Hq, B, D] memory) are written as a contiguous out is.
    transposed = torch.empty(hq, 2, d, device=device).transpose(0, 1)
    got = subject.decode(0, [0, 1], q, k, v, out=transposed)
    assert got is transposed
    want = twin.decode(0, [0, 1], q, k, v)
    H.assert_nontrivial(want.cpu(), "decode output", seed)
    assert torch.equal(got, want), seed
    assert subject.stats() == twin.stats()


# --- wrongly typed arguments name themselves ----------------------------------------------------------------------------
def test_wrongly_typed_arguments_name_themselves():
    kw = H.small_config()
    hq, hkv, d = kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"]
    store = H.make_store(kw)
    slot = store.add_sequences(1)[0]
    keys = torch.zeros(1, 40, hkv, d)
    store.prefill(0, [slot], keys, keys)
    q, k = torch.zeros(1, hq, d), torch.zeros(1, hkv, d)
    calls = {
        "slots": [lambda: store.decode(0, None, q, k, k), lambda: store.decode(0, slots=None, q=q, k_new=k, v_new=k),
                  lambda: store.prefill(0, None, keys, keys), lambda: store.release(None),
                  lambda: store.account_replayed_steps(0, None, 1), lambda: store.decode(0, "0", q, k, k),
                  lambda: store.decode(0, [None], q, k, k), lambda: store.decode(0, 1.0, q, k, k)],
        "layer": [lambda: store.decode(None, [slot], q, k, k), lambda: store.decode("0", [slot], q, k, k),
                  lambda: store.sequence_info(None, slot)],
        "slot": [lambda: store.selected_chunks(0, None)],
        "q": [lambda: store.decode(0, [slot], None, k, k), lambda: store.decode(0, [slot], [1.0], k, k)],
        "k_new": [lambda: store.decode(0, [slot], q, None, k)],
        "v_new": [lambda: store.decode(0, [slot], q, k, "v")],
        "out": [lambda: store.decode(0, [slot], q, k, k, out=[0.0])],
        "positions": [lambda: store.decode(0, [slot], q, k, k, positions="1")],
        "k_new_post_rope": [lambda: store.decode(0, [slot], q, k, k, k_new_post_rope=None)],
        "keys_post_rope": [lambda: store.prefill(0, [slot], keys, keys, keys_post_rope="yes")],
        "count": [lambda: store.add_sequences(None)],
    }
    for name, bad_calls in calls.items():
        for call in bad_calls:
            with pytest.raises((TypeError, ValueError)) as error:
                call()
            assert name in str(error.value), (name, str(error.value))
            assert "has no len" not in str(error.value)
    assert store.sequence_info(0, slot)["total_len"] == 40 and store.stats()["decode_steps"] == 0


# --- interpreter exit -----------------------------------------------------------------------------------------------
def test_no_leak_warning_at_interpreter_exit():
    result = _run_python("""
        import gc, threading, time
        import torch
        from shadowkv_core import KVStore

        def make():
            return KVStore(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, max_batch=2, max_seq_len=256,
                           rank=32, budget=64, outlier_chunks=2)

        # Every call of the API once, then release.
        s = make()
        slots = s.add_sequences(2)
        for layer in range(2):
            s.prefill(layer, slots, torch.randn(2, 100, 2, 64), torch.randn(2, 100, 2, 64))
            s.decode(layer, slots, torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64))
        s.memory_report(); s.stats(); s.sequence_info(0, 0); s.selected_chunks(0, 0); s.attended_chunks(0, 0)
        s.config; repr(s); s.layer_memory_after_prefill(256); s.reset_stats()
        s.release(slots)
        try:
            s.decode(0, [0], None, None, None)
        except ValueError:
            pass
        alive_at_exit = make()                     # a store left alive in a global
        class Holder: pass
        h = Holder(); h.self = h; h.store = make()  # one referenced from a cycle
        del h
        held = make()                              # one held by a daemon thread's frame at exit
        threading.Thread(target=lambda store=held: time.sleep(600), daemon=True).start()
        del held
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
    assert "leaked" not in result.stderr, result.stderr


def test_a_store_used_after_exit_began_says_so():
    # An exit handler registered before shadowkv_core was imported runs after the one that frees the stores (LIFO).
    result = _run_python("""
        import atexit
        holder = {}
        def late():
            try:
                holder["store"].stats()
            except RuntimeError as error:
                print("closed:", error)
        atexit.register(late)
        from shadowkv_core import KVStore
        holder["store"] = KVStore(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, rank=32, budget=64,
                                  max_seq_len=256)
    """)
    assert result.returncode == 0, result.stderr
    assert "closed: this KVStore was closed at interpreter exit" in result.stdout, (result.stdout, result.stderr)
    assert "leaked" not in result.stderr, result.stderr


# --- allocation failure inside the bindings' conversions -----------------------------------------------------------------
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", "") or "libclang_rt.asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under AddressSanitizer (tests/sanitize_cpu.sh) operator new reports an impossible "
                           "allocation and ends the process instead of throwing std::bad_alloc")
def test_allocation_failure_converting_a_slot_list_is_a_memory_error():
    # A sequence claiming 2^60 entries: converting it reserves 4 EiB, which fails. nanobind's own list caster did that
    # in noexcept code (std::terminate); the bindings convert in the call's body, where it is a MemoryError.
    result = _run_python("""
        from shadowkv_core import KVStore

        class Huge:
            def __len__(self):
                return 2**60
            def __getitem__(self, i):
                if i >= 2**60:
                    raise IndexError(i)
                return 0

        s = KVStore(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, rank=32, budget=64, max_seq_len=256)
        s.add_sequences(1)
        for name, call in [("release", lambda: s._store.release(Huge())),
                           ("account_replayed_steps", lambda: s._store.account_replayed_steps(0, Huge(), 1))]:
            try:
                call()
            except MemoryError:
                print(name, "MemoryError")
        print(s.active_slots())
    """)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "release MemoryError" in result.stdout and "account_replayed_steps MemoryError" in result.stdout
    assert "[0]" in result.stdout, "the store is as it was"
