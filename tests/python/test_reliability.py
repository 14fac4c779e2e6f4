"""Reliability: no crash, no hang, no half-applied call (docs/errors.md, docs/semantics.md "Capacity and errors").

* account_replayed_steps: rejected on a backend that cannot replay (CPU); a step count past capacity (even 2**63-1)
  is rejected at once, never looped over.
* Threads: concurrent calls on one store are serialised; counters are exact and outputs are those of a serial order.
* Argument types: integers, flags and sequences are taken exactly (no coercion of str, bool or float), integers are
  range-checked against their C types, and the error names the argument.
* Non-finite inputs are rejected before anything changes; huge finite keys work.
* Configurations that cannot be served fail at construction, naming the bytes; a budget above capacity is clamped.
"""

import os
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from helpers import generator, make_store, randn, small_config
from test_errors import HKV, HQ, D, Twins, kv

import shadowkv_core


# --------------------------------------------------------------------------------------------------------------------
# account_replayed_steps
# --------------------------------------------------------------------------------------------------------------------

def replay_config(device="cpu", **overrides):
    """The issue's reproducer: 1 layer, Hq 4, Hkv 2, D 64, max_seq_len 200, rank 32, budget 24 tokens, 2 outlier and
    2 local chunks, window 16, float32."""
    kw = small_config(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, max_batch=2, max_seq_len=200,
                      rank=32, budget=24, outlier_chunks=2, local_chunks=2, generation_window=16, dtype="float32",
                      device=device)
    kw.update(overrides)
    return kw


def test_account_replayed_steps_is_rejected_on_cpu_and_later_decodes_are_sound():
    g = generator(501)
    store, twin = make_store(replay_config()), make_store(replay_config())
    keys, values = randn(g, 1, 60, HKV, D), randn(g, 1, 60, HKV, D)
    for s in (store, twin):
        s.add_sequences(1)
        s.prefill(0, [0], keys, values, keys_post_rope=False)
    before = store.sequence_info(0, 0)
    with pytest.raises(ValueError, match=r"(?i)replay"):
        store.account_replayed_steps(0, [0], 20)
    assert store.sequence_info(0, 0) == before
    assert store.stats()["decode_steps"] == 0
    for step in range(30):                      # the windows fold on the way
        q, k, v = randn(g, 1, HQ, D), randn(g, 1, HKV, D), randn(g, 1, HKV, D)
        out = store.decode(0, [0], q, k, v)
        assert torch.isfinite(out).all(), f"step {step}"
        torch.testing.assert_close(out, twin.decode(0, [0], q, k, v), atol=0, rtol=0)
    assert store.sequence_info(0, 0)["total_len"] == 90
    assert store.sequence_info(0, 0) == twin.sequence_info(0, 0)


