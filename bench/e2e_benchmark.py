"""End to end on one GPU: a Llama-3-8B-shaped decoder (random bf16 weights, examples/llama_decoder.py) over a plain
KV cache ("full") and over a KVStore ("store"): the largest batch each holds at a long context, decode tokens/s
there and below, the time split of a step, the hit rate, prefill time and what the store adds to it.

    python bench/e2e_benchmark.py --seq-len 122880 --plot e2e-122880.png        # on the H200
    python bench/e2e_benchmark.py --tiny --json /tmp/e2e.json --plot /tmp/e2e.png   # CPU smoke test (tiny model)

What is measured, per context length and method (the model's weights, 16 GB, are built once and shared):

* Capacity, by trying. The cache is built for a batch cap: the full cache ([max_batch, Hkv, max_len, D] per layer,
  preallocated) starting at what free memory suggests; the KVStore (which reserves its device and pinned-host
  arenas when built) starting at --store-max-batch (with a host value store: at most the slots whose pinned values
  leave --host-reserve-gib of host memory available, from the store's documented layout; --no-estimate starts
  both searches at their caps and only halves and bisects). A cap "fits" when the
  cache is built without MemoryError / torch.cuda.OutOfMemoryError AND an allocation of --reserve-gib (room for one
  prompt's prefill activations; default: computed from the shapes, plus the store's own prefill temporaries) still
  succeeds on the device AND at least --host-reserve-gib of host memory stays available. Failing caps are halved,
  then the largest fitting cap is found between the last fit and the first failure (or by doubling steps above a
  fit). Then sequences are added ONE AT A TIME (each prompt prefilled alone) until one fails with out-of-memory or
  the cap is reached; a failed sequence is released and the decode runs at the batch that fit. If the very first
  prefill runs out of memory, the cache leaves no room for a prefill: it is rebuilt one sequence smaller. Every
  attempt is in the result file (capacity_search), with the measured peak of a prefill's activations.
* Prefill: the first sequence of each method goes through the whole model (timed: model + cache/store; the share of
  the time spent inside store.prefill calls, measured with CUDA events around them, is `compression_share`).
  With --reuse-prefill (default) its per-layer pre-RoPE keys, values and last query are recorded (on the GPU when
  the memory left after the capacity search holds them beside the reserve, else in pageable host memory when
  MemAvailable allows, else nowhere: then every sequence is prefilled through the model) and every later sequence
  of that method is filled from the record: the cache/store gets exactly what the model would give it for the same
  prompt (all sequences share one random prompt), without the model's forward. The record is made after the
  capacity search, so it never lowers a capacity; the copy time is excluded from the timed prefill. Each sequence
  then decodes from a different first token (so the batch diverges from the first step).
* Decode sweep at the largest batch and at powers of two below it, largest first (so the sequences of a batch always
  have equal lengths): --warmup steps, then --steps timed steps (tokens/s, ms per step; greedy tokens, one batched
  call per layer), then --split-steps more with a CUDA event pair around every attention call (store.decode /
  SDPA over the cache): attention_ms is the GPU-stream time between those events per step, rest_ms the rest of that
  instrumented step. hit_rate = store.stats() over the timed steps.
* Memory at the largest batch: store.memory_report() (its kinds, incl. host fields when the build reports them),
  torch's allocated bytes, device used bytes (total - free from cudaMemGetInfo: everything incl. the store's arena),
  host MemAvailable, and the process RSS.

A random-weight model's attention is not a trained model's: the hit rate and selection quality here say nothing
about accuracy (docs/eval.md does); the timings and capacities are what this benchmark is for.
Results: bench/results/<date>-<commit>-e2e.json (--json), appended to as {"runs": [...]} when it exists.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GiB = float(1 << 30)


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


L = _load("llama_decoder", os.path.join(ROOT, "examples", "llama_decoder.py"))


def log(*parts) -> None:
    print(*parts, flush=True)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def host_meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def process_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_available() -> float:
    return float(host_meminfo().get("MemAvailable", 0))


class Device:
    def __init__(self, name: str):
        self.name = name
        self.cuda = name.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def free_bytes(self) -> float:
        if not self.cuda:
            return float("inf")
        return float(torch.cuda.mem_get_info()[0])

    def probe(self, nbytes: float) -> bool:
        """Whether `nbytes` can still be allocated on the device (given back at once)."""
        if not self.cuda or nbytes <= 0:
            return True
        try:
            t = torch.empty(int(nbytes), dtype=torch.uint8, device=self.name)
            del t
            return True
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is expected here
            if not is_oom(exc):
                raise
            return False
        finally:
            torch.cuda.empty_cache()

    def name_of_gpu(self) -> str:
        return torch.cuda.get_device_name(self.name) if self.cuda else "cpu"


# ----------------------------------------------------------------------------------------------------------------------
# instrumentation: time inside attention/store calls, and the prefill record
# ----------------------------------------------------------------------------------------------------------------------

class Spans:
    """Durations of marked regions: CUDA event pairs on the current stream (GPU time), or wall time on the CPU."""

    def __init__(self, dev: Device):
        self.dev, self.on, self.pairs, self.cpu_s = dev, False, [], 0.0

    def reset(self, on: bool) -> None:
        self.on, self.pairs, self.cpu_s = on, [], 0.0

    def run(self, fn, *args):
        if not self.on:
            return fn(*args)
        if self.dev.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            end.record()
            self.pairs.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args)
        self.cpu_s += time.perf_counter() - t0
        return out

    def total_s(self) -> float:
        if self.dev.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        return self.cpu_s


class PrefillRecord:
    """One prompt's per-layer pre-RoPE keys, values and last post-RoPE query, kept on the GPU or in host memory."""

    def __init__(self, where: str, dev: Device, length: int):
        self.where, self.dev, self.length = where, dev, length
        self.k_pre, self.v, self.q_last = [], [], []
        self.copy_s, self.failed = 0.0, None

    def save(self, k_pre, v, q_last) -> None:
        if self.failed:
            return
        self.dev.sync()
        t0 = time.perf_counter()
        try:
            if self.where == "device":
                self.k_pre.append(k_pre.clone())
                self.v.append(v.clone())
            else:
                self.k_pre.append(k_pre.to("cpu"))
                self.v.append(v.to("cpu"))
            self.q_last.append(q_last.to("cpu"))
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            self.failed = f"out of memory recording layer {len(self.q_last)} on the {self.where}"
            self.k_pre, self.v, self.q_last = [], [], []
            self.dev.free()
        self.dev.sync()
        self.copy_s += time.perf_counter() - t0

    def complete(self, num_layers: int) -> bool:
        return not self.failed and len(self.q_last) == num_layers

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_pre + self.v + self.q_last)


