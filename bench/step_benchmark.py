"""One layer's decode step through the store, next to full attention and the byte floor, measured in one run.

    python bench/step_benchmark.py                 # docs/performance.md configurations on CUDA, small ones on the CPU
    python bench/step_benchmark.py --config 1x122880x2048 8x122880x2048:device --hit 0 0.6 --json out.json

A configuration is BATCHxSEQ_LENxBUDGET, optionally followed by :host (values in pinned host memory, the default),
:device (values in device memory, value_store="device"), :host_fp8 or :device_fp8 (fp8 values: e4m3 codes and a
float32 scale per chunk and head, half the bytes), and optionally by +f32 (float32 low-rank factors instead of the
default bfloat16 ones, e.g. 24x122880x2048:host+f32), +pN (decode_pipeline_parts=N; +p1: no pipelining), +cN (a
value fetch across PCIe of N CTAs: SHADOWKV_FETCH_CTAS, instead of the backend's choice), +max
(group_score="max" instead of the default mean), +kN (a selection cache of N times the budget:
cache_tokens = N * BUDGET, e.g. 24x122880x2048:host+k2; each result records its cache_tokens, 0 = the budget) and/or
+tc (chunk_score="two_centroids": chunks scored by two fp8 centroids instead of the landmark) and/or +lyN (a store of N layers,
each with its own random context, and every step decodes all N in order, as a model does: the times are per layer,
the step's divided by N. One layer's landmarks at B = 1 and S = 122880 are 31.5 MB, less than the H200's L2, so a
one-layer step may find them there from the step before, which a model's next layer cannot).

For each configuration (batch B, context S, budget) and target temporal hit rate it reports:
  ours        mean time of store.decode for one layer (selection, rebuild, fetch, attention), B sequences (with +lyN:
              a step of N layers' decodes, divided by N)
  full        PyTorch SDPA over the whole KV cache of the same B sequences, same device, same dtype
  floor       landmark bytes at the measured memory bandwidth + missed value bytes at the measured host->device
              bandwidth (both measured here, now); with device values both at the memory bandwidth; on the CPU both
              terms use the host copy bandwidth
and the ratios ours/full and ours/floor. The hit rate is steered by correlating consecutive queries
(q_t = a·q_{t-1} + sqrt(1-a²)·noise, `a` found by bisection) and the hit rate actually measured is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

import torch

from shadowkv_core import KVStore, build_info


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _measure_bandwidths(device: str) -> tuple[float, float]:
    """(memory copy bandwidth counting read+write, host->device bandwidth) in bytes/s."""
    nbytes = (1 << 30) if device.startswith("cuda") else (1 << 27)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps = 10
    started = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    memory = 2 * nbytes * reps / (time.perf_counter() - started)
    if not device.startswith("cuda"):
        return memory, memory
    host = torch.empty(nbytes // 4, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes // 4, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    _sync(device)
    started = time.perf_counter()
    for _ in range(reps):
        target.copy_(host, non_blocking=True)
    _sync(device)
    link = (nbytes // 4) * reps / (time.perf_counter() - started)
    return memory, link


def _time(fn, device: str, reps: int) -> float:
    fn()
    _sync(device)
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - started) / reps


@contextlib.contextmanager
def _environment(variables):
    """Sets each name of `variables` to its value (None: removes it) for the duration, then restores the caller's."""
    saved = {name: os.environ.get(name) for name in variables}
    try:
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _AllLayers:
    """Stands in for the store in the timing helpers, which decode layer 0: each decode runs every layer of the store
    in order with the same inputs, as one model step does (+lyN)."""

    def __init__(self, store, layers: int):
        self.store, self.layers = store, layers

    def decode(self, _layer, slots, q, k_new, v_new):
        for layer in range(self.layers):
            self.store.decode(layer, slots, q, k_new, v_new)

    def account_replayed_steps(self, _layer, slots, steps):
        for layer in range(self.layers):
            self.store.account_replayed_steps(layer, slots, steps)

    def reset_stats(self):
        self.store.reset_stats()

    def stats(self):
        return self.store.stats()