def test_account_replayed_steps_with_a_huge_count_returns_at_once(device):
    """2**63 - 1 steps used to overflow the capacity check and loop (holding the GIL); run in a child process so that a
    regression fails with a timeout instead of hanging the suite."""
    script = textwrap.dedent(f"""
        import torch
        from shadowkv_core import KVStore
        store = KVStore(**{replay_config(device)!r})
        store.add_sequences(1)
        store.prefill(0, [0], torch.randn(1, 60, {HKV}, {D}, device="{device}"),
                      torch.randn(1, 60, {HKV}, {D}, device="{device}"))
        for steps in (2**63 - 1, 2**62, 200 - 60 + 1):
            try:
                store.account_replayed_steps(0, [0], steps)
                print("accepted", steps)
            except ValueError as error:
                print("ValueError", error)
        print("total_len", store.sequence_info(0, 0)["total_len"])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("ValueError") for line in lines[:3]), result.stdout
    expected = r"(?i)replay" if device == "cpu" else r"(?i)max_seq_len"
    for line in lines[:3]:
        assert re.search(expected, line), line
    assert lines[3] == "total_len 60", result.stdout


# --------------------------------------------------------------------------------------------------------------------
# threads
# --------------------------------------------------------------------------------------------------------------------

THREADS, CALLS = 4, 50


def run_threads(worker):
    errors = []

    def guarded(index):
        try:
            worker(index)
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_concurrent_decodes_of_different_slots_equal_serial_runs(device):
    g = generator(511)
    kw = replay_config(device, max_batch=THREADS, max_seq_len=60 + CALLS)
    shared, serial = make_store(kw), make_store(kw)
    prompts = [(randn(g, 1, 60, HKV, D), randn(g, 1, 60, HKV, D)) for _ in range(THREADS)]
    for s in (shared, serial):
        assert s.add_sequences(THREADS) == list(range(THREADS))
        for slot, (k, v) in enumerate(prompts):
            s.prefill(0, [slot], k.to(device), v.to(device), keys_post_rope=False)
    inputs = [[tuple(randn(g, 1, *shape).to(device) for shape in ((HQ, D), (HKV, D), (HKV, D)))
               for _ in range(CALLS)] for _ in range(THREADS)]
    outputs = [[] for _ in range(THREADS)]

    def worker(slot):
        for q, k, v in inputs[slot]:
            outputs[slot].append(shared.decode(0, [slot], q, k, v))
            shared.stats()
            shared.sequence_info(0, (slot + 1) % THREADS)
            shared.memory_report()

    run_threads(worker)
    assert shared.stats()["decode_steps"] == THREADS * CALLS
    for slot in range(THREADS):
        for i, (q, k, v) in enumerate(inputs[slot]):
            torch.testing.assert_close(outputs[slot][i], serial.decode(0, [slot], q, k, v), atol=0, rtol=0,
                                       msg=lambda m: f"slot {slot} call {i}: {m}")
        assert shared.sequence_info(0, slot) == serial.sequence_info(0, slot)
        assert shared.selected_chunks(0, slot) == serial.selected_chunks(0, slot)
    for key in ("decode_steps", "selections", "hits", "misses", "folds", "bytes_fetched"):
        assert shared.stats()[key] == serial.stats()[key], key


def test_concurrent_decodes_of_one_slot_follow_a_serial_order(device):
    """Every call gets the same inputs, so all serial orders give the same outputs: the concurrent run must give the
    serial run's outputs (as a multiset), its final state and exact counters."""
    g = generator(521)
    kw = replay_config(device, max_seq_len=60 + THREADS * CALLS)
    shared, serial = make_store(kw), make_store(kw)
    k0, v0 = randn(g, 1, 60, HKV, D), randn(g, 1, 60, HKV, D)
    for s in (shared, serial):
        s.add_sequences(1)
        s.prefill(0, [0], k0.to(device), v0.to(device), keys_post_rope=False)
    q, k, v = (randn(g, 1, *shape).to(device) for shape in ((HQ, D), (HKV, D), (HKV, D)))
    outputs = [[] for _ in range(THREADS)]
    run_threads(lambda t: outputs[t].extend(shared.decode(0, [0], q, k, v).cpu() for _ in range(CALLS)))
    expected = [serial.decode(0, [0], q, k, v).cpu() for _ in range(THREADS * CALLS)]
    key = lambda x: tuple(x.flatten().tolist())  # noqa: E731
    concurrent = sorted((o for lst in outputs for o in lst), key=key)
    assert [key(o) for o in concurrent] == [key(o) for o in sorted(expected, key=key)], \
        "concurrent outputs are not those of a serial run"
    info = shared.sequence_info(0, 0)
    assert info["total_len"] == 60 + THREADS * CALLS
    assert info == serial.sequence_info(0, 0)
    assert shared.stats() == serial.stats()


# --------------------------------------------------------------------------------------------------------------------
# argument types
# --------------------------------------------------------------------------------------------------------------------

def typed_store():
    g = generator(531)
    store = make_store(replay_config(max_batch=3))
    store.add_sequences(2)
    store.prefill(0, [0], randn(g, 1, 60, HKV, D), randn(g, 1, 60, HKV, D), keys_post_rope=False)
    return store


def qkv(batch=1):
    return torch.ones(batch, HQ, D), torch.ones(batch, HKV, D), torch.ones(batch, HKV, D)


KEYS = torch.ones(1, 8, HKV, D)

# (id, exception, regex naming the argument, call)
BAD_ARGUMENTS = [
    ("decode-slots-str", TypeError, r"slots", lambda s: s.decode(0, "0", *qkv())),
    ("decode-slots-bool", TypeError, r"slots", lambda s: s.decode(0, True, *qkv())),
    ("decode-slots-list-of-bool", TypeError, r"slots\[0\]", lambda s: s.decode(0, [True], *qkv())),
    ("decode-slots-float", TypeError, r"slots", lambda s: s.decode(0, 0.0, *qkv())),
    ("decode-slots-none", TypeError, r"slots", lambda s: s.decode(0, None, *qkv())),
    ("decode-layer-str", TypeError, r"layer", lambda s: s.decode("0", [0], *qkv())),
    ("decode-layer-2**31", ValueError, r"layer.*C int", lambda s: s.decode(2**31, [0], *qkv())),
    ("decode-slot-2**31", ValueError, r"slots\[0\].*C int", lambda s: s.decode(0, [2**31], *qkv())),
    ("decode-flag-str", TypeError, r"k_new_post_rope", lambda s: s.decode(0, [0], *qkv(), k_new_post_rope="False")),
    ("decode-flag-int", TypeError, r"k_new_post_rope", lambda s: s.decode(0, [0], *qkv(), k_new_post_rope=1)),
    ("decode-q-none", ValueError, r"\bq\b", lambda s: s.decode(0, [0], None, *qkv()[1:])),
    ("release-str", TypeError, r"slots", lambda s: s.release("1")),
    ("release-bool", TypeError, r"slots", lambda s: s.release(True)),
    ("release-float", TypeError, r"slots\[0\]", lambda s: s.release([1.0])),
    ("release-2**63", ValueError, r"slots\[0\]", lambda s: s.release([2**63])),
    ("prefill-lengths-float", TypeError, r"lengths\[0\]", lambda s: s.prefill(0, [1], KEYS, KEYS, lengths=[7.9])),
    ("prefill-lengths-str", TypeError, r"lengths", lambda s: s.prefill(0, [1], KEYS, KEYS, lengths="8")),
    ("prefill-lengths-float-tensor", TypeError, r"lengths\[0\]",
     lambda s: s.prefill(0, [1], KEYS, KEYS, lengths=torch.tensor([8.0]))),
    ("prefill-lengths-bool", TypeError, r"lengths\[0\]", lambda s: s.prefill(0, [1], KEYS, KEYS, lengths=[True])),
    ("prefill-lengths-2**63", ValueError, r"lengths\[0\].*int64",
     lambda s: s.prefill(0, [1], KEYS, KEYS, lengths=[2**63])),
    ("prefill-lengths-int", TypeError, r"lengths", lambda s: s.prefill(0, [1], KEYS, KEYS, lengths=8)),
    ("prefill-flag-str", TypeError, r"keys_post_rope",
     lambda s: s.prefill(0, [1], KEYS, KEYS, keys_post_rope="False")),
    ("prefill-flag-none", TypeError, r"keys_post_rope", lambda s: s.prefill(0, [1], KEYS, KEYS, keys_post_rope=None)),
    ("prefill-layer-float", TypeError, r"layer", lambda s: s.prefill(0.0, [1], KEYS, KEYS)),
    ("prefill-keys-none", ValueError, r"keys", lambda s: s.prefill(0, [1], None, KEYS)),
    ("replay-steps-float", TypeError, r"steps", lambda s: s.account_replayed_steps(0, [0], 1.5)),
    ("replay-steps-str", TypeError, r"steps", lambda s: s.account_replayed_steps(0, [0], "3")),
    ("replay-steps-2**63", ValueError, r"steps.*int64", lambda s: s.account_replayed_steps(0, [0], 2**63)),
    ("add-none", TypeError, r"count", lambda s: s.add_sequences(None)),
    ("add-float", TypeError, r"count", lambda s: s.add_sequences(1.0)),
    ("add-bool", TypeError, r"count", lambda s: s.add_sequences(True)),
    ("add-2**31", ValueError, r"count.*C int", lambda s: s.add_sequences(2**31)),
    ("info-layer-2**31", ValueError, r"layer", lambda s: s.sequence_info(2**31, 0)),
    ("info-slot-none", TypeError, r"slot", lambda s: s.sequence_info(0, None)),
    ("selected-layer-none", TypeError, r"layer", lambda s: s.selected_chunks(None, 0)),
    ("outliers-slot-str", TypeError, r"slot", lambda s: s.outlier_chunks(0, "0")),
]


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_argument_types_raise_naming_the_argument(case):
    name, exception, pattern, call = case
    store = typed_store()
    before = (store.active_slots(), store.sequence_info(0, 0), store.stats(), store.memory_report())
    with pytest.raises(exception, match=pattern) as raised:
        call(store)
    assert "incompatible function arguments" not in str(raised.value)
    assert (store.active_slots(), store.sequence_info(0, 0), store.stats(), store.memory_report()) == before, name


def test_integer_like_arguments_are_still_accepted():
    """numpy/torch integers, ranges, tuples and 1-d integer tensors stay valid slots, layers and lengths."""
    store = typed_store()
    g = generator(532)
    keys = randn(g, 1, 16, HKV, D)
    store.prefill(np.int64(0), torch.tensor([1]), keys, keys, lengths=np.array([12]),
                  keys_post_rope=np.bool_(False))
    assert store.sequence_info(np.int32(0), torch.tensor(1))["prompt_len"] == 12
    out = store.decode(torch.tensor(0), range(2), *qkv(2), k_new_post_rope=True)
    assert out.shape == (2, HQ, D)
    assert store.add_sequences(np.int64(1)) == [2]
    store.release((np.int64(2),))
    store.release(1)



def test_every_form_of_a_decode_input_gives_the_same_step(device):
    """A plain torch tensor crosses to the native store as a DLPack capsule (_store._exported); tensors that require
    grad, subclasses (nn.Parameter), strided views, int32 positions and (on the CPU) numpy arrays go the general way.
    Twin stores, the same steps (folds included) through each form: bit-identical outputs and statistics; a slot list
    of plain ints is range-checked like any other."""
    g = generator(533)
    stores = [make_store(replay_config(device)) for _ in range(4)]
    keys, values = randn(g, 1, 60, HKV, D).to(device), randn(g, 1, 60, HKV, D).to(device)
    for s in stores:
        s.add_sequences(1)
        s.prefill(0, [0], keys, values, keys_post_rope=False)
    for step in range(24):
        q, k, v = (randn(g, 1, h, D).to(device) for h in (HQ, HKV, HKV))
        position = 60 + step
        plain = stores[0].decode(0, [0], q, k, v, positions=torch.tensor([position], device=device))
        forms = {}
        if device == "cpu":
            forms["numpy"] = torch.from_numpy(stores[1].decode(0, np.array([0]), q.numpy(), k.numpy(), v.numpy(),
                                                               positions=np.array([position], dtype=np.int32)))
        else:
            forms["int32 positions"] = stores[1].decode(
                0, torch.tensor([0]), q, k, v, positions=torch.tensor([position], dtype=torch.int32, device=device))
        forms["requires_grad"] = stores[2].decode(0, (0,), q.clone().requires_grad_(), torch.nn.Parameter(k.clone()),
                                                  v.clone().requires_grad_(),
                                                  positions=torch.tensor([position], dtype=torch.int32, device=device))
        wide = torch.zeros(1, HQ, 2 * D, device=device)  # a strided view of q, and a strided preallocated output
        wide[..., ::2] = q
        out = torch.empty(1, HQ, 2 * D, device=device)[..., ::2]
        forms["strided"] = stores[3].decode(0, [0], wide[..., ::2], k, v, out=out)
        assert forms["strided"].data_ptr() == out.data_ptr()
        for name, other in forms.items():
            torch.testing.assert_close(other, plain, atol=0, rtol=0, msg=f"step {step}: {name}")
    assert stores[0].sequence_info(0, 0)["total_len"] == 84
    assert all(s.stats() == stores[0].stats() for s in stores[1:])
    with pytest.raises(ValueError, match=r"slots"):
        stores[0].decode(0, [2**31], q, k, v)
    with pytest.raises(TypeError, match=r"slots"):
        stores[0].decode(0, [True], q, k, v)


def test_a_capsule_keeps_the_device_of_its_tensor():
    """_exported hands the native store DLPack capsules; a CUDA tensor's capsule must reach the store's checks with its
    device. Without a GPU: a CPU tensor's capsule with its DLPack device rewritten to (kDLCUDA, 0) is taken by the
    binding, and the store names cuda:0 when it rejects it (a CPU store), changing nothing."""
    import ctypes

    from torch.utils.dlpack import to_dlpack

    g = generator(534)
    store = make_store(replay_config())
    store.add_sequences(1)
    store.prefill(0, [0], randn(g, 1, 60, HKV, D), randn(g, 1, 60, HKV, D), keys_post_rope=False)
    q, k, v = randn(g, 1, HQ, D), randn(g, 1, HKV, D), randn(g, 1, HKV, D)
    capsule = to_dlpack(q)
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # DLManagedTensor: DLTensor first, whose `data` pointer is followed by DLDevice {int32 type, int32 id}.
    device = (ctypes.c_int32 * 2).from_address(get_pointer(capsule, b"dltensor") + ctypes.sizeof(ctypes.c_void_p))
    assert list(device) == [1, 0]  # kDLCPU
    device[0], device[1] = 2, 0    # kDLCUDA, device 0
    before = (store.sequence_info(0, 0), store.stats())
    with pytest.raises(ValueError, match=r"q must be on cpu.*cuda:0"):
        store._store.decode(0, [0], capsule, to_dlpack(k), to_dlpack(v), to_dlpack(torch.empty(1, HQ, D)), None,
                            True, None)
    assert (store.sequence_info(0, 0), store.stats()) == before

BAD_CONSTRUCTOR_ARGUMENTS = [
    ("num-layers-str", TypeError, r"num_layers", dict(num_layers="1")),
    ("num-layers-float", TypeError, r"num_layers", dict(num_layers=1.0)),
    ("num-layers-bool", TypeError, r"num_layers", dict(num_layers=True)),
    ("max-batch-2**31", ValueError, r"max_batch.*C int", dict(max_batch=2**31)),
    ("max-seq-len-2**63", ValueError, r"max_seq_len.*int64", dict(max_seq_len=2**63)),
    ("max-seq-len-none", TypeError, r"max_seq_len", dict(max_seq_len=None)),
    ("rank-float", TypeError, r"rank", dict(rank=32.5)),
    ("budget-chunks-beyond-c-int", ValueError, r"budget", dict(budget=8 * 2**40)),
    ("rope-theta-str", TypeError, r"rope_theta", dict(rope_theta="10000")),
    ("attention-scaling-bool", TypeError, r"attention_scaling", dict(attention_scaling=True)),
    ("softmax-scale-str", TypeError, r"softmax_scale", dict(softmax_scale="0.1")),
    ("inv-freq-empty", ValueError, r"inv_freq", dict(inv_freq=[])),
    ("inv-freq-empty-tensor", ValueError, r"inv_freq", dict(inv_freq=torch.ones(0))),
    ("inv-freq-str", TypeError, r"inv_freq", dict(inv_freq="abc")),
    ("inv-freq-entry-str", TypeError, r"inv_freq\[1\]", dict(inv_freq=[1.0, "2"] + [1.0] * 30)),
    ("rotary-dim-float", TypeError, r"rotary_dim", dict(rotary_dim=32.0)),
    ("rope-style-int", TypeError, r"rope_style", dict(rope_style=1)),
    ("factorization-none", TypeError, r"factorization", dict(factorization=None)),
    ("generation-window-str", TypeError, r"generation_window", dict(generation_window="16")),
]


@pytest.mark.parametrize("case", BAD_CONSTRUCTOR_ARGUMENTS, ids=[c[0] for c in BAD_CONSTRUCTOR_ARGUMENTS])
def test_bad_constructor_argument_types_raise_naming_the_argument(case):
    name, exception, pattern, overrides = case
    with pytest.raises(exception, match=pattern) as raised:
        make_store(replay_config(**overrides))
    assert "incompatible function arguments" not in str(raised.value), name


# --------------------------------------------------------------------------------------------------------------------
# non-finite and huge inputs
# --------------------------------------------------------------------------------------------------------------------

def decode_check(device):
    """The check_finite that checks decode inputs on `device`: the default on the CPU; on CUDA the default ("auto")
    leaves them out (the check waits for the GPU), so ask for it."""
    return {} if device == "cpu" else {"check_finite": "always"}


def with_value(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


NAN, INF = float("nan"), float("inf")
BAD_VALUES = [
    ("prefill-nan-key", r"keys.*slot 2.*(NaN|finite)",
     lambda tw, st: st.prefill(0, [2], with_value(kv(tw)[0], (0, 3, 1, 5), NAN), kv(tw)[1])),
    ("prefill-inf-value", r"values.*(NaN|finite)",
     lambda tw, st: st.prefill(0, [2], kv(tw)[0], with_value(kv(tw)[1], (0, 7, 0, 0), -INF))),
    ("prefill-nan-q-last", r"q_last.*(NaN|finite)",
     lambda tw, st: st.prefill(0, [2], *kv(tw), q_last=torch.full((1, HQ, D), NAN, device=tw.device))),
    ("prefill-inf-key-last-valid-token", r"keys.*slot 2.*(NaN|finite)",
     lambda tw, st: st.prefill(0, [2], with_value(kv(tw)[0], (0, 7, 1, 63), INF), kv(tw)[1], lengths=[8])),
    ("prefill-nan-key-bf16-strided", r"keys.*slot 2.*(NaN|finite)",
     lambda tw, st: st.prefill(0, [2], with_value(kv(tw, s=16, dtype=torch.bfloat16)[0], (0, 10, 0, 0), NAN)[:, ::2],
                               kv(tw, s=8, dtype=torch.bfloat16)[1])),
    ("decode-nan-q", r"\bq\b.*slot 1.*(NaN|finite)",
     lambda tw, st: st.decode(0, [0, 1], with_value(tw.inputs([0, 1], 0)[0], (1, 0, 0), NAN),
                              *tw.inputs([0, 1], 0)[1:])),
    ("decode-inf-k-new", r"k_new.*(NaN|finite)",
     lambda tw, st: st.decode(0, [0], tw.inputs([0], 0)[0], with_value(tw.inputs([0], 0)[1], (0, 1, 63), INF),
                              tw.inputs([0], 0)[2])),
    ("decode-nan-v-new", r"v_new.*(NaN|finite)",
     lambda tw, st: st.decode(1, [1], *tw.inputs([1], 1)[:2], with_value(tw.inputs([1], 1)[2], (0, 0, 0), NAN))),
    ("decode-nan-v-new-fp16", r"v_new.*slot 0.*(NaN|finite)",
     lambda tw, st: st.decode(0, [0], *tw.inputs([0], 0)[:2],
                              with_value(tw.inputs([0], 0)[2].half(), (0, 1, 31), NAN))),
]


@pytest.mark.parametrize("case", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_non_finite_inputs_are_rejected_and_change_nothing(case, device):
    """Prefill inputs are checked on every backend by default; decode inputs where check_finite asks for it (the
    CPU's default, CUDA's "always")."""
    name, pattern, call = case
    tw = Twins(device, 9100, **(decode_check(device) if name.startswith("decode") else {}))
    with pytest.raises(ValueError, match=f"(?i){pattern}"):
        call(tw, tw.a)
    tw.assert_unchanged(name)


DECODE_POISON = [
    ("q", lambda q, k, v: (with_value(q, (1, 2, 7), NAN), k, v)),
    ("k_new", lambda q, k, v: (q, with_value(k, (1, 0, 0), NAN), v)),
    ("v_new", lambda q, k, v: (q, k, with_value(v, (1, 1, 40), NAN))),
]


@pytest.mark.parametrize("check_finite", ["auto", "prefill", "always"])
@pytest.mark.parametrize("tensor", [c[0] for c in DECODE_POISON])
def test_unchecked_decode_input_poisons_only_its_sequence(tensor, check_finite, device):
    """check_finite decides whether decode inputs are checked ("auto": on the CPU yes, on CUDA no). Where they are,
    the NaN/Inf is rejected (test above); where not, it is stored as given: that sequence's output is not finite, and
    the other sequence of the batch decodes exactly as its twin, which never saw it, for 20 more steps (folds on the
    way)."""
    checked = check_finite == "always" or (check_finite == "auto" and device == "cpu")
    poison = dict(DECODE_POISON)[tensor]
    tw = Twins(device, 9110, check_finite=check_finite)
    assert tw.a.config["check_finite"] == check_finite
    q, k, v = tw.inputs([0, 1], 0)
    if checked:
        with pytest.raises(ValueError, match=f"(?i){tensor}.*slot 1"):
            tw.a.decode(0, [0, 1], *poison(q, k, v))
        tw.assert_unchanged(f"{tensor} with check_finite={check_finite}")
        return
    out_a = tw.a.decode(0, [0, 1], *poison(q, k, v)).cpu()
    out_b = tw.b.decode(0, [0, 1], q, k, v).cpu()
    assert not torch.isfinite(out_a[1]).all(), f"a non-finite {tensor} gave a finite output"
    torch.testing.assert_close(out_a[0], out_b[0], atol=1e-6, rtol=0)
    tw.b.decode(1, [0, 1], *tw.inputs([0, 1], 1))
    tw.a.decode(1, [0, 1], *tw.inputs([0, 1], 1))
    tw.t[0] += 1
    tw.t[1] += 1
    for step in range(20):
        for layer in range(2):
            q, k, v = tw.inputs([0], layer)
            torch.testing.assert_close(tw.a.decode(layer, [0], q, k, v).cpu(), tw.b.decode(layer, [0], q, k, v).cpu(),
                                       atol=1e-6, rtol=0, msg=lambda m: f"slot 0, step {step}, layer {layer}: {m}")
        tw.t[0] += 1
    assert tw.a.sequence_info(0, 0) == tw.b.sequence_info(0, 0)
    assert tw.a.sequence_info(0, 1) == tw.b.sequence_info(0, 1)


def test_check_finite_is_validated():
    with pytest.raises(ValueError, match="check_finite"):
        make_store(replay_config(check_finite="never"))
    with pytest.raises(TypeError, match="check_finite"):
        make_store(replay_config(check_finite=True))
    assert make_store(replay_config()).config["check_finite"] == "auto"


def test_non_finite_padding_is_ignored(device):
    g = generator(541)
    store = make_store(replay_config(device))
    store.add_sequences(1)
    keys, values = randn(g, 1, 50, HKV, D), randn(g, 1, 50, HKV, D)
    keys[0, 40:], values[0, 40:] = NAN, INF
    store.prefill(0, [0], keys.to(device), values.to(device), lengths=[40], keys_post_rope=False)
    out = store.decode(0, [0], *(t.to(device) for t in qkv()))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("post_rope", [False, True], ids=["pre-rope", "post-rope"])
def test_keys_that_overflow_under_rope_are_rejected_and_change_nothing(post_rope, device):
    """Finite keys near the float32 limit whose rotation (or un-rotation) overflows: rejected on every backend by the
    CPU backend's rule (cpu_backend.cpp: applying or removing RoPE must leave them finite), naming the slot, before
    anything is stored; the store stays as it was."""
    tw = Twins(device, 9130)
    keys, values = kv(tw)
    sign = torch.where(torch.arange(keys.numel()) % 2 == 0, 1.0, -1.0).reshape(keys.shape)
    keys = (3.0e38 * sign).to(keys.device)  # finite; x cos -+ y sin reaches 4.2e38 at most positions
    with pytest.raises(ValueError, match=r"(?i)slot 2.*too large"):
        tw.a.prefill(0, [2], keys, values, keys_post_rope=post_rope)
    tw.assert_unchanged(f"overflowing keys, keys_post_rope={post_rope}")
    # slot 2 takes a sound prompt afterwards, on both twins alike
    for store in (tw.a, tw.b):
        store.prefill(0, [2], *kv(tw), keys_post_rope=False)
    assert tw.a.sequence_info(0, 2) == tw.b.sequence_info(0, 2)


@pytest.mark.parametrize("factorization", ["gram", "svd"])
@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_huge_finite_keys_factorise_and_decode(scale, factorization, device):
    """Keys of 1e20 and 1e30 (their float32 Gram matrix would overflow): scaled by a power of two for the
    factorisation on every backend (cpp/src/factorization.cpp; the CUDA prompt kernels), then decoded soundly."""
    g = generator(551)
    store = make_store(replay_config(device, factorization=factorization))
    store.add_sequences(1)
    store.prefill(0, [0], (scale * randn(g, 1, 60, HKV, D)).to(device), randn(g, 1, 60, HKV, D).to(device), keys_post_rope=False)
    for _ in range(20):
        q, k, v = randn(g, 1, HQ, D), scale * randn(g, 1, HKV, D), randn(g, 1, HKV, D)
        out = store.decode(0, [0], q.to(device), k.to(device), v.to(device))
        assert torch.isfinite(out).all() and float(out.norm()) > 0


# --------------------------------------------------------------------------------------------------------------------
# configurations that cannot be served
# --------------------------------------------------------------------------------------------------------------------

def test_budget_above_capacity_is_clamped_and_serves():
    g = generator(561)
    store = make_store(replay_config(budget=8 * (2**31 - 1)))
    assert store.config["budget"] == 8 * (2**31 - 1)  # tokens, as given (the C++ config has the same unit)
    store.add_sequences(1)
    store.prefill(0, [0], randn(g, 1, 60, HKV, D), randn(g, 1, 60, HKV, D), keys_post_rope=False)
    out = store.decode(0, [0], *qkv())
    assert torch.isfinite(out).all()
    # the selection cache holds max_seq_len / chunk_size = 25 chunks per head, not 2**31 - 1
    assert store.memory_report()["selection_cache"] == 25 * 8 * HKV * D * 2 * 4


def test_chunk_longer_than_max_seq_len_is_rejected_at_construction():
    with pytest.raises(ValueError, match=r"chunk_size.*max_seq_len"):
        make_store(replay_config(chunk_size=2**30, budget=2**30, generation_window=2**30))


def test_sizes_that_overflow_are_rejected_at_construction():
    with pytest.raises(ValueError, match=r"(?i)max_seq_len.*overflow"):
        make_store(replay_config(max_seq_len=2**62))


def physical_memory_bytes():
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def test_max_batch_beyond_this_host_is_a_memory_error_naming_the_bytes():
    host = physical_memory_bytes()
    if host is None or host >= (2**31 - 1) * 64:
        pytest.skip("this host could hold the slot tables of max_batch = 2**31 - 1")
    with pytest.raises(MemoryError, match=r"max_batch.*\d+ bytes.*physical memory"):
        make_store(replay_config(max_batch=2**31 - 1))


def test_build_info_still_works():
    assert "cpu" in shadowkv_core.build_info()["backends"]
