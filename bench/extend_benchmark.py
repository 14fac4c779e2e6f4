"""One layer's `extend` next to the same tokens as sequential `decode` calls and next to full attention, in one run.

    python bench/extend_benchmark.py --json bench/results/<date>-<commit>-extend.json [--tests tests.json]

Llama-3-8B attention shapes (Hq 32, Hkv 8, D 128), rank 160, budget 2048, bf16, values in pinned host memory, random
data. Cases (issue 47 item 5):
  * `extend` of T = 512 tokens at B = 1 and B = 8 onto S = 122880-token prompts, against T sequential `decode` calls
    of the same tokens (from the same state) and against full attention's attention for the same T tokens (SDPA,
    causal, bf16, over the S + T keys);
  * W3's warm request: a 32768-token suffix onto a 98304-token prompt at B = 1 (time to its first output token is
    the suffix's attention through every layer: one layer here), against SDPA over the prefix and the suffix;
  * a 4-token draft verified by `extend` and 2 of them dropped by `truncate`, against 4 `decode` calls.
Every time is the median of several runs, each from a freshly prefilled state (extend and decode change it). Each
row: batch, seq_len, tokens, ours_ms, decode_loop_ms, full_ms (and their ratios); the file: gpu, commit, tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch.nn.attention.bias import causal_lower_right

from shadowkv_core import KVStore
from step_benchmark import _commit  # $COMMIT, else git's (bench/ is the script's folder)

HQ, HKV, D = 32, 8, 128


def _timed(call) -> float:
    """Milliseconds of `call()` on the current stream (CUDA events)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


class Case:
    def __init__(self, batch: int, prompt: int, tokens: int, extend_block: int = 32):
        self.batch, self.prompt, self.tokens = batch, prompt, tokens
        g = torch.Generator(device="cuda").manual_seed(batch * 7919 + prompt + tokens)
        self.store = KVStore(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_batch=batch,
                             max_seq_len=prompt + tokens + 8, rope_theta=500000.0, rank=160, budget=2048,
                             dtype="bfloat16", device="cuda:0", value_store="host", extend_block=extend_block)
        shape_kv = (batch, prompt, HKV, D)
        self.keys = torch.randn(shape_kv, generator=g, device="cuda", dtype=torch.bfloat16)
        self.values = torch.randn(shape_kv, generator=g, device="cuda", dtype=torch.bfloat16)
        self.q_last = torch.randn(batch, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
        self.q = torch.randn(batch, tokens, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
        self.k = torch.randn(batch, tokens, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn(batch, tokens, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
        self.slots = None
        self.full_how = None

    def fresh(self) -> None:
        """Releases the sequences and prefills them again (extend and decode change them)."""
        if self.slots is not None:
            self.store.release(self.slots)
        self.slots = self.store.add_sequences(self.batch)
        self.store.prefill(0, self.slots, self.keys, self.values, q_last=self.q_last)
        torch.cuda.synchronize()

    def extend_ms(self) -> float:
        self.fresh()
        out = torch.empty_like(self.q)
        self.store.extend(0, self.slots, self.q, self.k, self.v, out=out)  # warm: the workspace is reserved once
        self.fresh()
        return _timed(lambda: self.store.extend(0, self.slots, self.q, self.k, self.v, out=out))

    def decode_loop_ms(self) -> float:
        self.fresh()
        out = torch.empty(self.batch, HQ, D, device="cuda", dtype=torch.bfloat16)

        def loop():
            for t in range(self.tokens):
                self.store.decode(0, self.slots, self.q[:, t], self.k[:, t], self.v[:, t], out=out)
        return _timed(loop)

    def draft_ms(self, drop: int) -> float:
        self.fresh()
        out = torch.empty_like(self.q)

        def verify():
            self.store.extend(0, self.slots, self.q, self.k, self.v, out=out)
            self.store.truncate(self.slots, drop)
        verify()
        return _timed(verify)

    def full_ms(self) -> float:
        """SDPA over prompt + new tokens for the new tokens' queries (causal, aligned at the end), GQA."""
        total = self.prompt + self.tokens
        keys = torch.randn(self.batch, HKV, total, D, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        queries = self.q.transpose(1, 2).contiguous()
        mask = causal_lower_right(self.tokens, total)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def attend():
            sdpa(queries, keys, values, attn_mask=mask, enable_gqa=True)
        try:
            attend()
            self.full_how = "sdpa gqa, causal lower-right"
        except (TypeError, RuntimeError):  # a torch whose causal bias takes no GQA: the KV heads repeated
            keys, values = keys.repeat_interleave(HQ // HKV, 1), values.repeat_interleave(HQ // HKV, 1)

            def attend():
                sdpa(queries, keys, values, attn_mask=mask)
            attend()
            self.full_how = "sdpa, KV heads repeated, causal lower-right"
        return _timed(attend)

    def close(self) -> None:
        del self.store, self.keys, self.values, self.q, self.k, self.v
        torch.cuda.empty_cache()


def _median(measure, runs: int) -> float:
    return statistics.median(measure() for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the result file here")
    parser.add_argument("--tests", help="a JSON file with this run's test counts (gpu_check.sh --quick)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name(0)
    rows = []
    started = time.perf_counter()
    for batch, prompt, tokens, loop in ((1, 122880, 512, True), (8, 122880, 512, True), (1, 98304, 32768, False)):
        case = Case(batch, prompt, tokens)
        row = dict(case="extend", batch=batch, seq_len=prompt, tokens=tokens, extend_block=32,
                   ours_ms=_median(case.extend_ms, args.runs),
                   decode_loop_ms=_median(case.decode_loop_ms, 1) if loop else None,
                   full_ms=_median(case.full_ms, args.runs))
        row["full_how"] = case.full_how
        case.close()
        rows.append(row)
        print(row, flush=True)
    case = Case(1, 122880, 4)
    rows.append(dict(case="draft 4, drop 2", batch=1, seq_len=122880, tokens=4, extend_block=32,
                     ours_ms=_median(lambda: case.draft_ms(2), args.runs),
                     decode_loop_ms=_median(case.decode_loop_ms, args.runs), full_ms=_median(case.full_ms, args.runs)))
    case.close()
    print(rows[-1], flush=True)
    tests = json.load(open(args.tests)) if args.tests and os.path.exists(args.tests) else None
    result = dict(gpu=gpu, commit=_commit(), date=time.strftime("%Y-%m-%d"), tests=tests,
                  shapes=dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rank=160, budget=2048, dtype="bfloat16",
                              value_store="host"),
                  seconds=time.perf_counter() - started, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'case':16} {'B':>2} {'S':>7} {'T':>6} {'ours ms':>9} {'decodes ms':>10} {'full ms':>8} "
          f"{'/decodes':>8} {'/full':>6}   ({gpu}, {result['commit']})")
    for r in rows:
        loop = r["decode_loop_ms"]
        print(f"{r['case']:16} {r['batch']:>2} {r['seq_len']:>7} {r['tokens']:>6} {r['ours_ms']:>9.3f} "
              f"{loop if loop is not None else float('nan'):>10.3f} {r['full_ms']:>8.3f} "
              f"{(r['ours_ms'] / loop) if loop else float('nan'):>8.3f} {r['ours_ms'] / r['full_ms']:>6.3f}")


if __name__ == "__main__":
    main()