def run_case(args, device, batch, seq_len, budget, value_store, target_hit, bandwidths):
    dtype = torch.bfloat16
    hq, hkv, dim, chunk = args.q_heads, args.kv_heads, args.head_dim, 8
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    # The long random contexts are made on the device itself (host randn of B x 122880 x 1024 takes minutes).
    data_gen = torch.Generator(device=device).manual_seed(args.seed) if device.startswith("cuda") else gen
    capacity = seq_len + 4 * args.steps + 64
    values_on, *options = value_store.split("+")
    place, _, fp8 = values_on.partition("_")
    parts = next((int(o[1:]) for o in options if o.startswith("p") and o[1:].isdigit()), 0)
    fetch_ctas = next((o[1:] for o in options if o.startswith("c") and o[1:].isdigit()), None)
    cache_multiple = next((int(o[1:]) for o in options if o.startswith("k")), 0)
    layers = next((int(o[2:]) for o in options if o.startswith("ly") and o[2:].isdigit()), 1)
    cache_tokens = cache_multiple * budget  # 0: the default cache of exactly the budget
    # The one environment variable of the CUDA backend (read when it is constructed): set for this row, or removed (the
    # backend's choice) when the row does not name it, whatever the caller's environment says.
    knobs = {"SHADOWKV_FETCH_CTAS": fetch_ctas}
    with _environment(knobs):
        store = KVStore(layers, hq, hkv, dim, max_batch=batch, max_seq_len=capacity, rank=args.rank, chunk_size=chunk,
                        budget=budget, outlier_chunks=48, local_chunks=4, generation_window=256, dtype="bfloat16",
                        device=device, rope_theta=500000.0, value_store=place,
                        value_dtype="float8_e4m3" if fp8 else None,
                        factor_dtype="float32" if "f32" in options else None, decode_pipeline_parts=parts,
                        group_score="max" if "max" in options else "mean", cache_tokens=cache_tokens,
                        chunk_score="two_centroids" if "tc" in options else "landmark")
    slots = store.add_sequences(batch)
    keys_full, values_full = [], []
    for b in range(batch):  # one sequence at a time bounds host memory for the random data
        def randn(*shape):
            return torch.randn(*shape, generator=data_gen, device=data_gen.device)

        for layer in range(layers):  # full attention below reads layer 0's
            basis = randn(32, hkv * dim)
            keys = randn(seq_len, 32) @ basis + 0.3 * randn(seq_len, hkv * dim)
            keys = keys.reshape(1, seq_len, hkv, dim).to(device, dtype)
            values = randn(1, seq_len, hkv, dim).to(device, dtype)
            store.prefill(layer, [slots[b]], keys, values, keys_post_rope=True)
            if layer == 0:
                keys_full.append(keys[0].transpose(0, 1))
                values_full.append(values[0].transpose(0, 1))
            del keys, values
    keys_full = torch.stack(keys_full)  # [B, Hkv, S, D]
    values_full = torch.stack(values_full)
    scale = 1.0 / math.sqrt(dim)

    state = {"q": torch.randn(batch, hq, dim, generator=gen)}

    def next_query(a):
        noise = torch.randn(batch, hq, dim, generator=gen)
        state["q"] = a * state["q"] + math.sqrt(max(0.0, 1.0 - a * a)) * noise
        return (state["q"] * 2.0).to(device, dtype)

    k_new = torch.randn(batch, hkv, dim, generator=gen).to(device, dtype)
    v_new = torch.randn(batch, hkv, dim, generator=gen).to(device, dtype)

    model_store = store
    store = _AllLayers(store, layers) if layers > 1 else store

    def measured_hit(a, steps):
        store.reset_stats()
        for _ in range(steps):
            store.decode(0, slots, next_query(a), k_new, v_new)
        return store.stats()["hit_rate"]

    # Steer the hit rate: bisection on the query correlation `a`.
    a = 0.0
    if target_hit > 0:
        lo, hi = 0.0, 1.0
        for _ in range(args.calibration_rounds):
            a = 0.5 * (lo + hi)
            if measured_hit(a, 3) < target_hit:
                lo = a
            else:
                hi = a
    queries = [next_query(a) for _ in range(args.steps)]
    store.decode(0, slots, next_query(a), k_new, v_new)  # warm-up: the first call of a process loads the kernels
    store.reset_stats()
    _sync(device)
    started = time.perf_counter()
    for q in queries:
        store.decode(0, slots, q, k_new, v_new)
    _sync(device)
    ours = (time.perf_counter() - started) / args.steps / layers
    hit = store.stats()["hit_rate"]
    ours_graph = _graph_step_time(store, slots, queries, k_new, v_new) / layers if device.startswith("cuda") else None
    ours_graph_steps = (_graph_steps_time(store, slots, queries, k_new, v_new, args.graph_steps, args.query_write) /
                        layers if args.graph_steps > 0 and device.startswith("cuda") else None)
    kernels, timeline = (_kernel_profile(store, slots, queries, k_new, v_new)
                         if (args.profile or args.timeline) and device.startswith("cuda") else (None, None))
    if kernels is not None:
        kernels = {name: us / layers for name, us in kernels.items()}
    graph_timeline = (_graph_timeline(store, slots, queries, k_new, v_new)
                      if args.graph_timeline and device.startswith("cuda") else None)
    steps_timeline = (_graph_steps_timeline(store, slots, queries, k_new, v_new, args.graph_steps, args.query_write)
                      if args.graph_steps_timeline and args.graph_steps > 1 and device.startswith("cuda") else None)

    q_full = queries[-1][:, :, None, :]
    full = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
        q_full, keys_full, values_full, scale=scale, enable_gqa=True), device, args.steps)

    memory_bw, link_bw = bandwidths
    # Bytes a selection reads per chunk and head: a bf16 landmark, or two fp8 centroids + 2 scales + a count.
    landmark_bytes = batch * (seq_len // chunk) * hkv * ((2 * dim + 9) if "tc" in options else dim * 2)
    run_bytes = chunk * dim + 4 if values_on.endswith("_fp8") else chunk * dim * 2
    missed_bytes = batch * (1.0 - hit) * (budget // chunk) * hkv * run_bytes
    floor = landmark_bytes / memory_bw + missed_bytes / (memory_bw if value_store.startswith("device") else link_bw)
    row = {"batch": batch, "seq_len": seq_len, "budget": budget, "value_store": values_on, "options": options,
           "cache_tokens": cache_tokens, "decode_pipeline_parts": parts,
           "fetch_ctas": int(fetch_ctas) if fetch_ctas is not None else None,  # None: the backend's choice
           "factor_dtype": model_store.config["factor_dtype"], "group_score": model_store.config["group_score"],
           "chunk_score": model_store.config["chunk_score"], "layers": layers,
           "target_hit": target_hit, "hit": hit,
           "query_correlation": a, "ours_ms": ours * 1e3, "full_ms": full * 1e3, "floor_ms": floor * 1e3,
           "ours_over_full": ours / full, "ours_over_floor": ours / floor}
    if ours_graph is not None:
        row.update(ours_graph_ms=ours_graph * 1e3, graph_over_full=ours_graph / full, graph_over_floor=ours_graph / floor)
    if ours_graph_steps is not None:
        row.update(graph_steps=args.graph_steps, query_write=args.query_write, ours_graph_steps_ms=ours_graph_steps * 1e3,
                   graph_steps_over_full=ours_graph_steps / full, graph_steps_over_floor=ours_graph_steps / floor)
    if kernels is not None and args.profile:
        row["kernels_us"] = kernels
    if timeline is not None and args.timeline:
        row["timeline_us"] = timeline
    if graph_timeline is not None:
        row["graph_timeline_us"] = graph_timeline
    if steps_timeline is not None:
        row["graph_steps_timeline_us"] = steps_timeline
    return row


def _graph_step_time(store, slots, queries, k_new, v_new) -> float:
    """GPU time of one decode step without the host: the step captured once in a CUDA graph, replayed with each
    query copied into the captured input (the copy is part of the time; it is ~1 µs)."""
    q_static = queries[0].clone()
    store.decode(0, slots, q_static, k_new, v_new)  # eager step first: the slot list is on the GPU
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store.decode(0, slots, q_static, k_new, v_new)
    for q in queries[:2]:  # warm-up replays
        q_static.copy_(q)
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for q in queries:
        q_static.copy_(q)
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    store.account_replayed_steps(0, slots, len(queries) + 2)
    return start.elapsed_time(end) / 1e3 / len(queries)


def _write_query(target, source, how: str) -> None:
    """The step's query into the captured input: "copy" (copy_, a device-to-device memcpy node in a graph) or "kernel"
    (an elementwise kernel writes it, as a model's q projection and RoPE do before the store's first kernel)."""
    if how == "kernel":
        torch.mul(source, 1, out=target)
    else:
        target.copy_(source)


def _capture_steps(store, slots, queries, k_new, v_new, per_graph: int, query_write: str):
    """`per_graph` decode steps captured in one CUDA graph, each after its query's write into the captured input
    (_write_query), after one eager step (so that the slot list is on the GPU) and replayed once to warm up; the
    store counts that replay. Returns the graph and the inputs it reads, which the caller keeps alive while it
    replays."""
    bank = torch.stack(queries[:per_graph])
    q_static = bank[0].clone()
    store.decode(0, slots, q_static, k_new, v_new)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            _write_query(q_static, bank[i], query_write)
            store.decode(0, slots, q_static, k_new, v_new)
    graph.replay()  # warm-up
    torch.cuda.synchronize()
    store.account_replayed_steps(0, slots, per_graph)
    return graph, (bank, q_static)


def _graph_steps_time(store, slots, queries, k_new, v_new, per_graph: int, query_write: str = "copy") -> float:
    """GPU time of one decode step when `per_graph` steps follow each other inside one CUDA graph, each after its
    query's write into the captured input (_write_query): as in a model whose whole decode step is one graph, no graph
    launch and no host between two steps. (_graph_step_time replays a graph of one step: each replay also waits for
    the graph's launch, ~4 µs on the H200 before its first kernel; docs/performance.md; session 20.)"""
    graph, _inputs = _capture_steps(store, slots, queries, k_new, v_new, per_graph, query_write)
    replays = max(1, len(queries) // per_graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    store.account_replayed_steps(0, slots, replays * per_graph)
    return start.elapsed_time(end) / 1e3 / (replays * per_graph)


def _graph_steps_timeline(store, slots, queries, k_new, v_new, per_graph: int, query_write: str):
    """The last two steps of a graph of `per_graph` steps (as _graph_steps_time captures it: each step after its
    query's write), from the last of three profiled replays: [name, stream, start, end] in µs from the start of the
    second-to-last step's query write. Unlike _graph_timeline's one-step graph, no graph launch precedes these steps:
    the gaps between one step's last kernel, the next query's write and its first kernel are a model's. None where
    this torch gives no raw device events, or the steps' events do not divide evenly."""
    from torch.profiler import ProfilerActivity, profile

    graph, _inputs = _capture_steps(store, slots, queries, k_new, v_new, per_graph, query_write)
    replays = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    store.account_replayed_steps(0, slots, replays * per_graph)
    try:
        raw = [e for e in prof.profiler.kineto_results.events() if e.device_type().name == "CUDA"]
        raw.sort(key=lambda e: e.start_ns())
        if len(raw) % (replays * per_graph) != 0:
            print(f"graph steps timeline: {len(raw)} events do not divide into {replays} x {per_graph} steps")
            return None
        last = raw[len(raw) - 2 * len(raw) // (replays * per_graph):]
        origin = last[0].start_ns()
        return [[_short_kernel_name(e.name()), int(e.device_resource_id()), (e.start_ns() - origin) / 1e3,
                 (e.start_ns() + e.duration_ns() - origin) / 1e3] for e in last]
    except (AttributeError, IndexError, ZeroDivisionError) as error:
        print(f"graph steps timeline: not available from this torch ({error})")
        return None


def _graph_timeline(store, slots, queries, k_new, v_new):
    """The last of several graph replays of one step (as _graph_step_time times them) under torch.profiler: its
    kernels and copies in start order, [name, stream, start, end] in µs from the replay's first start (the query's
    copy into the captured input first). None where this torch gives no raw device events."""
    from torch.profiler import ProfilerActivity, profile

    q_static = queries[0].clone()
    store.decode(0, slots, q_static, k_new, v_new)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store.decode(0, slots, q_static, k_new, v_new)
    replays = queries[:6]
    for q in replays[:2]:
        q_static.copy_(q)
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for q in replays:
            q_static.copy_(q)
            graph.replay()
        torch.cuda.synchronize()
    store.account_replayed_steps(0, slots, len(replays) + 2)
    try:
        raw = [e for e in prof.profiler.kineto_results.events() if e.device_type().name == "CUDA"]
        raw.sort(key=lambda e: e.start_ns())
        last = raw[len(raw) - len(raw) // len(replays):]
        origin = last[0].start_ns()
        return [[_short_kernel_name(e.name()), int(e.device_resource_id()), (e.start_ns() - origin) / 1e3,
                 (e.start_ns() + e.duration_ns() - origin) / 1e3] for e in last]
    except (AttributeError, IndexError, ZeroDivisionError) as error:
        print(f"graph timeline: not available from this torch ({error})")
        return None


def _kernel_profile(store, slots, queries, k_new, v_new) -> tuple:
    """Mean device time per step of each CUDA kernel / copy the eager decode launches (torch.profiler, CUPTI), and the
    last step's timeline: its kernels and copies in start order, [name, stream, start, end] in µs from the step's
    first start (the last len(events) / steps device events; every step launches the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for q in queries:
            store.decode(0, slots, q, k_new, v_new)
        torch.cuda.synchronize()
    totals: dict = {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        name = _short_kernel_name(event.name)
        totals[name] = totals.get(name, 0.0) + event.device_time / len(queries)
    timeline = None
    try:  # the raw device events carry their stream; FunctionEvent does not
        raw = [e for e in prof.profiler.kineto_results.events() if e.device_type().name == "CUDA"]
        raw.sort(key=lambda e: e.start_ns())
        last = raw[len(raw) - len(raw) // len(queries):]
        origin = last[0].start_ns()
        timeline = [[_short_kernel_name(e.name()), int(e.device_resource_id()), (e.start_ns() - origin) / 1e3,
                     (e.start_ns() + e.duration_ns() - origin) / 1e3] for e in last]
    except (AttributeError, IndexError, ZeroDivisionError) as error:
        print(f"timeline: not available from this torch ({error})")
    return dict(sorted(totals.items(), key=lambda item: -item[1])), timeline


def _short_kernel_name(full: str) -> str:
    name = full.replace("(anonymous namespace)::", "").replace("shadowkv::cuda::", "").replace("void ", "")
    return name.split("(")[0].split("<")[0][:48] or full[:48]


def _parse_config(text: str) -> tuple:
    """"24x122880x2048", "8x122880x2048:device" or "24x122880x2048:host+f32" -> (batch, seq_len, budget, value_store
    with the optional +f32 of float32 factors)."""
    shape, _, value_store = text.partition(":")
    batch, seq_len, budget = (int(x) for x in shape.split("x"))
    place, *options = value_store.split("+")
    if place not in ("", "host", "device", "host_fp8", "device_fp8") or not all(
            o in ("f32", "max", "tc") or (o[:1] in ("p", "c", "k") and o[1:].isdigit())
            or (o[:2] == "ly" and o[2:].isdigit() and int(o[2:]) >= 1)
            for o in options) or any(o[:1] == "k" and int(o[1:]) < 1 for o in options):
        raise SystemExit(f"--config {text}: the value store must be :host, :device, :host_fp8 or :device_fp8, "
                         f"optionally followed by +f32 (float32 factors), +pN (pipeline parts), +max (group_score max), +tc "
                         f"(two-centroid chunk scores), +cN (value fetch CTAs across PCIe), +kN (a selection cache of "
                         f"N >= 1 times the budget) and/or +lyN (N >= 1 layers a step)")
    return batch, seq_len, budget, "+".join([place or "host", *options])


def _commit() -> str:
    """The commit measured: $COMMIT (set by gpu_check.sh, whose tree may be a copy without .git), else git's."""
    import os
    import subprocess

    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--config", nargs="*", help="BxSxBUDGET, e.g. 24x122880x2048")
    p.add_argument("--hit", nargs="*", type=float, default=[0.0, 0.6])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rank", type=int, default=160)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--calibration-rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", action="store_true", help="also print the device time of each kernel per step")
    p.add_argument("--timeline", action="store_true",
                   help="also print one profiled step's kernels and copies by stream, with start and end (µs)")
    p.add_argument("--graph-steps", type=int, default=0, metavar="N",
                   help="also time N steps captured in one CUDA graph (per step: no graph launch between steps)")
    p.add_argument("--query-write", choices=["copy", "kernel"],
                   default=os.environ.get("SHADOWKV_BENCH_QUERY_WRITE", "copy"),
                   help="how --graph-steps writes each step's query into the captured input: a device-to-device copy "
                        "(copy_, a memcpy node) or an elementwise kernel, as a model's projection does (default: "
                        "$SHADOWKV_BENCH_QUERY_WRITE, else copy)")
    p.add_argument("--graph-timeline", action="store_true",
                   help="also print the same for one graph replay of the step (no host launches between kernels)")
    p.add_argument("--graph-steps-timeline", action="store_true",
                   help="also print the last two steps of a graph of --graph-steps steps (no graph launch before "
                        "them: the gaps between steps are a model's)")
    args = p.parse_args(argv)

    info = build_info()
    device = args.device
    if device == "auto":
        device = "cuda:0" if "cuda" in info["backends"] and info["cuda_devices"] > 0 else "cpu"
    if args.config:
        configs = [_parse_config(c) for c in args.config]
    elif device.startswith("cuda"):
        configs = [(1, 122880, 2048, "host"), (24, 122880, 2048, "host"), (48, 61440, 1024, "host"),
                   (24, 122880, 2048, "host_fp8"), (1, 122880, 2048, "device"), (8, 122880, 2048, "device"),
                   (24, 122880, 2048, "host+k2"), (24, 122880, 2048, "host+p1")]
    else:
        configs = [(1, 8192, 512, "host"), (2, 4096, 256, "host"), (2, 4096, 256, "device"),
                   (2, 4096, 256, "host_fp8")]
        args.steps = min(args.steps, 6)
        args.calibration_rounds = min(args.calibration_rounds, 4)

    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    bandwidths = _measure_bandwidths(device)
    print(f"device {device}; memory copy {bandwidths[0] / 1e9:.1f} GB/s, host->device {bandwidths[1] / 1e9:.1f} GB/s")
    rows = []
    for batch, seq_len, budget, value_store in configs:
        for target in args.hit:
            rows.append(run_case(args, device, batch, seq_len, budget, value_store, target, bandwidths))
            r = rows[-1]
            print(f"B={batch:<3} S={seq_len:<7} budget={budget:<5} values {value_store:<6} hit {r['hit']:.2f}: "
                  f"ours {r['ours_ms']:.3f} ms", flush=True)
    for r in rows:
        if "kernels_us" in r:
            per = f", per layer of {r['layers']}" if r.get("layers", 1) > 1 else ""
            print(f"\nkernels per step{per}, B={r['batch']} S={r['seq_len']} budget={r['budget']} hit {r['hit']:.2f} (µs):")
            for name, us in r["kernels_us"].items():
                print(f"  {us:9.1f}  {name}")
        if "timeline_us" in r:
            print(f"\none step's timeline, B={r['batch']} values {r['value_store']} hit {r['hit']:.2f} "
                  f"(µs from its first start; stream: start - end  kernel):")
            for name, stream, start, end in r["timeline_us"]:
                print(f"  {stream:>4}: {start:8.1f} - {end:8.1f}  {name}")
        if "graph_timeline_us" in r:
            print(f"\none graph replay's timeline, B={r['batch']} values {r['value_store']} hit {r['hit']:.2f} "
                  f"(µs from its first start; stream: start - end  kernel):")
            for name, stream, start, end in r["graph_timeline_us"]:
                print(f"  {stream:>4}: {start:8.1f} - {end:8.1f}  {name}")
        if "graph_steps_timeline_us" in r:
            print(f"\nthe last two steps of a graph of {r['graph_steps']} steps, B={r['batch']} values {r['value_store']} "
                  f"hit {r['hit']:.2f} (µs from the first one's query write; stream: start - end  kernel):")
            for name, stream, start, end in r["graph_steps_timeline_us"]:
                print(f"  {stream:>4}: {start:8.1f} - {end:8.1f}  {name}")
    graph = any("ours_graph_ms" in r for r in rows)
    print("\n| B | S | budget | values, factors | hit | ours (ms) | ours, graph (ms) | full attn (ms) | floor (ms) | "
          "ours/full | ours/floor |" if graph else
          "\n| B | S | budget | values, factors | hit | ours (ms) | full attn (ms) | floor (ms) | ours/full | "
          "ours/floor |")
    print("| --- " * (11 if graph else 10) + "|")
    for r in rows:
        g = f" {r['ours_graph_ms']:.3f} |" if graph else ""
        best = min(r["ours_ms"], r.get("ours_graph_ms", r["ours_ms"]))
        print(f"| {r['batch']} | {r['seq_len']} | {r['budget']} | {r['value_store']}, {r['factor_dtype']}{', ' + r['group_score'] if r.get('group_score', 'mean') != 'mean' else ''}{', two centroids' if r.get('chunk_score') == 'two_centroids' else ''}{', parts ' + str(r['decode_pipeline_parts']) if r.get('decode_pipeline_parts') else ''}{', fetch CTAs ' + str(r['fetch_ctas']) if r.get('fetch_ctas') else ''}{', cache ' + str(r['cache_tokens']) if r.get('cache_tokens') else ''}{', ' + str(r['layers']) + ' layers a step' if r.get('layers', 1) > 1 else ''} | {r['hit']:.2f} | {r['ours_ms']:.3f} |{g} "
              f"{r['full_ms']:.3f} | {r['floor_ms']:.3f} | {best / r['full_ms']:.2f} | {best * 1e3 / (r['floor_ms'] * 1e3):.1f} |")
    if graph:
        print("ratios use the faster of eager and graph-replayed steps")
    multi = [r for r in rows if "ours_graph_steps_ms" in r]
    if multi:
        print("\n| B | S | budget | values | hit | ours, graph of 1 step (ms) | ours, graph of N steps, per step (ms) | N | "
              "full attn (ms) | floor (ms) | ours/full | ours/floor |")
        print("| --- " * 12 + "|")
        for r in multi:
            print(f"| {r['batch']} | {r['seq_len']} | {r['budget']} | {r['value_store']} | {r['hit']:.2f} | "
                  f"{r['ours_graph_ms']:.3f} | {r['ours_graph_steps_ms']:.3f} | {r['graph_steps']} | {r['full_ms']:.3f} | "
                  f"{r['floor_ms']:.3f} | {r['graph_steps_over_full']:.2f} | {r['graph_steps_over_floor']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "gpu": gpu, "commit": _commit(), "build": info, "bandwidths": bandwidths,
                       "results": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
