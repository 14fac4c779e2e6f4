"""transformers' `model.generate()` with the store (`shadowkv_core.hf`) next to transformers' own cache, on a
random-weight Llama-3-8B-shaped model (nothing downloaded): tokens/s at B sequences of S prompt tokens.

    python bench/hf_benchmark.py --batch 4 --seq-len 32768 --new-tokens 64 --json out.json     # on a GPU
    python bench/hf_benchmark.py --tiny                                                          # CPU smoke run

For each cache it times one `generate` call (prefill + new tokens, greedy, `min_new_tokens` = `max_new_tokens`) and,
separately, the prefill alone (`max_new_tokens=1`), and reports decode tokens/s = B * (new - 1) / (total - prefill).
The same prompt tensor and weights serve both caches; the store's stats (hit rate) and memory report are recorded.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

# transformers >= 5.24 names the generate() argument `cache` (`past_key_values` is a deprecated alias); 5.17 only knows
# `past_key_values` (docs/transformers.md).
CACHE_KEYWORD = "cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                          rope_theta=10000.0)
    else:  # Llama-3-8B's shapes
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=args.seq_len + args.new_tokens + 64, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(args.dtype)
    model.eval()
    return model


def timed_generate(model, inputs, new_tokens, cache, device):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache is not None:
        kwargs[CACHE_KEYWORD] = cache
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def run(args) -> dict:
    import shadowkv_core.hf as skv

    model = build_model(args)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=g).to(args.device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    result = {"batch": args.batch, "seq_len": args.seq_len, "new_tokens": args.new_tokens, "layers":
              model.config.num_hidden_layers, "device": args.device, "dtype": str(args.dtype), "methods": {}}
    for method in ("transformers", "store"):
        cache = None
        if method == "store":
            cache = skv.enable(model, budget=args.budget, rank=args.rank, max_batch=args.batch,
                               max_seq_len=args.seq_len + args.new_tokens + 8, value_store=args.value_store)
        else:
            model.set_attn_implementation("sdpa")
        prefill_s, _ = timed_generate(model, inputs, 1, cache, args.device)
        if cache is not None:
            cache.reset()
        total_s, out = timed_generate(model, inputs, args.new_tokens, cache, args.device)
        row = {"prefill_s": prefill_s, "total_s": total_s,
               "decode_tokens_per_s": args.batch * (args.new_tokens - 1) / max(total_s - prefill_s, 1e-9),
               "new_tokens": int(out.shape[1] - args.seq_len)}
        if cache is not None:
            row["store_stats"] = dict(cache.store.stats())
            row["store_memory"] = dict(cache.store.memory_report())
            cache.reset()
        result["methods"][method] = row
        print(f"{method:12s} prefill {prefill_s:7.2f} s, total {total_s:7.2f} s, decode "
              f"{row['decode_tokens_per_s']:8.1f} tokens/s", flush=True)
        del cache
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model on the CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--rank", type=int, default=160)
    p.add_argument("--value-store", default="host", choices=["host", "device", "auto", "host_fp8"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.tiny:
        args.device = args.device or "cpu"
        args.batch, args.seq_len, args.new_tokens = min(args.batch, 2), min(args.seq_len, 256), min(args.new_tokens, 8)
        args.budget, args.rank = min(args.budget, 64), min(args.rank, 64)
        torch.set_num_threads(1)
    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
