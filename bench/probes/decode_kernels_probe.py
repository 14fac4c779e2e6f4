"""One layer's decode step at a chosen shape, for `ncu --profile-from-start off`: a store of B sequences of S tokens
(Llama-3-8B attention shapes: 32/8 heads, D 128, rank 160, chunk 8, 48 outliers, 4 local chunks, bf16), a few
correlated warm-up steps (the temporal cache fills, hit rate ~0.5-0.7), then `--profiled` steps between
cudaProfilerStart and cudaProfilerStop. Prints the hit rate of the profiled steps and their mean time (under ncu the
time is the profiler's, not the step's).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python bench/probes/decode_kernels_probe.py --batch 8 --values device
"""

import argparse
import math
import time

import torch

from shadowkv_core import KVStore

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=122880)
parser.add_argument("--budget", type=int, default=2048)
parser.add_argument("--values", default="device", help="value_store: host or device")
parser.add_argument("--correlation", type=float, default=0.97, help="of consecutive queries (steers the hit rate)")
parser.add_argument("--warmup", type=int, default=6)
parser.add_argument("--profiled", type=int, default=1)
args = parser.parse_args()

HQ, HKV, D = 32, 8, 128
B, S = args.batch, args.seq_len
store = KVStore(1, HQ, HKV, D, max_batch=B, max_seq_len=S + 64, rank=160, budget=args.budget, chunk_size=8,
                outlier_chunks=48, local_chunks=4, generation_window=256, dtype="bfloat16", device="cuda:0",
                rope_theta=500000.0, value_store=args.values)
gen = torch.Generator(device="cuda").manual_seed(0)
slots = store.add_sequences(B)
for slot in slots:  # as bench/step_benchmark.py: a low-rank part plus noise, post-RoPE
    basis = torch.randn(32, HKV * D, device="cuda", generator=gen)
    keys = torch.randn(S, 32, device="cuda", generator=gen) @ basis + 0.3 * torch.randn(S, HKV * D, device="cuda",
                                                                                         generator=gen)
    values = torch.randn(1, S, HKV, D, device="cuda", generator=gen)
    store.prefill(0, [slot], keys.reshape(1, S, HKV, D).to(torch.bfloat16), values.to(torch.bfloat16),
                  keys_post_rope=True)
a = args.correlation
q = torch.randn(B, HQ, D, device="cuda", generator=gen)
k_new = torch.randn(B, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
v_new = torch.randn(B, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)


def step():
    global q
    q = a * q + math.sqrt(1 - a * a) * torch.randn(B, HQ, D, device="cuda", generator=gen)
    store.decode(0, slots, (2.0 * q).to(torch.bfloat16), k_new, v_new)


for _ in range(args.warmup):
    step()
torch.cuda.synchronize()
store.reset_stats()
torch.cuda.profiler.start()
started = time.perf_counter()
for _ in range(args.profiled):
    step()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print(f"B={B} S={S} budget={args.budget} values {args.values}: hit {store.stats()['hit_rate']:.2f}, "
      f"{(time.perf_counter() - started) / args.profiled * 1e3:.3f} ms a step (profiled)")
