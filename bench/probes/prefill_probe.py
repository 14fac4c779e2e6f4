"""Where does one layer's `store.prefill` spend its time at Llama-3-8B shapes (Hkv 8, D 128, rank 160)? The
end-to-end benchmark measured ~35 ms a layer inside store.prefill at S=122880 (9.5% of the prefill); the target is
<= 3%. Times the whole call (CUDA events and wall clock) for a few lengths, then lists the kernels of one call at the
longest length with torch.profiler (cuSOLVER and cuBLAS kernels included).

    python bench/probes/prefill_probe.py [--lengths 32768 122880] [--factor-dtype bfloat16] [--batch 8]

--batch B (B > 1) also times B sequences of the shortest length prefilled in one call against the same B in B calls
of one sequence: when each call returns to the host, and when the GPU is done. The CUDA backend gives up to 8
consecutive sequences one batched eigensolve, inside which the host waits for the GPU to drain; so one call should
wait once, the B calls B times.
"""

import argparse
import time

import torch

from shadowkv_core import KVStore

parser = argparse.ArgumentParser()
parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 122880])
parser.add_argument("--factor-dtype", default=None)
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--batch", type=int, default=1)
args = parser.parse_args()

HQ, HKV, D = 32, 8, 128
longest = max(args.lengths)
extra = {} if args.factor_dtype is None else {"factor_dtype": args.factor_dtype}
store = KVStore(1, HQ, HKV, D, max_batch=max(1, args.batch), max_seq_len=longest + 512, rank=160, budget=2048, chunk_size=8,
                outlier_chunks=48, local_chunks=4, dtype="bfloat16", device="cuda:0", value_store="host", **extra)
gen = torch.Generator(device="cuda").manual_seed(0)
# Keys with a decaying spectrum (a low-rank part plus noise), like real pre-RoPE keys.
basis = torch.randn(64, HKV * D, device="cuda", generator=gen)
keys = (torch.randn(1, longest, 64, device="cuda", generator=gen) @ basis).reshape(1, longest, HKV, D)
keys = (keys + 0.1 * torch.randn(keys.shape, device="cuda", generator=gen)).to(torch.bfloat16)
values = torch.randn(1, longest, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
q_last = torch.randn(1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)


def one(n):
    slot = store.add_sequences(1)[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    start.record()
    store.prefill(0, [slot], keys[:, :n], values[:, :n], q_last=q_last)
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    store.release([slot])
    return wall * 1e3, start.elapsed_time(end)


for n in args.lengths:
    one(n)
    runs = [one(n) for _ in range(args.reps)]
    wall = min(r[0] for r in runs)
    events = min(r[1] for r in runs)
    print(f"S={n:7d}: store.prefill one layer {wall:7.2f} ms wall, {events:7.2f} ms between events", flush=True)



def batched(n, together):
    """B sequences of n tokens in one prefill call (together) or in B calls: ms until the last call returned, ms
    until the GPU was done."""
    slots = store.add_sequences(args.batch)
    rows = keys[:, :n].expand(args.batch, n, HKV, D)
    vals = values[:, :n].expand(args.batch, n, HKV, D)
    torch.cuda.synchronize()
    t = time.perf_counter()
    if together:
        store.prefill(0, slots, rows, vals, q_last=q_last.expand(args.batch, HQ, D))
    else:
        for b, slot in enumerate(slots):
            store.prefill(0, [slot], rows[b:b + 1], vals[b:b + 1], q_last=q_last)
    returned = time.perf_counter() - t
    torch.cuda.synchronize()
    done = time.perf_counter() - t
    store.release(slots)
    return returned * 1e3, done * 1e3


if args.batch > 1:
    n = min(args.lengths)
    for together in (True, False, True, False):
        runs = [batched(n, together) for _ in range(args.reps)]
        returned, done = min(r[0] for r in runs), min(r[1] for r in runs)
        how = "one call" if together else f"{args.batch} calls"
        print(f"B={args.batch} S={n}: {how:9s}: returned after {returned:8.2f} ms, GPU done after {done:8.2f} ms",
              flush=True)

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    one(longest)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
print(torch.__version__, torch.cuda.get_device_name(), store.memory_report())
