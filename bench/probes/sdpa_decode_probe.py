"""Why is the example decoder's full-attention decode slow on the H200? Times one layer's decode attention over a
preallocated cache [B, Hkv, max_len, D] (the example's layout) in the forms SDPA can take, next to a contiguous
[B, Hkv, S, D] cache (step_benchmark.py's form; full-attention decode over 122K tokens at B=8: ~0.9 ms on the H200, bench/README.md), and the cache write.

    python bench/probes/sdpa_decode_probe.py
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, HQ, HKV, D, S, MAX = 7, 32, 8, 128, 122880, 123416
dev, dt = "cuda", torch.bfloat16
keys = torch.randn(B, HKV, MAX, D, device=dev, dtype=dt)
values = torch.randn(B, HKV, MAX, D, device=dev, dtype=dt)
q = torch.randn(B, HQ, D, device=dev, dtype=dt)


def timed(name, fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    print(f"{name:58s} {(time.perf_counter() - t) / reps * 1e3:8.3f} ms", flush=True)


kk, vv = keys[:, :, :S], values[:, :, :S]
timed("sliced, q [B,Hq,1,D], enable_gqa (default backends)",
      lambda: F.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True))
timed("sliced, q [B,Hkv,G,D] (G as query length)",
      lambda: F.scaled_dot_product_attention(q.reshape(B, HKV, HQ // HKV, D), kk, vv))
for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    try:
        with sdpa_kernel([backend]):
            timed(f"sliced, enable_gqa, only {backend.name}",
                  lambda: F.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True))
    except RuntimeError as exc:
        print(f"sliced, enable_gqa, only {backend.name}: {str(exc)[:80]}")
kc, vc = kk.contiguous(), vv.contiguous()
timed("contiguous [B,Hkv,S,D], enable_gqa", lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True))
del kc, vc
slot_t = torch.arange(B, device=dev)
pos_t = torch.full((B,), S, device=dev)
k_new = torch.randn(B, HKV, D, device=dev, dtype=dt)
timed("cache write keys[slot_t, :, pos_t] = k_new", lambda: keys.__setitem__((slot_t, slice(None), pos_t), k_new))
print(torch.__version__, torch.cuda.get_device_name())