class Instrumented(L.AttentionCache):
    """A cache seen by the model through timers (and, during one prefill, a recorder). Everything else delegates."""

    def __init__(self, inner: L.AttentionCache, spans: Spans):
        self.inner, self.spans, self.record = inner, spans, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # the AttentionCache methods the model calls, delegated explicitly (the base class defines them)
    def add_sequence(self):
        return self.inner.add_sequence()

    def release(self, slot):
        return self.inner.release(slot)

    def length(self, slot):
        return self.inner.length(slot)

    def set_prompt_length(self, slot, length):
        return self.inner.set_prompt_length(slot, length)

    def advance(self, slots):
        return self.inner.advance(slots)

    @property
    def active_slots(self):
        return self.inner.active_slots

    def store_prompt(self, layer, slot, k_pre, k, v, q_last):
        if self.record is not None:
            self.record.save(k_pre, v, q_last)
        return self.spans.run(self.inner.store_prompt, layer, slot, k_pre, k, v, q_last)

    def decode(self, layer, slots, q, k, v):
        return self.spans.run(self.inner.decode, layer, slots, q, k, v)


def prefill_from_record(model, cache: Instrumented, record: PrefillRecord) -> int:
    """A new sequence filled from `record` as the model's prefill of the same prompt would fill it."""
    needs_post_rope = isinstance(cache.inner, L.FullAttentionCache)  # the store takes pre-RoPE keys only
    slot = cache.add_sequence()
    try:
        s = record.length
        cos, sin = L.rope_tables(torch.arange(s, device=model.device), model.inv_freq)
        for layer in range(model.config.num_layers):
            k_pre = record.k_pre[layer].to(model.device)
            v = record.v[layer].to(model.device)
            q_last = record.q_last[layer].to(model.device)
            k = None
            if needs_post_rope:
                k = torch.empty_like(k_pre)
                for a in range(0, s, model.prefill_chunk):
                    b = min(a + model.prefill_chunk, s)
                    k[a:b] = L.apply_rope(k_pre[a:b], cos[a:b], sin[a:b])
            cache.store_prompt(layer, slot, k_pre, k, v, q_last)
            del k_pre, v, k
        cache.set_prompt_length(slot, s)
        return slot
    except BaseException:
        cache.release(slot)
        raise


# ----------------------------------------------------------------------------------------------------------------------
# memory estimates (starting points of the capacity search only; the search itself decides)
# ----------------------------------------------------------------------------------------------------------------------

def prefill_activation_bytes(cfg, s: int, chunk: int, e: int) -> float:
    """Peak bytes torch allocates in LlamaModel.prefill for an s-token prompt: the largest of its three phases
    (projections of a chunk, the whole-prompt attention, o_proj + MLP of a chunk) over the buffers kept for the
    whole prompt (residual stream, cos/sin, q, k, v, attention output)."""
    hd, kvd, h, inter = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    c = min(chunk, s)
    stream = s * (h * e + cfg.head_dim * 4)                                  # h, cos/sin
    qkv_phase = s * (hd + 3 * kvd) * e + c * ((hd + 2 * kvd) * e + 2 * h * 4 + 3 * hd * 4)
    attention_phase = s * (2 * hd + 2 * kvd) * e + s * cfg.num_q_heads * 4  # q, k, v, output, log-sum-exp
    mlp_phase = s * hd * e + c * (2 * h * 4 + 2 * h * e + 4 * inter * e)
    return float(stream + max(qkv_phase, attention_phase, mlp_phase))


