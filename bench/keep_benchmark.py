"""W4 of the SoK seed ("recompute versus fetch"): how long until a 122K-token sequence that left the GPU decodes again.

    python bench/keep_benchmark.py --json bench/results/<date>-<commit>-w4.json [--tests tests.json] [--dir /tmp]

A Llama-3-8B-shaped decoder (random bf16 weights, examples/llama_decoder.py) prefills one prompt of --seq-len tokens
into a KVStore (budget 2048, rank 160, values in pinned host memory) and decodes a few tokens. Then, each timed from
the call to the moment the sequence can decode (the device idle), next to the others of the same run:
  * recompute: the prefill again (the model's forward over the prompt and the store's prefill of every layer);
  * resume: `park` then `resume` (the arenas from pinned host memory; the host value store stays where it is);
  * load: `save` to a file in --dir, the file dropped from the page cache (posix_fadvise DONTNEED after fsync), then
    `load` (read, checks, copy in), next to the file's bytes over the disk's read speed, measured on the same file
    the same way just before;
  * full attention: its plain KV cache of the same tokens (bf16, [layers, 2, S, Hkv, D]) copied to the device from
    pinned host memory, and read from a file in --dir (dropped from the page cache) and copied.
Each resumed or loaded sequence decodes the next token with logits equal, bit for bit, to a fork of the sequence
that never left (checked; the row says so). Fields are named by the quantity; gpu, commit and tests name the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

from llama_decoder import LlamaConfig, LlamaModel, ShadowKVCache  # noqa: E402
from step_benchmark import _commit  # noqa: E402


def _seconds(call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _drop_from_page_cache(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read_speed(path: str) -> float:
    """Bytes per second of reading `path` from the disk (dropped from the page cache first)."""
    _drop_from_page_cache(path)
    size = os.path.getsize(path)
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--tests")
    parser.add_argument("--seq-len", type=int, default=122880)
    parser.add_argument("--dir", default="/tmp", help="where the saved files go (local disk)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke test of this script)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda:0"
    if args.tiny:
        torch.cuda.synchronize = lambda: None  # noqa: E731 (no device to wait for)
    cfg = LlamaConfig.tiny() if args.tiny else LlamaConfig()
    model = LlamaModel(cfg, device=device)
    store_kwargs = dict(budget=64 if args.tiny else 2048, rank=None if args.tiny else 160, value_store="host")
    if args.tiny:
        store_kwargs.update(chunk_size=8)
    cache = ShadowKVCache(model, max_batch=3, max_seq_len=args.seq_len + 64, **store_kwargs)
    store = cache.store
    prompt = torch.randint(0, cfg.vocab_size, (args.seq_len,), generator=torch.Generator().manual_seed(0))
    rows = {}

    slot = None

    def prefill():
        nonlocal slot
        slot, _ = model.prefill(cache, prompt)
    with torch.no_grad():
        prefill()  # warm (the first prefill allocates torch's and the store's workspaces)
        cache.release(slot)
        rows["recompute_s"] = _seconds(prefill)
        token = torch.tensor([1])
        for _ in range(4):
            model.decode_step(cache, [slot], token)

        def twin_logits(current: int) -> torch.Tensor:
            """The next token's logits on a fork of `current` (released afterwards), for the bit-for-bit checks."""
            child = store.fork(current)[0]
            cache._lengths[child] = cache._lengths[current]
            logits = model.decode_step(cache, [child], token)
            store.release([child])
            del cache._lengths[child]
            return logits

        reference = twin_logits(slot)

        def moved(old: int, new: int) -> None:
            cache._lengths[new] = cache._lengths.pop(old)

        # park / resume
        parked_list = []
        rows["park_s"] = _seconds(lambda: parked_list.append(store.park([slot])[0]))
        parked = parked_list[0]
        rows["parked_host_bytes"] = parked.host_bytes
        resumed = []
        rows["resume_s"] = _seconds(lambda: resumed.extend(store.resume([parked])))
        moved(slot, resumed[0])
        slot = resumed[0]
        rows["resume_equal"] = bool(torch.equal(twin_logits(slot), reference))

        # save / load
        path = os.path.join(args.dir, "shadowkv-w4.skv")
        rows["save_s"] = _seconds(lambda: store.save(slot, path))
        rows["file_bytes"] = os.path.getsize(path)
        rows["disk_read_bytes_per_s"] = _read_speed(path)
        _drop_from_page_cache(path)
        loaded = []
        rows["load_s"] = _seconds(lambda: loaded.append(store.load(path)))
        cache._lengths[loaded[0]] = cache._lengths[slot]
        rows["load_equal"] = bool(torch.equal(twin_logits(loaded[0]), reference))
        rows["load_over_disk_time"] = rows["load_s"] / (rows["file_bytes"] / rows["disk_read_bytes_per_s"])
        os.remove(path)
        store.release([loaded[0]])
        del cache._lengths[loaded[0]]

        # full attention's cache of the same tokens, from pinned host memory and from the disk
        tokens = cache.length(slot)
        shape = (cfg.num_layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim)
        host = torch.empty(shape, dtype=model.dtype, pin_memory=not args.tiny)
        host.fill_(0.5)  # the bytes do not matter to the copies
        rows["full_cache_bytes"] = host.numel() * host.element_size()
        on_device = torch.empty(shape, dtype=model.dtype, device=device)
        rows["full_from_host_s"] = _seconds(lambda: on_device.copy_(host, non_blocking=True))
        full_path = os.path.join(args.dir, "shadowkv-w4-full.bin")
        (host if model.dtype == torch.float32 else host.view(torch.int16)).numpy().tofile(full_path)
        _drop_from_page_cache(full_path)

        def from_disk():
            raw = torch.from_file(full_path, shared=False, size=host.numel(), dtype=model.dtype)
            on_device.copy_(raw.view(shape))
        rows["full_from_disk_s"] = _seconds(from_disk)
        os.remove(full_path)

    gpu = torch.cuda.get_device_name(0) if not args.tiny else "cpu (tiny smoke test)"
    tests = json.load(open(args.tests)) if args.tests and os.path.exists(args.tests) else None
    result = dict(gpu=gpu, commit=_commit(), date=time.strftime("%Y-%m-%d"), tests=tests, seq_len=args.seq_len,
                  shapes=dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              rank=store_kwargs["rank"], budget=store_kwargs["budget"], value_store="host"),
                  **rows)
    result["recompute_over_resume"] = rows["recompute_s"] / rows["resume_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nW4 at {args.seq_len} tokens ({gpu}, {result['commit']})")
    for key in ("recompute_s", "park_s", "resume_s", "save_s", "load_s", "full_from_host_s", "full_from_disk_s"):
        print(f"  {key:18} {rows[key]:10.4f}")
    print(f"  recompute / resume {result['recompute_over_resume']:.0f}x; load / (file bytes at disk speed) "
          f"{rows['load_over_disk_time']:.2f} (file {rows['file_bytes'] / 2**30:.2f} GiB, disk "
          f"{rows['disk_read_bytes_per_s'] / 2**30:.2f} GiB/s); full cache {rows['full_cache_bytes'] / 2**30:.2f} GiB; "
          f"equal after resume {rows['resume_equal']}, after load {rows['load_equal']}")


if __name__ == "__main__":
    main()
