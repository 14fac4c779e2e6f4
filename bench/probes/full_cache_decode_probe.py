"""Times the example decoder's FullAttentionCache.decode for one layer of Llama-3-8B shapes at S=122880 (B=1 and 7),
next to the bare SDPA call it makes, and a 2-layer decode_step: where do its ~1.7 ms a layer come from?

    python bench/probes/full_cache_decode_probe.py
"""

import importlib.util
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("llama_decoder", os.path.join(ROOT, "examples", "llama_decoder.py"))
L = importlib.util.module_from_spec(spec)
sys.modules["llama_decoder"] = L  # dataclasses look their module up there
spec.loader.exec_module(L)

S, MAX = 122880, 123416
cfg = L.LlamaConfig(num_layers=2)
model = L.LlamaModel(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
cache = L.FullAttentionCache(cfg, 7, MAX, "cuda", torch.bfloat16)
slots = [cache.add_sequence() for _ in range(7)]
for s in slots:
    cache.set_prompt_length(s, S)


def timed(name, fn, reps=10):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    print(f"{name:50s} {(time.perf_counter() - t) / reps * 1e3:8.3f} ms", flush=True)


for b in (1, 7):
    q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 8, 128, device="cuda", dtype=torch.bfloat16)
    timed(f"B={b} cache.decode (one layer)", lambda: cache.decode(0, slots[:b], q, k, k))
    kk, vv = cache.keys[0][:b, :, :S + 1], cache.values[0][:b, :, :S + 1]
    timed(f"B={b} bare SDPA", lambda: F.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True))
    tokens = torch.arange(b, device="cuda")
    timed(f"B={b} model.decode_step (2 layers, no advance)",
          lambda: (model.decode_step(cache, slots[:b], tokens), [cache.set_prompt_length(s, S) for s in slots]))
