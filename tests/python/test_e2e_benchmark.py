"""The parts of bench/e2e_benchmark.py that its numbers rest on, checked on the tiny model:

* a sequence filled from the prefill record (what --reuse-prefill does for every sequence after the first) decodes
  exactly like a sequence prefilled through the model (same logits for 6 steps, relative 1e-6; dense cache and store);
* the capacity search finds the largest cap that fits from any start (fake builder, fits iff cap <= limit), and ends
  holding a cache built for that cap;
* the --tiny run completes and writes a result file with the documented fields.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from helpers import rel_err

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _load(name, *parts):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, *parts))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


B = _load("e2e_benchmark", "bench", "e2e_benchmark.py")
L = B.L


@pytest.mark.parametrize("kind", ["full", "store"])
def test_fill_from_record_equals_real_prefill(device, kind):
    cfg = L.LlamaConfig.tiny()
    model = L.LlamaModel(cfg, device, torch.float32, seed=5, prefill_chunk=48)
    if kind == "full":
        inner = L.FullAttentionCache(cfg, 2, 256, model.device, model.dtype)
    else:
        inner = L.ShadowKVCache(model, max_batch=2, max_seq_len=256, rank=16, budget=32, chunk_size=8,
                                outlier_chunks=2, local_chunks=1, generation_window=16)
    dev = B.Device(device)
    cache = B.Instrumented(inner, B.Spans(dev))
    prompt = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(3))
    record = B.PrefillRecord("host", dev, prompt.numel())
    cache.record = record
    real, _ = model.prefill(cache, prompt)
    cache.record = None
    assert record.complete(cfg.num_layers)
    replayed = B.prefill_from_record(model, cache, record)
    assert cache.length(replayed) == cache.length(real) == prompt.numel()
    tokens = torch.tensor([7, 7], device=device)
    for step in range(6):
        logits = model.decode_step(cache, [real, replayed], tokens)
        err = rel_err(logits[1], logits[0])
        assert err <= 1e-6, f"{kind}: step {step}: replayed vs real relative error {err:.3g}"
        tokens = logits[0].argmax().repeat(2)


@pytest.mark.parametrize("start,upper,limit,expected", [(32, 32, 13, 13), (5, 32, 13, 13), (13, 32, 13, 13),
                                                        (32, 10, 13, 10), (4, 32, 0, 0), (1, 64, 64, 64)])
def test_capacity_search(start, upper, limit, expected):
    built = []

    def make(cap):
        if cap <= limit:
            built.append(cap)
            return {"cap": cap}, None
        return None, "too big"

    cap, obj, attempts = B.search_capacity(make, start, upper, "fake")
    assert cap == expected
    assert (obj is None) if expected == 0 else (obj == {"cap": expected})
    assert all(a["fits"] == (a["max_batch"] <= limit) for a in attempts)
    assert len(attempts) <= 2 * (upper.bit_length() + 2), attempts


def test_tiny_run_writes_results(tmp_path):
    out = tmp_path / "e2e.json"
    assert B.main(["--tiny", "--seq-len", "200", "--steps", "4", "--split-steps", "2", "--warmup", "1",
                   "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    run = data["runs"][-1]
    assert run["seq_len"] == 200 and run["gpu"] and run["commit"] and run["notes"]
    for name in ("full", "store"):
        m = run["methods"][name]
        assert m["max_batch"] == 4 and m["tokens_per_s"] > 0 and m["prefill_s"] > 0 and m["memory"]
        assert [r["batch"] for r in m["sweep"]] == [1, 2, 4]
        for r in m["sweep"]:
            assert r["step_ms"] > 0 and r["attention_ms"] > 0 and r["attention_ms"] <= r["instrumented_step_ms"]
    assert 0 < run["methods"]["store"]["compression_share"] < 1
    assert 0 <= run["methods"]["store"]["sweep"][0]["hit_rate"] <= 1


def test_out_of_memory_while_filling(tmp_path, monkeypatch):
    """A cache whose first prefill runs out of memory is rebuilt one smaller; an out-of-memory while adding a later
    sequence stops the fill and the decode runs at the batch that fit (simulated: the CPU never runs out)."""
    real_prefill, replay = L.LlamaModel.prefill, B.prefill_from_record

    def prefill(self, cache, prompt_ids):
        if cache.inner.max_batch >= 4:
            raise torch.cuda.OutOfMemoryError("fake: no room for a prefill beside a 4-sequence cache")
        return real_prefill(self, cache, prompt_ids)

    def from_record(model, cache, record):
        if len(cache.active_slots) >= 2:
            raise torch.cuda.OutOfMemoryError("fake: third sequence")
        return replay(model, cache, record)

    monkeypatch.setattr(L.LlamaModel, "prefill", prefill)
    monkeypatch.setattr(B, "prefill_from_record", from_record)
    out = tmp_path / "oom.json"
    assert B.main(["--tiny", "--methods", "full", "--seq-len", "100", "--steps", "2", "--split-steps", "1",
                   "--warmup", "1", "--json", str(out)]) == 0
    m = json.loads(out.read_text())["runs"][-1]["methods"]["full"]
    assert [(a["max_batch"], a["fits"]) for a in m["capacity_search"]] == [(4, True), (4, False), (3, True)]
    assert m["cache_max_batch"] == 3 and m["max_batch"] == 2
    assert m["stop_reason"].startswith("out of memory adding sequence 3")
    assert [r["batch"] for r in m["sweep"]] == [1, 2] and m["tokens_per_s"] > 0