def store_prefill_temporaries(cfg, s: int, e: int) -> float:
    """Device bytes the CUDA store allocates itself during one layer's prefill (cuda_backend.cpp prefill_one: fp32
    pre-RoPE keys, post-RoPE keys, value staging, positions), outside torch's allocator."""
    width = cfg.num_kv_heads * cfg.head_dim
    return float(s * (width * (4 + 2 * e) + 8) + 64 * width * width)


def store_bytes_per_sequence(cfg, max_len: int, kw: dict, e: int) -> tuple:
    """(device bytes, host bytes) one KVStore slot reserves on the CUDA backend with a host value store, from the
    layout in cuda/backend/cuda_backend.cpp (layer_sizes) — an estimate to start the search."""
    chunk, rank = kw["chunk_size"], kw["rank"]
    width = cfg.num_kv_heads * cfg.head_dim
    factor = {"float32": 4, "bfloat16": 2}.get(kw.get("factor_dtype"), 4 if e == 4 else 2)  # "auto": bf16 for 16-bit
    chunks = max_len // chunk
    tokens = chunks * chunk
    local_cap = (kw["local_chunks"] + 1) * chunk - 1
    device = (rank * width * factor + tokens * rank * factor + tokens * 8 + chunks * width * e + cfg.num_kv_heads * chunks
              + 2 * kw["outlier_chunks"] * chunk * width * e + 2 * (local_cap + kw["generation_window"]) * width * e
              + (local_cap + kw["generation_window"]) * 8 + cfg.num_kv_heads * (kw["budget"] // chunk) * 4
              + cfg.num_kv_heads * chunks * 4 + 2 * kw["budget"] * width * e)
    host = tokens * width * e
    return float(device * cfg.num_layers), float(host * cfg.num_layers)


# ----------------------------------------------------------------------------------------------------------------------
# capacity
# ----------------------------------------------------------------------------------------------------------------------

def search_capacity(make, start: int, upper: int, label: str, free=gc.collect):
    """make(cap) -> cache or None (did not fit). Halve from `start` until one fits, then look between the largest
    fit and the smallest failure (binary search), or above a fit with doubling steps while no failure is known."""
    attempts = []

    def attempt(cap):
        t0 = time.perf_counter()
        obj, why = make(cap)
        attempts.append({"max_batch": cap, "fits": obj is not None, "why_not": why,
                         "seconds": round(time.perf_counter() - t0, 2)})
        log(f"  [{label}] cap {cap}: " + ("fits" if obj is not None else f"does not fit ({why})")
            + f"  ({attempts[-1]['seconds']} s)")
        return obj

    ok, obj, bad = 0, None, upper + 1
    cap = max(1, min(start, upper))
    while cap >= 1:
        obj = attempt(cap)
        if obj is not None:
            ok = cap
            break
        bad, cap = cap, cap // 2
    if ok == 0:
        return 0, None, attempts
    step = 1
    while ok + 1 < bad:
        cap = (ok + bad) // 2 if bad <= upper else min(ok + step, upper)
        obj = None
        free()  # the previous fit goes before the next one is built
        trial = attempt(cap)
        if trial is not None:
            ok, obj, step = cap, trial, step * 2
        else:
            bad = cap
    while obj is None and ok >= 1:  # the last trial failed: rebuild the largest fit
        free()
        obj = attempt(ok)
        if obj is None:
            ok -= 1
    return ok, obj, attempts


# ----------------------------------------------------------------------------------------------------------------------
# one method at one context length
# ----------------------------------------------------------------------------------------------------------------------

def sweep_batches(max_batch: int, explicit) -> list:
    if explicit:
        points = {b for b in explicit if 1 <= b <= max_batch}
    else:
        points = {1 << i for i in range(int(math.log2(max_batch)) + 1)} if max_batch >= 1 else set()
    points.add(max_batch)
    return sorted((p for p in points if p >= 1), reverse=True)


def store_kwargs(args) -> dict:
    kw = dict(rank=args.rank, budget=args.budget, chunk_size=args.chunk_size, outlier_chunks=args.outlier_chunks,
              local_chunks=args.local_chunks, generation_window=args.generation_window)
    # passed only when asked for, so that builds whose KVStore does not know them still run the default
    if args.value_store is not None:
        kw["value_store"] = args.value_store
    if args.device_value_budget_gib is not None:
        kw["device_value_budget"] = int(args.device_value_budget_gib * GiB)
    if args.factor_dtype is not None:
        kw["factor_dtype"] = args.factor_dtype
    return kw


def run_method(method: str, model, dev: Device, args, seq_len: int, prompt: torch.Tensor, deadline: float) -> dict:
    cfg, e = model.config, model.dtype.itemsize
    points_max = len(sweep_batches(max(args.max_batch or 1024, args.store_max_batch), None)) + 1
    max_len = seq_len + points_max * (args.warmup + args.steps + args.split_steps) + 16
    max_len = -(-max_len // args.chunk_size) * args.chunk_size
    skw = store_kwargs(args)
    if method == "store_fp8":
        skw["value_dtype"] = "float8_e4m3"
    activation = prefill_activation_bytes(cfg, seq_len, args.prefill_chunk, e)
    if method != "full":
        activation += store_prefill_temporaries(cfg, seq_len, e)
    reserve = args.reserve_gib * GiB if args.reserve_gib is not None else activation + 0.25 * GiB
    host_reserve = args.host_reserve_gib * GiB
    label = "full attention, bf16 KV cache" if method == "full" else (
        f"KVStore rank {skw['rank']}, budget {skw['budget']}, values: {skw.get('value_store', 'build default')}"
        + (" fp8" if skw.get("value_dtype") else "") + f", factors {skw.get('factor_dtype', 'auto')}"
        + (f" ({args.device_value_budget_gib:g} GiB on device)" if args.device_value_budget_gib is not None else ""))
    result = {"method": method, "label": label, "max_len": max_len, "reserve_bytes": int(reserve),
              "prefill_activation_estimate_bytes": int(activation), "host_reserve_bytes": int(host_reserve)}
    dev.free()
    log(f"[{method}] S={seq_len}: capacity search (device reserve {reserve / GiB:.2f} GiB for a prefill's "
        f"activations, host reserve {host_reserve / GiB:.1f} GiB; max_len {max_len})")

    def fits_after_build(cache=None, cap=None):
        if not dev.probe(reserve):
            return f"{reserve / GiB:.2f} GiB for a prefill not left on the device"
        if dev.cuda and host_available() < host_reserve:
            return f"host MemAvailable {host_available() / GiB:.1f} GiB < reserve"
        store = getattr(cache, "store", None)
        if dev.cuda and store is not None and cap is not None:
            # A sequence's value store is reserved when it joins, on the device while the store's budget lasts,
            # else pinned on the host: `cap` sequences need room for their values in one of the two (the fill
            # then finds the real capacity by adding sequences until one does not fit).
            seq = store.value_bytes_per_sequence
            on_device = store.device_value_budget // seq if skw.get("value_store") in ("auto", "device") else 0
            on_host = max(0, int((host_available() - host_reserve) // seq))
            if skw.get("value_store") == "device":
                on_host = 0
            if on_device + on_host < cap:
                return (f"values of {cap} sequences ({seq / GiB:.1f} GiB each) fit in neither memory: "
                        f"{on_device} on the device budget, {on_host} on the host")
        return None

    def builder(build):
        def make(cap):
            why = None
            try:
                cache = build(cap)
            except (TypeError, ValueError) as exc:  # e.g. value_store / device_value_budget unknown to this build
                raise SystemExit(f"{method}: the cache rejects its arguments ({skw}): {exc}") from exc
            except Exception as exc:  # noqa: BLE001
                if not is_oom(exc):
                    raise
                why = f"{type(exc).__name__} building the cache: {str(exc)[:160]}"
            if why:  # freed outside the except block: its traceback holds the half-built cache
                dev.free()
                return None, why
            why = fits_after_build(cache, cap)
            if why:
                del cache
                dev.free()
                return None, why
            return cache, None
        return make

    if method == "full":
        per_seq = cfg.kv_bytes_per_token(e) * max_len
        upper = args.max_batch or 1024
        start = int((dev.free_bytes() - reserve) // per_seq) if dev.cuda and args.estimate else upper
        result["bytes_per_sequence_estimate"] = int(per_seq)
        make = builder(lambda cap: L.FullAttentionCache(cfg, cap, max_len, model.device, model.dtype))
    else:
        upper = min(args.store_max_batch, args.max_batch or args.store_max_batch)
        start = upper
        if dev.cuda and args.estimate and args.value_store in (None, "host") and method == "store":
            dev_b, host_b = store_bytes_per_sequence(cfg, max_len, skw, e)
            host_bound = int((host_available() - host_reserve) // host_b)
            result["bytes_per_sequence_estimate"] = {"device": int(dev_b), "host": int(host_b)}
            result["host_bound"] = host_bound
            # Each slot pins its values' bytes when the store is built: more slots than the host reserve allows
            # cannot pass the host check, so they are not tried (pinning ~100 GB takes a while).
            upper = max(1, min(upper, host_bound))
            start = max(1, min(upper, int((dev.free_bytes() - reserve) // dev_b)))
        make = builder(lambda cap: L.ShadowKVCache(model, max_batch=cap, max_seq_len=max_len, **skw))

    attempts = []
    while True:
        cap, inner, tried = search_capacity(make, start, upper, method, free=dev.free)
        attempts += tried
        if inner is None:
            result.update(capacity_search=attempts, error="no batch fits", max_batch=0)
            return result
        cache = Instrumented(inner, Spans(dev))
        fill = fill_sequences(model, cache, cap, seq_len, prompt, args, dev, reserve, host_reserve, deadline, method)
        if fill["first_prefill_oom"] and cap > 1:
            # the cache leaves no room for a real prefill: that cap does not fit either
            attempts.append({"max_batch": cap, "fits": False, "why_not": fill["stop_reason"], "seconds": None})
            del cache, inner, fill
            dev.free()
            start = upper = cap - 1
            continue
        break
    spans, store = cache.spans, getattr(inner, "store", None)
    slots, real, replayed, record = fill["slots"], fill["real"], fill["replayed"], fill["record"]
    n = len(slots)
    stop_reason = fill["stop_reason"]
    if n == cap and cap == upper:  # the first try at the ceiling fitted: larger batches were never tried
        stop_reason = (f"all {cap} slots filled at the search's upper bound ({'--store-max-batch' if method != 'full' else '--max-batch'}"
                       f" {upper}): larger batches were not tried")
    result.update(capacity_search=attempts, max_batch=n, cache_max_batch=cap, stop_reason=stop_reason,
                  capped=n == cap and cap == upper)
    if "prefill_peak_activation_bytes" in fill:
        result["prefill_peak_activation_bytes"] = fill["prefill_peak_activation_bytes"]
    if store is not None:
        result["store"] = {"repr": repr(store), "kwargs": skw}
    result["prefill"] = {
        "real": real,
        "replayed_from_record": {"count": len(replayed), "mean_s": sum(replayed) / len(replayed) if replayed else None,
                                 "record_where": record.where if record else None,
                                 "record_bytes": record.nbytes() if record else 0,
                                 "record_failed": record.failed if record else None},
    }
    result["prefill_s"] = sum(r["seconds"] for r in real) / len(real) if real else None
    share = sum(r["inside_cache_s"] for r in real) / max(sum(r["seconds"] for r in real), 1e-12) if real else None
    result["compression_share"] = share if store is not None else None
    result["cache_write_share"] = share if store is None else None
    if store is not None:
        result["compression_share_note"] = ("time inside store.prefill calls (CUDA events around each call) / "
                                            "the whole prefill of the sequence (model + store)")
    del record, fill  # the record is not needed any more: give its memory back before decoding
    dev.free()
    result["memory"] = memory_snapshot(dev, store, model, inner)
    if n == 0:
        result["error"] = "no sequence could be added"
        return result
    result["sweep"] = decode_sweep(model, cache, slots, args, dev, deadline, method, result)
    top = [r for r in result["sweep"] if r["batch"] == n and "tokens_per_s" in r]
    result["tokens_per_s"] = top[0]["tokens_per_s"] if top else None
    for s in slots:
        cache.release(s)
    return result


def fill_sequences(model, cache: Instrumented, cap, seq_len, prompt, args, dev, reserve, host_reserve, deadline,
                   method) -> dict:
    """Adds sequences one at a time until `cap` or out of memory: the first `--real-prefills` through the model
    (timed; the first one recorded when --reuse-prefill and memory allow), the others from the record."""
    cfg, e = model.config, model.dtype.itemsize
    record_bytes = cfg.num_layers * (2 * seq_len * cfg.num_kv_heads + cfg.num_q_heads) * cfg.head_dim * e
    where = None
    if args.reuse_prefill:
        where = args.record_where
        if where == "auto":
            dev.free()
            if dev.cuda and dev.free_bytes() - reserve - record_bytes >= 0.5 * GiB:
                where = "device"
            elif host_available() - host_reserve >= record_bytes:
                where = "host"
            else:
                where = None
    spans, store = cache.spans, getattr(cache.inner, "store", None)
    out = {"slots": [], "real": [], "replayed": [], "record": None, "stop_reason": None, "first_prefill_oom": False}
    slots, real, replayed = out["slots"], out["real"], out["replayed"]
    log(f"[{method}] cache built for {cap} sequences; filling one at a time; prefill record: "
        f"{where or 'none'} ({record_bytes / GiB:.2f} GiB)")
    base = torch.cuda.memory_allocated() if dev.cuda else 0
    if dev.cuda:
        torch.cuda.reset_peak_memory_stats()
    record = None
    for i in range(cap):
        if time.perf_counter() > deadline:
            out["stop_reason"] = f"deadline reached after {i} sequences"
            break
        t_fill = time.perf_counter()
        if store is not None and dev.cuda:
            # The next sequence pins its values on the host unless the device budget still holds them: stop
            # before pinning into the host's reserve (pinned pages cannot be reclaimed).
            seq = store.value_bytes_per_sequence
            on_device = sum(store.sequence_info(0, s)["values_on"] == "device" for s in slots)
            next_on_device = (store.config["value_store"] == "device" or
                              (store.config["value_store"] == "auto" and
                               (on_device + 1) * seq <= store.device_value_budget))
            if not next_on_device and host_available() - seq < host_reserve:
                out["stop_reason"] = (f"host memory: {host_available() / GiB:.1f} GiB available, the next sequence's "
                                      f"values need {seq / GiB:.1f} GiB pinned and {host_reserve / GiB:.0f} GiB "
                                      f"stay in reserve")
                log(f"[{method}] {out['stop_reason']}")
                break
        try:
            if record is not None and record.complete(cfg.num_layers) and len(real) >= args.real_prefills:
                dev.sync()
                t0 = time.perf_counter()
                slot = prefill_from_record(model, cache, record)
                dev.sync()
                replayed.append(time.perf_counter() - t0)
                what = f"filled from the record in {replayed[-1]:.2f} s"
            else:
                if where and record is None:
                    record = PrefillRecord(where, dev, seq_len)
                    cache.record = record
                spans.reset(on=True)
                dev.sync()
                t0 = time.perf_counter()
                slot, _ = model.prefill(cache, prompt)
                dev.sync()
                total = time.perf_counter() - t0
                copy_s = record.copy_s if cache.record is not None else 0.0
                cache.record = None
                inside = spans.total_s()
                spans.reset(on=False)
                real.append({"seconds": total - copy_s, "inside_cache_s": inside, "record_copy_s": copy_s,
                             "share_inside_cache": inside / max(total - copy_s, 1e-12)})
                if dev.cuda and len(real) == 1:
                    out["prefill_peak_activation_bytes"] = int(torch.cuda.max_memory_allocated() - base)
                what = (f"prefilled through the model in {real[-1]['seconds']:.2f} s "
                        f"({100 * real[-1]['share_inside_cache']:.1f}% inside "
                        f"{'store.prefill' if store is not None else 'cache writes'})")
                if record is not None and record.failed:
                    what += f"; record dropped: {record.failed}"
        except Exception as exc:  # noqa: BLE001
            if cache.record is not None:  # an incomplete record is useless
                record = None
            cache.record = None
            spans.reset(on=False)
            if not is_oom(exc):
                raise
            out["stop_reason"] = f"out of memory adding sequence {i + 1}: {type(exc).__name__}: {str(exc)[:160]}"
            out["first_prefill_oom"] = not real
        if out["stop_reason"]:  # freed outside the except block: its traceback holds the prefill's activations
            log(f"[{method}] {out['stop_reason']}")
            dev.free()
            break
        slots.append(slot)
        log(f"[{method}] sequence {len(slots)}/{cap} (slot {slot}): {what}  [{time.perf_counter() - t_fill:.1f} s]")
    else:
        out["stop_reason"] = f"all {cap} slots of the cache filled (the largest cache that fits, see capacity_search)"
    out["record"] = record
    return out


def decode_sweep(model, cache: Instrumented, slots, args, dev, deadline, method, result) -> list:
    """Decode at the largest batch and below, largest first; every sequence starts from a different token."""
    cfg, n = model.config, len(slots)
    spans, store = cache.spans, getattr(cache.inner, "store", None)
    next_tok = torch.tensor([(11 + 7919 * i) % cfg.vocab_size for i in range(n)], device=model.device)
    rows = []
    for b in sweep_batches(n, args.batches):
        if time.perf_counter() > deadline:
            rows.append({"batch": b, "skipped": "deadline"})
            continue
        sl = slots[:b]
        try:
            tok = next_tok[:b]
            for _ in range(args.warmup):
                tok = model.decode_step(cache, sl, tok).argmax(-1)
            if store is not None:
                store.reset_stats()
            dev.sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tok = model.decode_step(cache, sl, tok).argmax(-1)
            dev.sync()
            wall = time.perf_counter() - t0
            hit = store.stats()["hit_rate"] if store is not None else None
            spans.reset(on=True)
            dev.sync()
            t0 = time.perf_counter()
            for _ in range(args.split_steps):
                tok = model.decode_step(cache, sl, tok).argmax(-1)
            dev.sync()
            wall_split = time.perf_counter() - t0
            attention = spans.total_s()
            spans.reset(on=False)
            next_tok[:b] = tok
            split = max(args.split_steps, 1)
            row = {"batch": b, "tokens_per_s": b * args.steps / wall, "step_ms": 1e3 * wall / args.steps,
                   "attention_ms": 1e3 * attention / split, "rest_ms": 1e3 * (wall_split - attention) / split,
                   "instrumented_step_ms": 1e3 * wall_split / split, "hit_rate": hit,
                   "distinct_next_tokens": int(torch.unique(tok).numel())}
            if b == n:
                result["memory_after_decode"] = memory_snapshot(dev, store, model, cache.inner)
        except Exception as exc:  # noqa: BLE001
            spans.reset(on=False)
            if not is_oom(exc):
                raise
            row = {"batch": b, "error": f"out of memory: {str(exc)[:160]}"}
        if "error" in row:
            dev.free()
        rows.append(row)
        if "tokens_per_s" in row:
            hit_text = f", hit {row['hit_rate']:.2f}" if row["hit_rate"] is not None else ""
            log(f"[{method}] B={b}: {row['tokens_per_s']:.1f} tok/s, step {row['step_ms']:.2f} ms "
                f"(instrumented: attention {row['attention_ms']:.2f} + rest {row['rest_ms']:.2f} ms){hit_text}")
        else:
            log(f"[{method}] B={b}: {row}")
    return sorted(rows, key=lambda r: r["batch"])


def memory_snapshot(dev: Device, store, model, inner) -> dict:
    snap = {"weights_bytes": int(sum(t.numel() * t.element_size() for t in weight_tensors(model)))}
    if dev.cuda:
        free, total = torch.cuda.mem_get_info()
        snap.update(device_total_bytes=int(total), device_used_bytes=int(total - free),
                    torch_allocated_bytes=int(torch.cuda.memory_allocated()),
                    torch_reserved_bytes=int(torch.cuda.memory_reserved()))
    if isinstance(inner, L.FullAttentionCache):
        snap["kv_cache_bytes"] = int(sum(t.numel() * t.element_size() for t in inner.keys + inner.values))
    if store is not None:
        report = dict(store.memory_report())
        snap["store_report"] = report
        host_keys = {k: v for k, v in report.items() if "host" in k or "pinned" in k}
        if host_keys:
            snap["pinned_host_bytes"] = host_keys
        else:
            snap["pinned_host_bytes_note"] = ("memory_report has no host fields in this build; the host value store "
                                              "holds store_report['value_store'] bytes (in use, not reserved)")
    info = host_meminfo()
    snap.update(host_total_bytes=info.get("MemTotal"), host_available_bytes=info.get("MemAvailable"),
                process_rss_bytes=process_rss())
    return snap


def weight_tensors(model):
    out = [model.embed, model.final_norm, model.lm_head]
    for w in model.layers:
        out += [w.input_norm, w.qkv, w.o, w.post_norm, w.gate_up, w.down]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------------

def git_commit() -> str:
    if os.environ.get("COMMIT"):  # set by bench/e2e_gpu.sh: the tree on a GPU machine may be a copy without .git
        return os.environ["COMMIT"]
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_table(results: dict) -> None:
    log("\n| S | method | largest batch | tok/s there | step ms | attention ms | rest ms | hit | prefill s | "
        "store share of prefill | stopped because |")
    log("| --- " * 11 + "|")
    for run in results["runs"]:
        for name, m in run["methods"].items():
            top = [r for r in m.get("sweep", []) if r.get("batch") == m.get("max_batch") and "tokens_per_s" in r]
            r = top[0] if top else {}

            def f(x, fmt):
                return format(x, fmt) if isinstance(x, (int, float)) else "-"

            share = m.get("compression_share")
            log(f"| {run['seq_len']} | {name} | {m.get('max_batch', '-')} | {f(r.get('tokens_per_s'), '.1f')} | "
                f"{f(r.get('step_ms'), '.2f')} | {f(r.get('attention_ms'), '.2f')} | {f(r.get('rest_ms'), '.2f')} | "
                f"{f(r.get('hit_rate'), '.2f')} | {f(m.get('prefill_s'), '.2f')} | "
                f"{f(100 * share, '.1f') + '%' if isinstance(share, float) else '-'} | "
                f"{(m.get('stop_reason') or m.get('error') or '')[:60]} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short context, small caps")
    p.add_argument("--device", default="auto")
    p.add_argument("--methods", nargs="+", default=["full", "store"], choices=["full", "store", "store_fp8"],
                   help="store_fp8: the store with fp8 values (value_dtype='float8_e4m3')")
    p.add_argument("--seq-len", nargs="+", type=int, help="context lengths (default 122880; --tiny: 512)")
    p.add_argument("--max-batch", type=int, help="cap on the batch of every method (default: none; --tiny: 4)")
    p.add_argument("--store-max-batch", type=int, default=64, help="the largest store batch the capacity search tries (it reserves at build)")
    p.add_argument("--batches", nargs="+", type=int, help="sweep batches (default: powers of two + the largest)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--split-steps", type=int, default=8, help="extra steps with events around attention calls")
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--reuse-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--record-where", choices=["auto", "device", "host"], default="auto")
    p.add_argument("--real-prefills", type=int, default=1, help="sequences prefilled through the model per method")
    p.add_argument("--estimate", action=argparse.BooleanOptionalAction, default=True,
                   help="start the capacity searches from byte estimates (--no-estimate: halve from the caps)")
    p.add_argument("--reserve-gib", type=float, help="device memory kept free for activations (default: estimate)")
    p.add_argument("--host-reserve-gib", type=float, default=12.0, help="host memory that must stay available")
    p.add_argument("--value-store", choices=["host", "device", "auto"], help="KVStore value_store (default: build's)")
    p.add_argument("--factor-dtype", choices=["auto", "float32", "bfloat16"],
                   help="KVStore factor_dtype (default: the store's, bf16 factors for a bf16 model)")
    p.add_argument("--device-value-budget-gib", type=float, help="KVStore device_value_budget in GiB")
    p.add_argument("--rank", type=int, default=160)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outlier-chunks", type=int, default=48)
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--generation-window", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=0, help="soft time limit: skip what would start after it")
    p.add_argument("--json", help="result file (default bench/results/<date>-<commit>-e2e.json; --tiny: none)")
    p.add_argument("--plot", help="tokens/s vs batch PNG")
    args = p.parse_args(argv)

    started = time.perf_counter()
    deadline = started + args.deadline_s if args.deadline_s > 0 else float("inf")
    device = args.device
    if device == "auto":
        device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda:0"
    dev = Device(device)
    if args.tiny:
        # a smoke test: one thread, as the tests do (torch's threads on a few shared cores mostly wait on each other)
        torch.set_num_threads(1)
        cfg = L.LlamaConfig.tiny(num_layers=2)
        args.seq_len = args.seq_len or [512]
        args.max_batch = args.max_batch or 4
        args.store_max_batch = min(args.store_max_batch, 4)
        args.rank = min(args.rank, cfg.num_kv_heads * cfg.head_dim // 2)
        args.budget, args.outlier_chunks, args.local_chunks = min(args.budget, 64), min(args.outlier_chunks, 2), 1
        args.generation_window = min(args.generation_window, 32)
        args.prefill_chunk = min(args.prefill_chunk, 128)
    else:
        cfg = L.LlamaConfig()
        args.seq_len = args.seq_len or [122880]
    dtype = torch.bfloat16 if dev.cuda else torch.float32
    if any(m.startswith("store") for m in args.methods):
        from shadowkv_core import build_info

        info = build_info()
        if dev.cuda and not (info.get("cuda_backend") and info.get("cuda_devices", 0) > 0):
            raise SystemExit(f"the store needs a CUDA build of shadowkv_core on {device}; build_info: {info}")
    else:
        info = None
    commit = git_commit()
    gpu = dev.name_of_gpu()
    json_path = args.json
    if json_path is None and not args.tiny:
        json_path = os.path.join(HERE, "results", f"{time.strftime('%Y-%m-%d', time.gmtime())}-{commit}-e2e.json")

    log(f"e2e benchmark: {gpu}, commit {commit}, {cfg.num_parameters() / 1e9:.2f}B parameters ({dtype}), "
        f"methods {args.methods}, contexts {args.seq_len}")
    t0 = time.perf_counter()
    model = L.LlamaModel(cfg, device, dtype, seed=args.seed, prefill_chunk=args.prefill_chunk)
    dev.sync()
    log(f"model built in {time.perf_counter() - t0:.1f} s")

    results = {"gpu": gpu, "commit": commit, "runs": []}
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            old = json.load(f)
        if isinstance(old, dict) and isinstance(old.get("runs"), list):
            results["runs"] = old["runs"]
            log(f"appending to {json_path} ({len(old['runs'])} earlier runs)")

    def save():
        if json_path:
            os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1)

    for seq_len in args.seq_len:
        g = torch.Generator().manual_seed(args.seed + seq_len)
        prompt = torch.randint(0, cfg.vocab_size, (seq_len,), generator=g)
        run = {"gpu": gpu, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seq_len": seq_len,
               "model": {"config": vars(cfg).copy(), "dtype": str(dtype), "parameters": cfg.num_parameters()},
               "args": {k: v for k, v in vars(args).items()}, "build_info": info, "methods": {}}
        results["runs"].append(run)
        for method in args.methods:
            t_method = time.perf_counter()
            run["methods"][method] = run_method(method, model, dev, args, seq_len, prompt, deadline)
            run["methods"][method]["wall_s"] = round(time.perf_counter() - t_method, 1)
            dev.free()
            save()
        run["notes"] = notes(run, args)
        save()
    if json_path:
        log(f"wrote {json_path}")
    if args.plot:
        sys.path.insert(0, HERE)
        from plot_e2e import plot

        this = {"commit": commit, "runs": results["runs"][-len(args.seq_len):]}
        log(f"wrote {plot(this, args.plot)}")
    log(f"total {time.perf_counter() - started:.1f} s")
    print_table({"runs": results["runs"][-len(args.seq_len):]})
    return 0


def notes(run: dict, args) -> str:
    parts = [f"Random-weight Llama-family model ({run['model']['parameters'] / 1e9:.2f}B parameters, "
             f"{run['model']['dtype']}), built once and shared by the methods; one random prompt of "
             f"{run['seq_len']} tokens used by every sequence; each sequence decodes greedily from a different first "
             f"token. Decode: {args.warmup} warm-up + {args.steps} timed steps per batch (tokens/s, step_ms), then "
             f"{args.split_steps} steps with CUDA events around every attention call (attention_ms / rest_ms)."]
    for name, m in run["methods"].items():
        pre = m.get("prefill", {})
        rep = pre.get("replayed_from_record", {})
        text = (f"{name}: largest batch {m.get('max_batch')} ({m.get('stop_reason') or m.get('error')}); "
                f"{len(pre.get('real', []))} sequence(s) prefilled through the model (prefill_s is their mean)")
        if rep.get("count"):
            text += (f", {rep['count']} filled from a record of the first one's per-layer pre-RoPE K, V and last "
                     f"query kept on the {rep['record_where']} ({rep['record_bytes'] / GiB:.1f} GiB; no model "
                     f"forward for those, {rep['mean_s']:.2f} s each)")
        parts.append(text + ".")
    parts.append("Hit rates of a random-weight model are not those of a trained one.")
    return " ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
