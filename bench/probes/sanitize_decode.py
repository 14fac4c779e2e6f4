"""A short decode run on the GPU for compute-sanitizer (bench/gpu_check.sh --sanitize runs it under memcheck,
racecheck and initcheck): small shapes, every path of a decode step once or more, checked for finite, non-zero
outputs so that the run also fails on its own when something is plainly wrong.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 bench/probes/sanitize_decode.py

(Without torch's caching allocator every tensor is its own allocation, so a read past a caller's tensor is seen.)
What runs, on two stores of 2 layers, Hq 8, Hkv 2, D 128, chunks of 8, rank 48, a 64-token budget, window 16:
  * store A: device values in fp8 (value_store="device", value_dtype="float8_e4m3"), check_finite="always": a ragged
    prefill of 3 sequences (lengths, positions, q_last), 20 decode steps (folds every 16 steps), a rejected decode
    with a NaN value, a prefill with a NaN key (rejected), one decode step captured in a CUDA graph and replayed 3
    times (account_replayed_steps), a sequence released and another added and prefilled;
  * store B: host values in bfloat16 (pinned; the batch of 8 is cut into 3 pipeline parts: per-part selection, fetch
    and attention), check_finite="prefill"
    (what "auto" does on CUDA), 20 decode steps of 8 sequences, then an unchecked NaN query for one sequence (its
    output NaN, the others' finite).
Prints one line per phase and "sanitize_decode: ok" at the end; exits non-zero on a failed check.
`--device cpu` runs the same calls on the CPU backend (no graph capture): a check of the script itself.
"""

import argparse
import sys

import torch

from shadowkv_core import KVStore

LAYERS, HQ, HKV, D = 2, 8, 2, 128
STEPS = 20
DEVICE = "cuda:0"


def store(**kw):
    return KVStore(LAYERS, HQ, HKV, D, max_seq_len=256, rank=48, chunk_size=8, budget=64, outlier_chunks=2,
                   local_chunks=2, generation_window=16, dtype="bfloat16", device=DEVICE, **kw)


def check(out, what, finite=True):
    if finite:
        assert torch.isfinite(out).all(), f"{what}: non-finite output"
        assert float(out.float().norm()) > 0, f"{what}: zero output"


def synchronize():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def decode_steps(s, slots, steps, gen, what):
    for step in range(steps):
        for layer in range(LAYERS):
            q = torch.randn(len(slots), HQ, D, device=DEVICE, generator=gen).to(torch.bfloat16)
            k = torch.randn(len(slots), HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
            v = torch.randn(len(slots), HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
            check(s.decode(layer, slots, q, k, v), f"{what} step {step} layer {layer}")
    synchronize()


def prefill(s, slots, length, gen, lengths=None, q_last=True):
    b = len(slots)
    for layer in range(LAYERS):
        keys = torch.randn(b, length, HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
        values = torch.randn(b, length, HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
        positions = torch.arange(length, device=DEVICE).repeat(b, 1)
        q = torch.randn(b, HQ, D, device=DEVICE, generator=gen).to(torch.bfloat16) if q_last else None
        s.prefill(layer, slots, keys, values, lengths=lengths, positions=positions, q_last=q)


def main():
    gen = torch.Generator(device=DEVICE).manual_seed(1234)

    # --- store A: device fp8 values, every input checked -----------------------------------------------------------
    a = store(max_batch=4, value_store="device", value_dtype="float8_e4m3", check_finite="always")
    slots = a.add_sequences(3)
    prefill(a, slots, 120, gen, lengths=[120, 97, 64])
    print("A: ragged prefill of 3 sequences (device fp8 values)", flush=True)
    decode_steps(a, slots, STEPS, gen, "A")
    print(f"A: {STEPS} decode steps, folds {a.stats()['folds']}", flush=True)
    q = torch.randn(3, HQ, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    k = torch.randn(3, HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    v = torch.randn(3, HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    bad = v.clone()
    bad[2, 1, 5] = float("nan")
    try:
        a.decode(0, slots, q, k, bad)
        raise AssertionError("a NaN value was accepted with check_finite='always'")
    except ValueError as error:
        assert "v_new" in str(error), error
    extra = a.add_sequences(1)
    keys = torch.randn(1, 40, HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    keys[0, 39, 1, 127] = float("inf")
    try:
        a.prefill(0, extra, keys, keys.clone().nan_to_num(posinf=0.0))
        raise AssertionError("an Inf key was accepted at prefill")
    except ValueError as error:
        assert "keys" in str(error), error
    a.release(extra)
    print("A: NaN value at decode and Inf key at prefill rejected", flush=True)

    # One decode step of layer 0 captured and replayed (the step's kernels on the caller's stream and the copy stream).
    check(a.decode(0, slots, q, k, v), "A eager step before capture")
    check(a.decode(1, slots, q, k, v), "A eager step before capture, layer 1")
    synchronize()
    if DEVICE != "cpu":
        # The output is allocated before the capture: under PYTORCH_NO_CUDA_MEMORY_CACHING=1 (how gpu_check.sh runs
        # this, so that the sanitizer sees every tensor as its own allocation) torch allocates with cudaMalloc, which a
        # capturing stream refuses (5316a3c: the capture failed in torch, before any of the store's launches).
        out = torch.empty_like(q)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a.decode(0, slots, q, k, v, out=out)
        for _ in range(3):
            q.copy_(torch.randn(3, HQ, D, device=DEVICE, generator=gen))
            graph.replay()
            synchronize()
            check(out, "A replay")
        a.account_replayed_steps(0, slots, 3)
    else:
        for _ in range(3):
            check(a.decode(0, slots, q, k, v), "A layer 0 (the CPU's stand-in for the replays)")
    for _ in range(3):
        check(a.decode(1, slots, q, k, v), "A layer 1 after replays")
    print("A: 1 step captured, 3 replays accounted", flush=True)
    a.release([slots[1]])
    new = a.add_sequences(1)
    prefill(a, new, 50, gen, q_last=False)
    decode_steps(a, [slots[0], new[0], slots[2]], 3, gen, "A after release")
    print("A: released one, added and prefilled another, 3 more steps", flush=True)

    # --- store B: pinned host bf16 values, a batch of 8 (pipeline parts), decode unchecked -------------------------
    b = store(max_batch=8, value_store="host", check_finite="prefill", decode_pipeline_parts=3)
    slots = b.add_sequences(8)
    prefill(b, slots, 90, gen)
    decode_steps(b, slots, STEPS, gen, "B")
    print(f"B: {STEPS} decode steps of 8 sequences (host values), folds {b.stats()['folds']}", flush=True)
    q = torch.randn(8, HQ, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    q[3, 0, 0] = float("nan")
    k = torch.randn(8, HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    v = torch.randn(8, HKV, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    out = b.decode(0, slots, q, k, v)
    assert not torch.isfinite(out[3]).all(), "an unchecked NaN query gave a finite output"
    check(torch.cat([out[:3], out[4:]]), "B other sequences after an unchecked NaN")
    synchronize()
    print("B: unchecked NaN query poisoned only its sequence", flush=True)
    print("sanitize_decode: ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    DEVICE = parser.parse_args().device
    if DEVICE != "cpu" and not torch.cuda.is_available():
        print("sanitize_decode: no CUDA device", file=sys.stderr)
        sys.exit(2)
    main()
