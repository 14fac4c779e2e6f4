"""How many more selections would hit on the GPU with a value cache larger than last step's selection (issue 8
item 3)? Replays a real-model capture (shadowkv_core.evaluation.fidelity) through a CPU KVStore, records the chunks each
(layer, KV head) selects at each decode step, and simulates per-head caches of `m` times the budget:

  last      today's temporal cache: what the previous step selected (m = 1)
  lru       the m·k most recently selected chunks
  lfu       the m·k most often selected chunks so far (ties: the most recent)

  slots     the store's own rule (docs/semantics.md, Decode 6): K slots, misses in ascending chunk id take the lowest
            empty slot, else the least recently selected slot not selected at this step, ties by the LOWEST SLOT
            INDEX (`lru` breaks ties by the lowest chunk id: among chunks last selected at the same step it evicts
            the smallest id first)

A hit is a selected chunk already in the cache before the step (it needs neither the key rebuild nor the PCIe
fetch). Prints the hit rate per policy and size, mean over layers, heads and steps after the first.

With --store, also replays the capture through real stores built with cache_tokens = m x budget (m in --store-sizes)
and reports the store's own stats()["hit_rate"] over the decode steps (stats reset after the prefill's warm
selection: the same steps, heads and layers as the simulation counts), next to the simulated `slots` and `lru`.

    python bench/value_cache_sim.py --capture tests/fixtures/fidelity_smollm2_1k.npz --budgets 64,128 --json out.json
    python bench/value_cache_sim.py --capture tests/fixtures/fidelity_smollm2_1k.npz --budgets 64,128 --store \
        --json docs/results/value_cache_store_smollm2_1k.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, OrderedDict

import torch

from shadowkv_core import KVStore
from shadowkv_core.evaluation.fidelity import load_capture

SIZES = (1.0, 1.5, 2.0, 4.0, 8.0)


def replay(capture, budget: int, rank: int, chunk_size: int, outlier_chunks: int, local_chunks: int,
           cache_tokens: int = 0, group_score: str = "mean", after_prefill=None, after_decode=None):
    """Replays the capture through a CPU store; calls after_prefill(store, slot) once and after_decode(store, slot,
    layer_index) after each decode call. Returns the store."""
    m = capture.meta
    hq, hkv, d = m["num_q_heads"], m["num_kv_heads"], m["head_dim"]
    layers = sorted(capture.layers)
    S, T = capture.prompt_len, capture.steps
    store = KVStore(num_layers=len(layers), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_batch=1,
                    max_seq_len=S + T, inv_freq=torch.tensor(m["inv_freq"], dtype=torch.float32),
                    rotary_dim=m["rotary_dim"], rope_style="half", attention_scaling=m["attention_scaling"],
                    softmax_scale=float(m["softmax_scale"]), rank=min(rank, hkv * d), chunk_size=chunk_size,
                    budget=budget, cache_tokens=cache_tokens, outlier_chunks=outlier_chunks,
                    local_chunks=local_chunks, group_score=group_score, generation_window=256, dtype="float32",
                    device="cpu")
    slot = store.add_sequences(1)[0]
    positions = torch.arange(S, dtype=torch.int64)[None]
    for i, layer in enumerate(layers):
        lc = capture.layers[layer]
        store.prefill(i, [slot], lc.keys[None], lc.values[None], positions=positions, q_last=lc.q_last[None],
                      keys_post_rope=True)
    if after_prefill is not None:
        after_prefill(store, slot)
    for t in range(T):
        pos = torch.tensor([S + t], dtype=torch.int64)
        for i, layer in enumerate(layers):
            lc = capture.layers[layer]
            store.decode(i, [slot], lc.q[t][None], lc.k_new[t][None], lc.v_new[t][None], positions=pos)
            if after_decode is not None:
                after_decode(store, slot, i)
    return store


def selection_traces(capture, budget: int, rank: int, chunk_size: int, outlier_chunks: int, local_chunks: int,
                     group_score: str = "mean"):
    """[layer][head] -> list over steps of the selected chunk ids (sets)."""
    traces = []

    def first(store, slot):
        traces.extend([[set(s)] for s in store.selected_chunks(i, slot)] for i in range(len(capture.layers)))

    def record(store, slot, i):
        for h, chunks in enumerate(store.selected_chunks(i, slot)):
            traces[i][h].append(set(chunks))

    replay(capture, budget, rank, chunk_size, outlier_chunks, local_chunks, group_score=group_score,
           after_prefill=first, after_decode=record)
    return traces


def store_hit_rate(capture, budget: int, cache_tokens: int, rank: int, chunk_size: int, outlier_chunks: int,
                   local_chunks: int, group_score: str = "mean"):
    """The store's own hit rate over the decode steps (its stats, reset after the prefill's warm selection)."""
    store = replay(capture, budget, rank, chunk_size, outlier_chunks, local_chunks, cache_tokens=cache_tokens,
                   group_score=group_score, after_prefill=lambda s, _: s.reset_stats())
    st = store.stats()
    return st["hit_rate"], st["hits"], st["misses"], store.memory_report()["selection_cache"]


def simulate_slots(trace, capacity: int):
    """The store's slot rule (docs/semantics.md, Decode 6) on a selection trace: hits and selections after the first
    step, as simulate()."""
    chunk = [None] * capacity
    used = [0] * capacity
    hits = selected = 0
    for t, chosen in enumerate(trace):
        held = {c: j for j, c in enumerate(chunk) if c is not None}
        if t > 0:
            hits += len(chosen & held.keys())
            selected += len(chosen)
        taken = {held[c] for c in chosen if c in held}
        for j in taken:
            used[j] = t
        for c in sorted(chosen - held.keys()):
            empty = [j for j in range(capacity) if chunk[j] is None]
            j = empty[0] if empty else min((j for j in range(capacity) if j not in taken), key=lambda j: (used[j], j))
            chunk[j], used[j] = c, t
            taken.add(j)
    return hits, selected


def simulate(trace, capacity: int, policy: str):
    """Hits and selections over the steps after the first (the first is the prefill's warm selection)."""
    hits = selected = 0
    recent: OrderedDict = OrderedDict()  # chunk -> None, most recent last
    counts: Counter = Counter()
    last_seen = {}
    cache = set(trace[0])
    for t, chosen in enumerate(trace):
        if t > 0:
            hits += len(chosen & cache)
            selected += len(chosen)
        for c in sorted(chosen):
            recent.pop(c, None)
            recent[c] = None
            counts[c] += 1
            last_seen[c] = t
        if policy == "last":
            cache = set(chosen)
        elif policy == "lru":
            cache = set(list(recent)[-capacity:])
        else:  # lfu, the step's selection always kept (it is in the GPU buffers now)
            others = sorted((c for c in counts if c not in chosen), key=lambda c: (-counts[c], -last_seen[c]))
            cache = set(chosen) | set(others[: max(0, capacity - len(chosen))])
    return hits, selected


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capture", required=True)
    p.add_argument("--budgets", default="64,128,256")
    p.add_argument("--rank", type=int, default=160)
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--outlier-chunks", type=int, default=4)
    p.add_argument("--local-chunks", type=int, default=4)
    p.add_argument("--group-score", default="mean", choices=("mean", "max"),
                   help="the store's group_score (its default is mean; the first runs of this script used max)")
    p.add_argument("--store", action="store_true", help="also measure real stores with cache_tokens = m x budget")
    p.add_argument("--store-sizes", default="1,1.5,2,4")
    p.add_argument("--json")
    args = p.parse_args(argv)
    capture = load_capture(args.capture)
    results = {"capture": args.capture, "prompt_len": capture.prompt_len, "steps": capture.steps,
               "layers": sorted(capture.layers), "group_score": args.group_score, "rank": args.rank,
               "chunk_size": args.chunk_size, "outlier_chunks": args.outlier_chunks, "local_chunks": args.local_chunks,
               "rows": []}
    print(f"{args.capture}: prompt {capture.prompt_len}, {capture.steps} steps, layers {sorted(capture.layers)}")
    print("| budget (tokens) | policy | cache / budget | hit rate |")
    print("| --- | --- | --- | --- |")
    for budget in (int(b) for b in args.budgets.split(",")):
        traces = selection_traces(capture, budget, args.rank, args.chunk_size, args.outlier_chunks,
                                  args.local_chunks, args.group_score)
        k = budget // args.chunk_size
        for policy, sizes in (("last", (1.0,)), ("lru", SIZES), ("lfu", SIZES), ("slots", SIZES)):
            for size in sizes:
                hits = selected = 0
                for layer_traces in traces:
                    for trace in layer_traces:
                        capacity = int(round(size * k))
                        h, s = simulate_slots(trace, capacity) if policy == "slots" else simulate(trace, capacity,
                                                                                                  policy)
                        hits += h
                        selected += s
                rate = hits / selected if selected else 0.0
                results["rows"].append(dict(budget=budget, policy=policy, size=size, hit_rate=rate))
                print(f"| {budget} | {policy} | {size:g} | {rate:.3f} |", flush=True)
        if not args.store:
            continue
        for size in (float(m) for m in args.store_sizes.split(",")):
            cache_tokens = int(round(size * k)) * args.chunk_size
            rate, hits, misses, cache_bytes = store_hit_rate(capture, budget, cache_tokens, args.rank,
                                                              args.chunk_size, args.outlier_chunks, args.local_chunks,
                                                              args.group_score)
            results["rows"].append(dict(budget=budget, policy="store", size=size, cache_tokens=cache_tokens,
                                        hit_rate=rate, hits=hits, misses=misses, selection_cache_bytes=cache_bytes))
            print(f"| {budget} | store (cache_tokens={cache_tokens}) | {size:g} | {rate:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
