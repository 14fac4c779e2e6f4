"""What check_finite="always" costs a decode step on CUDA (docs/semantics.md, "Non-finite inputs"): the check waits for
the GPU on every decode call, so the host cannot queue the next layer's work while the GPU runs this one. Times eager
decode steps of a few layers with a stand-in for the rest of the model between the store calls (two bf16 GEMMs of a
Llama-3-8B layer's MLP size at batch B), with check_finite="auto" (decode unchecked on CUDA) and "always".

    python bench/probes/finite_check_cost.py [--batch 8] [--seq-len 4096] [--layers 8] [--steps 30]

Prints ms per step for each and the difference per layer.
"""

import argparse
import time

import torch

from shadowkv_core import KVStore

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=4096)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

HQ, HKV, D, HIDDEN, FFN = 32, 8, 128, 4096, 14336
B, S, L = args.batch, args.seq_len, args.layers
gen = torch.Generator(device="cuda").manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)


up, down = randn(HIDDEN, FFN) * 0.01, randn(FFN, HIDDEN) * 0.01
hidden = randn(B, HIDDEN)
keys, values = randn(B, S, HKV, D), randn(B, S, HKV, D)


def run(check_finite):
    store = KVStore(L, HQ, HKV, D, max_batch=B, max_seq_len=S + args.steps + 16, rank=160, budget=1024,
                    dtype="bfloat16", device="cuda:0", value_store="device", check_finite=check_finite)
    slots = store.add_sequences(B)
    for layer in range(L):
        store.prefill(layer, slots, keys, values)
    inputs = [(randn(B, HQ, D), randn(B, HKV, D), randn(B, HKV, D)) for _ in range(L)]
    outs = [torch.empty(B, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]

    def step():
        x = hidden
        for layer in range(L):
            q, k, v = inputs[layer]
            store.decode(layer, slots, q, k, v, out=outs[layer])
            x = (torch.relu(x @ up) @ down) + outs[layer].reshape(B, -1)[:, :HIDDEN]
        return x

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.steps * 1e3


auto_ms = run("auto")
always_ms = run("always")
print(f"B={B} S={S} layers={L}: check_finite='auto' {auto_ms:.3f} ms/step, 'always' {always_ms:.3f} ms/step, "
      f"difference {(always_ms - auto_ms) / L * 1e3:.1f} us per layer ({(always_ms / auto_ms - 1) * 100:.1f}%)")
