"""The main job: a long synthetic context through the store, side by side with full attention.

    python -m shadowkv_core.demo [--seq-len 16384 --steps 64 --device auto ...]

Prints memory by kind, the decode output's error against full attention, the temporal hit rate and the time per
step of both, on whatever device is present (CUDA when this build has the CUDA backend and a GPU, else the CPU).
The data has the structure real keys have: a few dominant directions drifting slowly along the sequence, so chunks
are coherent and a low rank keeps most of the energy; queries drift slowly, as consecutive decode steps do.
"""

from __future__ import annotations

import argparse
import math
import time

from ._progress import ProgressBar
from ._store import KVStore, build_info


def _parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m shadowkv_core.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=16384, help="prompt tokens (default 16384)")
    p.add_argument("--steps", type=int, default=48, help="decode steps (default 48)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rank", type=int, default=160)
    p.add_argument("--budget", type=int, default=1024, help="selected tokens per KV head per step")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outlier-chunks", type=int, default=48)
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    info = build_info()
    if "cuda" in info["backends"] and info["cuda_devices"] > 0:
        return "cuda:0"
    return "cpu"


def _rope(x, positions, inv_freq):
    """Half-split RoPE of x [..., S, H, D] at positions [S] (float32 angles, as transformers computes them)."""
    import torch

    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _structured_keys(generator, length, heads, dim, directions, device):
    """Pre-RoPE keys: `directions` dominant directions with slowly drifting weights, plus small noise."""
    import torch

    basis = torch.randn(directions, heads * dim, generator=generator) / math.sqrt(directions)
    steps = torch.randn(length, directions, generator=generator) * 0.15
    weights = torch.cumsum(steps, dim=0) / math.sqrt(max(1, length) ** 0.5) + torch.randn(1, directions, generator=generator)
    keys = weights @ basis * 3.0 + 0.3 * torch.randn(length, heads * dim, generator=generator)
    return keys.reshape(length, heads, dim).to(device)


def main(argv=None) -> int:
    import torch

    args = _parse_args(argv)
    device = _pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    group = args.q_heads // args.kv_heads
    scale = 1.0 / math.sqrt(args.head_dim)
    capacity = args.seq_len + args.steps + 1

    info = build_info()
    print(f"shadowkv_core {info['version']} | device {device} | backends {info['backends']} | BLAS {info['blas']}")
    print(
        f"context {args.seq_len} tokens, {args.layers} layers, heads {args.q_heads}/{args.kv_heads}, "
        f"head_dim {args.head_dim}, rank {args.rank}, budget {args.budget}, chunk {args.chunk_size}, dtype {args.dtype}"
    )

    store = KVStore(
        args.layers, args.q_heads, args.kv_heads, args.head_dim, max_batch=1, max_seq_len=capacity,
        rank=args.rank, chunk_size=args.chunk_size, budget=args.budget, outlier_chunks=args.outlier_chunks,
        local_chunks=args.local_chunks, dtype=args.dtype, device=device,
    )
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    (slot,) = store.add_sequences(1)

    # Prefill every layer; keep the post-RoPE cache for the full-attention side.
    positions = torch.arange(args.seq_len)
    full_keys, full_values = [], []
    bar = ProgressBar(args.layers, "prefill")
    prefill_seconds = 0.0
    for layer in range(args.layers):
        keys_pre = _structured_keys(generator, args.seq_len, args.kv_heads, args.head_dim, 24, "cpu")
        values = torch.randn(args.seq_len, args.kv_heads, args.head_dim, generator=generator)
        started = time.perf_counter()
        store.prefill(layer, [slot], keys_pre[None].to(device, dtype), values[None].to(device, dtype))
        prefill_seconds += time.perf_counter() - started
        full_keys.append(_rope(keys_pre, positions, inv_freq).to(device, dtype))
        full_values.append(values.to(device, dtype))
        bar.advance()

    # Decode: queries follow a few "topics" (key directions) that drift slowly between steps.
    topics = [keys for keys in full_keys]
    ours_seconds = 0.0
    full_seconds = 0.0
    errors = []
    bar = ProgressBar(args.steps, "decode ")
    anchor = torch.randint(0, args.seq_len, (args.layers, 4), generator=generator)
    for step in range(args.steps):
        position = args.seq_len + step
        for layer in range(args.layers):
            if step % 8 == 0:
                anchor[layer] = torch.randint(0, args.seq_len, (4,), generator=generator)
            picked = topics[layer][anchor[layer]].float().mean(dim=0)  # [Hkv, D]
            q = (picked.repeat_interleave(group, dim=0) * 2.0 + 0.5 * torch.randn(args.q_heads, args.head_dim, generator=generator))
            k_pre = _structured_keys(generator, 1, args.kv_heads, args.head_dim, 24, "cpu")
            k_new = _rope(k_pre, torch.tensor([position]), inv_freq)[0]
            v_new = torch.randn(args.kv_heads, args.head_dim, generator=generator)
            q_d, k_d, v_d = (t[None].to(device, dtype) for t in (q, k_new, v_new))

            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = store.decode(layer, [slot], q_d, k_d, v_d)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            ours_seconds += time.perf_counter() - started

            full_keys[layer] = torch.cat([full_keys[layer], k_d[0][None]], dim=0)
            full_values[layer] = torch.cat([full_values[layer], v_d[0][None]], dim=0)
            started = time.perf_counter()
            keys = full_keys[layer].transpose(0, 1)[None]  # [1, Hkv, T, D]
            values = full_values[layer].transpose(0, 1)[None]
            reference = torch.nn.functional.scaled_dot_product_attention(
                q_d[:, :, None, :], keys, values, scale=scale, enable_gqa=True
            )[:, :, 0, :]
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            full_seconds += time.perf_counter() - started
            diff = (out.float() - reference.float()).norm() / reference.float().norm()
            errors.append(diff.item())
        bar.advance(note=f"rel.err {errors[-1]:.3f}")

    memory = store.memory_report()
    stats = store.stats()
    mib = 1.0 / (1 << 20)
    print("\nmemory by kind (MiB)")
    for kind in ("low_rank_factors", "landmarks", "outliers", "exact_tokens", "value_store", "selection_cache"):
        print(f"  {kind:<18} {memory[kind] * mib:10.2f}")
    print(f"  {'total':<18} {memory['total'] * mib:10.2f}   (GPU-resident when on CUDA: all but value_store)")
    print(f"  {'full attention KV':<18} {memory['full_attention_equivalent'] * mib:10.2f}")
    steps_all_layers = args.steps
    print("\n                      shadowkv      full attention")
    print(f"time per step (ms)  {1e3 * ours_seconds / steps_all_layers:10.2f}      {1e3 * full_seconds / steps_all_layers:10.2f}")
    print(f"prefill (s)         {prefill_seconds:10.2f}")
    errors.sort()
    print(
        f"output rel. error  median {errors[len(errors) // 2]:.4f}  max {errors[-1]:.4f}  "
        f"(vs full attention, {len(errors)} layer-steps)"
    )
    print(
        f"temporal hit rate   {stats['hit_rate']:.3f}   chunks rebuilt {stats['chunks_rebuilt']}   "
        f"value bytes fetched {stats['bytes_fetched'] * mib:.1f} MiB   folds {stats['folds']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
