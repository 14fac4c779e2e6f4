"""Tensor parallelism for examples/llama_decoder.py: each rank owns Hkv/tp KV heads (and their Hq/tp query heads),
1/tp of the MLP, and its OWN KVStore over its heads. Also the launcher for real runs.

    torchrun --nproc-per-node 2 examples/tp_llama_decoder.py                 # 2 GPUs, NCCL, Llama-3-8B shapes
    torchrun --nproc-per-node 2 examples/tp_llama_decoder.py --tiny          # CPU, gloo, tiny model (seconds)

Who owns what (tp ranks, rank i)
================================
* Attention, column-parallel q/k/v: rank i holds the rows of the fused qkv weight for query heads
  [i*Hq/tp, (i+1)*Hq/tp) and KV heads [i*Hkv/tp, (i+1)*Hkv/tp) (query head j reads KV head j // G, so a rank's
  query heads read only its own KV heads: no communication inside attention). Its cache holds only those KV heads:
  a dense cache of Hkv/tp heads, or a KVStore built with num_kv_heads=Hkv/tp, num_q_heads=Hq/tp. Each shard's store
  has its own low-rank factorisation of ITS heads' pre-RoPE keys ([S, Hkv/tp*D] instead of [S, Hkv*D]); selection,
  landmarks and outliers are per KV head anyway, so they are the same as with one store over all heads.
* o_proj, row-parallel: rank i holds the columns of o for its query heads and computes a partial [B, hidden];
  ONE all-reduce (sum) per attention block gives the full o_proj output on every rank.
* MLP: gate/up column-parallel (rank i holds gate and up rows [i*I/tp, (i+1)*I/tp)), SiLU(gate)*up is local,
  down row-parallel (its columns for the same range): ONE all-reduce per MLP block.
* Replicated on every rank (the simplest choice): the embedding, the RMSNorm weights, the final norm and the LM head.
  The residual stream is therefore replicated too, and every rank computes the same logits. (A vocab-parallel
  embedding/LM head would save 2*vocab*hidden*(1 - 1/tp) weights per rank for two more collectives; not done.)

The weights are the TP=1 model's (`LlamaModel(cfg, seed=...)`), sliced by rank: TP=tp computes what TP=1 computes,
up to the order of the floating-point sums in the all-reduce, for the dense cache and for the store at full rank
(any budget: selection does not depend on the factorisation). At a rank below full, TP=tp equals the TP=1 model over
`HeadShardedCache` (tp per-shard stores in one process), not the TP=1 model over one store of all heads.

The model code is llama_decoder.py's: `TPLlamaModel` is a `LlamaModel` over sliced weights whose `reduce` hook (the
identity there) is `torch.distributed.all_reduce`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import types
from typing import List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama_decoder import (  # noqa: E402  (reuse: the model, the caches, RoPE, the decoder)
    AttentionCache,
    FullAttentionCache,
    LayerWeights,
    LlamaConfig,
    LlamaDecoder,
    LlamaModel,
    ShadowKVCache,
    default_dtype,
)

__all__ = [
    "check_tp",
    "shard_config",
    "shard_layer",
    "TPLlamaModel",
    "HeadShardedCache",
    "make_cache",
    "teacher_forced",
    "main",
]


# ----------------------------------------------------------------------------------------------------------------------
# sharding
# ----------------------------------------------------------------------------------------------------------------------

def check_tp(cfg: LlamaConfig, tp: int) -> None:
    """Raises ValueError unless tp ranks can each own whole KV heads, their query heads and an equal MLP slice."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    if cfg.num_q_heads % cfg.num_kv_heads:
        raise ValueError(f"num_q_heads={cfg.num_q_heads} is not a multiple of num_kv_heads={cfg.num_kv_heads}")
    if cfg.num_kv_heads % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide num_kv_heads={cfg.num_kv_heads}: each rank must "
                         f"own whole KV heads (use a tp that divides {cfg.num_kv_heads}; KV-head replication for "
                         "tp > num_kv_heads is not implemented)")
    if cfg.num_q_heads % tp:  # implied by the two checks above (Hq = G*Hkv); kept for a clear message
        raise ValueError(f"tensor-parallel size {tp} does not divide num_q_heads={cfg.num_q_heads}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide intermediate_size={cfg.intermediate_size}")


def shard_config(cfg: LlamaConfig, tp: int) -> LlamaConfig:
    """The shapes one rank computes with: Hq/tp query heads, Hkv/tp KV heads, intermediate/tp (hidden unchanged)."""
    check_tp(cfg, tp)
    return dataclasses.replace(cfg, num_q_heads=cfg.num_q_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def shard_layer(cfg: LlamaConfig, w: LayerWeights, tp: int, rank: int) -> LayerWeights:
    """Rank `rank`'s slice of one layer of the TP=1 model (copies: the full layer can be freed afterwards)."""
    check_tp(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    d = cfg.head_dim
    hq, hkv, inter = cfg.num_q_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
    q0, kv0, f0 = rank * hq * d, rank * hkv * d, rank * inter
    k_base, v_base = cfg.num_q_heads * d, (cfg.num_q_heads + cfg.num_kv_heads) * d
    out = LayerWeights.__new__(LayerWeights)
    out.input_norm = w.input_norm.clone()
    out.qkv = torch.cat((w.qkv[q0:q0 + hq * d],                                         # column-parallel q | k | v
                         w.qkv[k_base + kv0:k_base + kv0 + hkv * d],
                         w.qkv[v_base + kv0:v_base + kv0 + hkv * d])).contiguous()
    out.o = w.o[:, q0:q0 + hq * d].contiguous()                                          # row-parallel
    out.post_norm = w.post_norm.clone()
    i = cfg.intermediate_size
    out.gate_up = torch.cat((w.gate_up[f0:f0 + inter], w.gate_up[i + f0:i + f0 + inter])).contiguous()
    out.down = w.down[:, f0:f0 + inter].contiguous()                                     # row-parallel
    return out


class TPLlamaModel(LlamaModel):
    """One rank's share of a `LlamaModel`: `config` is the shard's (Hq/tp, Hkv/tp, intermediate/tp), so caches made
    from it (`FullAttentionCache(model.config, ...)`, `ShadowKVCache(model, ...)`) hold this rank's heads only.
    `full_config` is the whole model's. `reduce` sums the row-parallel partial results over `group`."""

    def __init__(self, full: LlamaModel, tp: int, rank: int, group=None):
        cfg = full.config
        self.full_config = cfg
        self.config = shard_config(cfg, tp)
        self.tp, self.rank, self.group = int(tp), int(rank), group
        self.device, self.dtype, self.prefill_chunk = full.device, full.dtype, full.prefill_chunk
        with torch.no_grad():
            self.embed = full.embed.clone()                     # replicated
            self.layers = [shard_layer(cfg, w, tp, rank) for w in full.layers]
            self.final_norm = full.final_norm.clone()           # replicated
            self.lm_head = full.lm_head.clone()                 # replicated
        self.inv_freq = full.inv_freq.clone()
        self.all_reduces = 0

    @classmethod
    def from_seed(cls, cfg: LlamaConfig, tp: int, rank: int, device="cpu", dtype=None, seed: int = 0,
                  prefill_chunk: int = 4096, group=None, keep_full: bool = False):
        """Builds the TP=1 model from `seed` (the same weights on every rank) and keeps this rank's slice; with
        keep_full also returns the full model (rank 0 of the launcher uses it as the TP=1 reference)."""
        check_tp(cfg, tp)
        full = LlamaModel(cfg, device, dtype, seed=seed, prefill_chunk=prefill_chunk)
        model = cls(full, tp, rank, group)
        if keep_full:
            return model, full
        del full
        return model

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
            self.all_reduces += 1
        return x


# ----------------------------------------------------------------------------------------------------------------------
# caches
# ----------------------------------------------------------------------------------------------------------------------

class HeadShardedCache(AttentionCache):
    """A TP=1 model's cache split by KV heads into `tp` caches exactly as the tp ranks hold them (each a dense cache
    or a KVStore over Hkv/tp KV heads and Hq/tp query heads), in ONE process. The reference that TP=tp must equal at
    any rank and budget: each shard's store sees the same keys, values and queries as that rank's store."""

    def __init__(self, cfg: LlamaConfig, shards: Sequence[AttentionCache]):
        super().__init__()
        self.cfg, self.shards = cfg, list(shards)
        self.tp = len(self.shards)
        check_tp(cfg, self.tp)
        self.hq, self.hkv = cfg.num_q_heads // self.tp, cfg.num_kv_heads // self.tp

    def add_sequence(self) -> int:
        slots = [c.add_sequence() for c in self.shards]
        if len(set(slots)) != 1:
            raise RuntimeError(f"shards gave different slots {slots}")
        self._lengths[slots[0]] = 0
        return slots[0]

    def release(self, slot: int) -> None:
        super().release(slot)
        for c in self.shards:
            c.release(slot)

    def set_prompt_length(self, slot, length):
        super().set_prompt_length(slot, length)
        for c in self.shards:
            c.set_prompt_length(slot, length)

    def advance(self, slots):
        super().advance(slots)
        for c in self.shards:
            c.advance(slots)

    def store_prompt(self, layer, slot, k_pre, k, v, q_last):
        for i, c in enumerate(self.shards):
            kv, q = slice(i * self.hkv, (i + 1) * self.hkv), slice(i * self.hq, (i + 1) * self.hq)
            c.store_prompt(layer, slot, k_pre[:, kv], k[:, kv], v[:, kv], q_last[q])

    def decode(self, layer, slots, q, k, v):
        outs = []
        for i, c in enumerate(self.shards):
            kv, qs = slice(i * self.hkv, (i + 1) * self.hkv), slice(i * self.hq, (i + 1) * self.hq)
            outs.append(c.decode(layer, slots, q[:, qs], k[:, kv], v[:, kv]))
        return torch.cat(outs, dim=1)


def make_cache(kind: str, model: LlamaModel, max_batch: int, max_seq_len: int, shards: int = 1,
               **store_kwargs) -> AttentionCache:
    """A cache for `model` (a `LlamaModel` or one rank's `TPLlamaModel`: its config decides the heads):
    kind "full" (dense) or "store" (KVStore, `store_kwargs` as for ShadowKVCache). shards > 1: `HeadShardedCache` of
    that many per-shard caches (for a TP=1 model: the exact reference of TP=shards)."""
    if kind not in ("full", "store"):
        raise ValueError(f"cache kind must be 'full' or 'store', got {kind!r}")
    if shards > 1:
        part = types.SimpleNamespace(config=shard_config(model.config, shards), dtype=model.dtype,
                                     device=model.device)
        return HeadShardedCache(model.config, [make_cache(kind, part, max_batch, max_seq_len, **store_kwargs)
                                               for _ in range(shards)])
    if kind == "full":
        return FullAttentionCache(model.config, max_batch, max_seq_len, model.device, model.dtype)
    return ShadowKVCache(model, max_batch=max_batch, max_seq_len=max_seq_len, **store_kwargs)


def teacher_forced(decoder: LlamaDecoder, prompts: Sequence[torch.Tensor], tokens: torch.Tensor):
    """The prompts join one at a time (each prefilled alone), then decode together, step t feeding tokens[t] ([B]),
    whatever the model would have chosen, so two models can be compared step by step without their greedy choices
    diverging. Returns (slots, prompt logits [B, vocab], step logits [steps, B, vocab]) on the CPU, float32."""
    slots = [decoder.add_sequence(p) for p in prompts]
    first = torch.stack([decoder.prompt_logits[s] for s in slots]).float().cpu()
    steps = [decoder.decode_step(slots, tokens[t]).float().cpu() for t in range(tokens.shape[0])]
    return slots, first, torch.stack(steps)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius, float64)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------------------------------------------------
# the launcher
# ----------------------------------------------------------------------------------------------------------------------

def _parse(argv):
    p = argparse.ArgumentParser(
        description="Tensor-parallel decode of a Llama-family model (random weights) over per-rank dense caches or "
                    "KVStores. Run under torchrun (NCCL on GPUs, gloo on the CPU); without torchrun it runs TP=1.")
    p.add_argument("--tiny", action="store_true", help="LlamaConfig.tiny() on the CPU (float32, gloo), seconds")
    p.add_argument("--cache", choices=["store", "full"], default="store")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when CUDA is there and not --tiny), cpu")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on GPUs, float32 on the CPU)")
    p.add_argument("--batch", type=int, default=1, help="sequences (each prefilled alone, then decoded together)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 32768; --tiny 200)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (greedy)")
    p.add_argument("--warmup", type=int, default=2, help="decode steps before timing")
    p.add_argument("--check-steps", type=int, default=4,
                   help="decode steps compared with TP=1 on rank 0 (teacher-forced with the TP run's tokens; 0: none)")
    p.add_argument("--rank", type=int, default=None,
                   help="store rank PER SHARD (default: 160, or the shard's full rank Hkv/tp*D if smaller; --tiny: "
                        "the shard's full rank)")
    p.add_argument("--budget", type=int, default=None, help="selected tokens per KV head (default 2048; --tiny: all)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outlier-chunks", type=int, default=None, help="default 48 (--tiny: 1)")
    p.add_argument("--local-chunks", type=int, default=None, help="default 4 (--tiny: 1)")
    p.add_argument("--generation-window", type=int, default=None, help="default 256 (--tiny: 16)")
    p.add_argument("--value-store", default=None, help="KVStore value_store (default: the store's)")
    p.add_argument("--layers", type=int, default=None, help="override num_layers (e.g. 4 for a quick GPU check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    return p.parse_args(argv)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = (not args.tiny and args.device == "auto" and torch.cuda.is_available()) or args.device.startswith("cuda")
    device = torch.device(f"cuda:{local_rank}" if use_cuda and args.device in ("auto", "cuda") else
                          (args.device if use_cuda else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (this lab's machines)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group(backend=backend, device_id=device)
        else:
            dist.init_process_group(backend=backend)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[args.dtype] or default_dtype(device)

    cfg = LlamaConfig.tiny() if args.tiny else LlamaConfig()
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    check_tp(cfg, world)
    scfg = shard_config(cfg, world)
    s_len = args.prompt_len or (200 if args.tiny else 32768)
    total = s_len + args.warmup + args.steps + 1
    shard_full_rank = scfg.num_kv_heads * scfg.head_dim
    store_kw = dict(
        rank=args.rank or (shard_full_rank if args.tiny else min(160, shard_full_rank)),
        chunk_size=args.chunk_size,
        budget=args.budget or (-(-total // args.chunk_size) * args.chunk_size if args.tiny else 2048),
        outlier_chunks=args.outlier_chunks if args.outlier_chunks is not None else (1 if args.tiny else 48),
        local_chunks=args.local_chunks if args.local_chunks is not None else (1 if args.tiny else 4),
        generation_window=args.generation_window or (16 if args.tiny else 256))
    if args.value_store:
        store_kw["value_store"] = args.value_store

    def log(*parts):
        if rank == 0:
            print(*parts, flush=True)

    log(f"TP={world} ({backend}, {device.type}, {dtype}): {cfg}")
    log(f"each rank: {scfg.num_q_heads} q / {scfg.num_kv_heads} kv heads, intermediate {scfg.intermediate_size}; "
        f"cache={args.cache}" + (f" {store_kw}" if args.cache == "store" else ""))
    check = args.check_steps > 0 and rank == 0
    t0 = time.perf_counter()
    built = TPLlamaModel.from_seed(cfg, world, rank, device, dtype, seed=args.seed, keep_full=check)
    model, full = built if check else (built, None)
    _sync(device)
    log(f"weights built and sliced in {time.perf_counter() - t0:.1f}s")
    if world > 1:  # every rank drew the same weights from the seed (its device's generator): the embeddings agree
        sums = [None] * world
        dist.all_gather_object(sums, float(model.embed.double().sum()))
        if len(set(sums)) != 1:
            raise RuntimeError(f"ranks built different weights from seed {args.seed}: embedding sums {sums}")

    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (s_len,), generator=gen) for _ in range(args.batch)]
    cache = make_cache(args.cache, model, args.batch, total, **store_kw)
    decoder = LlamaDecoder(model, cache)

    # prefill (each prompt alone), then greedy decode of the batch
    if world > 1:
        dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    slots = [decoder.add_sequence(p) for p in prompts]
    _sync(device)
    prefill_s = time.perf_counter() - t0
    # Tokens and the logits kept for the check stay on the device until the timing ends (no host sync per step).
    token = torch.stack([decoder.prompt_logits[s].argmax() for s in slots])
    tokens, step_logits = [token], []
    for _ in range(args.warmup):
        step = decoder.decode_step(slots, token)
        if len(step_logits) < args.check_steps:
            step_logits.append(step.float())
        token = step.argmax(-1)
        tokens.append(token)
    if world > 1:
        dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step = decoder.decode_step(slots, token)
        if len(step_logits) < args.check_steps:
            step_logits.append(step.float())
        token = step.argmax(-1)
        tokens.append(token)
    _sync(device)
    decode_s = time.perf_counter() - t0
    tokens = torch.stack(tokens).cpu()                                             # [1 + warmup + steps, B]
    step_logits = [x.cpu() for x in step_logits]

    mine = dict(rank=rank, prefill_s=prefill_s, decode_s=decode_s,
                tokens_per_s=args.batch * args.steps / decode_s if decode_s > 0 else float("nan"),
                all_reduces=model.all_reduces,
                memory_report=dict(cache.store.memory_report()) if args.cache == "store" else {},
                store_stats=dict(cache.store.stats()) if args.cache == "store" else {},
                dense_cache_bytes=(sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
                                   if args.cache == "full" else 0),
                weight_bytes=sum(t.numel() * t.element_size() for t in
                                 [model.embed, model.final_norm, model.lm_head] +
                                 [x for w in model.layers for x in vars(w).values()]))
    if device.type == "cuda":
        free, total_mem = torch.cuda.mem_get_info(device)
        mine["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)   # torch's allocations only
        mine["device_used_bytes"] = total_mem - free                             # everything, the store's arenas too
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, dict(mine, tokens=tokens.tolist()))
    else:
        everyone = [dict(mine, tokens=tokens.tolist())]
    same_tokens = all(e["tokens"] == everyone[0]["tokens"] for e in everyone)
    prompt_logits = torch.stack([decoder.prompt_logits[s].float().cpu() for s in slots])
    for s in slots:
        decoder.release(s)
    del decoder, cache

    result = dict(tp=world, backend=backend, device=str(device), dtype=str(dtype), config=dataclasses.asdict(cfg),
                  cache=args.cache, store_kwargs=store_kw if args.cache == "store" else None, batch=args.batch,
                  prompt_len=s_len, steps=args.steps, ranks=[{k: v for k, v in e.items() if k != "tokens"}
                                                             for e in everyone],
                  tokens_identical_on_all_ranks=same_tokens)
    if rank == 0:
        log(f"prefill {args.batch} x {s_len} tokens: {prefill_s:.2f}s; decode {args.steps} steps x batch "
            f"{args.batch}: {decode_s:.3f}s = {mine['tokens_per_s']:.1f} tokens/s (rank 0); all-reduces per rank "
            f"{model.all_reduces} (2 per layer per prefill chunk and per step); greedy tokens identical on all ranks: "
            f"{same_tokens}")
        for e in everyone:
            mem = e["memory_report"]
            kinds = ("low_rank_factors", "landmarks", "outliers", "exact_tokens", "value_store", "selection_cache")
            extra = (f", store total {mem['total'] / 2**20:.2f} MiB (" +
                     ", ".join(f"{k} {mem[k] / 2**20:.2f}" for k in kinds if k in mem) +
                     f"; a dense cache of the same tokens {mem['full_attention_equivalent'] / 2**20:.2f})"
                     if mem else f", dense cache (preallocated) {e['dense_cache_bytes'] / 2**20:.1f} MiB")
            peak = (f", torch peak {e['max_memory_allocated'] / 2**30:.2f} GiB, device used "
                    f"{e['device_used_bytes'] / 2**30:.2f} GiB" if "max_memory_allocated" in e else "")
            log(f"  rank {e['rank']}: weights {e['weight_bytes'] / 2**20:.1f} MiB{extra}{peak}; "
                f"{e['tokens_per_s']:.1f} tok/s")

    if check:
        n = min(args.check_steps, len(step_logits))
        forced = tokens[:n]                            # the tokens the TP run fed at steps 0..n-1
        refs = {}
        ref_kinds = [("TP=1 dense cache", "full", 1)]
        if args.cache == "store":
            ref_kinds = [(f"TP=1 over {world} per-shard stores (exact reference)", "store", world),
                         ("TP=1 dense cache (the store's own error)", "full", 1)]
        for label, kind, shards in ref_kinds:
            ref_cache = make_cache(kind, full, args.batch, total, shards=shards, **store_kw)
            _, first, ref_steps = teacher_forced(LlamaDecoder(full, ref_cache), prompts, forced)
            refs[label] = dict(prefill=rel_err(prompt_logits, first),
                               steps=[rel_err(step_logits[t], ref_steps[t]) for t in range(n)],
                               argmax_agree=float((torch.stack(step_logits[:n]).argmax(-1) ==
                                                   ref_steps.argmax(-1)).float().mean()) if n else float("nan"))
            del ref_cache
        result["agreement_vs_tp1"] = refs
        log(f"logits vs TP=1 (relative error per decode step, teacher-forced with the TP run's tokens, {n} steps):")
        for label, r in refs.items():
            log(f"  {label}: prefill {r['prefill']:.2e}; steps " + " ".join(f"{e:.2e}" for e in r["steps"]) +
                f"; argmax agreement {r['argmax_agree']:.3f}")
    if rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
        log(f"wrote {args.json}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
