"""chunk_score="two_centroids" (docs/semantics.md, "Chunk scores"): each (chunk, KV head) is scored from a 2-means of
its stored keys, two e4m3 centroids and a count, instead of the keys' mean.

* The CPU store equals the float64 reference (its own 2-means, fp8 through torch's float8_e4m3fn) over many decode
  steps with folds: selections (near-ties aside), hits/misses, memory_report()["landmarks"] (2·D + 9 bytes a chunk
  and head), outputs to float tolerance; GQA/MQA/MHA, both group scores, float32 and bfloat16 storage.
* The rule on hand-made chunks: identical keys give one cluster (n1 = C); two separated groups give their means.
* Both backends (the `device` fixture): the CUDA backend computes the 2-means with a warp per (chunk, head) and
  scores with the tiled logits kernel; it is held to the same reference and tolerances.
* A bad name is a ValueError naming chunk_score.
"""

import pytest
import torch

import reference as R
from helpers import generator, small_config
from test_value_cache import Batch

from shadowkv_core import KVStore

CHUNK = 8


def random_config(seed):
    g = generator(seed)
    pick = lambda options: options[int(torch.randint(0, len(options), (1,), generator=g))]  # noqa: E731
    hq, hkv = pick([(4, 2), (4, 1), (2, 2), (8, 2)])
    return small_config(num_layers=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=pick([32, 64]), max_batch=3,
                        rank=24, chunk_size=CHUNK, budget=pick([3, 4, 6]) * CHUNK, outlier_chunks=pick([0, 2]),
                        sink_chunks=0, local_chunks=2, generation_window=16, group_score=pick(["mean", "max"]),
                        dtype=pick(["float32", "float32", "bfloat16"]), chunk_score="two_centroids")


@pytest.mark.parametrize("seed", [8100, 8101, 8102, 8103, 8104, 8105])
def test_two_centroids_match_the_reference(seed, device):
    kw = random_config(seed)
    kw["device"] = device
    if device.startswith("cuda"):
        kw["head_dim"] = 64  # the CUDA kernels take head_dim 64, 80, 96, 128 or 256
    steps = 30
    batch = Batch(kw, lengths=[203, 150, 171], steps=steps, seed=seed, keep=0.6)
    store = batch.store
    assert store.config["chunk_score"] == "two_centroids"
    tol = 4e-3 if kw["dtype"] == "bfloat16" else 5e-4
    for i in range(steps):
        for layer in range(kw["num_layers"]):
            batch.check_step(layer, i, tol)
            st = store.stats()
            assert (st["hits"], st["misses"]) == batch.ref_stats(), f"step {i} layer {layer} (seed={seed})"
    for r in batch.refs.values():
        assert r.folds >= 2, f"{r.folds} folds (seed={seed})"
    expected = sum(r.memory_report()["landmarks"] for r in batch.refs.values())
    chunks = sum(r.n_ctx_chunks for r in batch.refs.values())
    assert expected == chunks * kw["num_kv_heads"] * (2 * kw["head_dim"] + 9)
    assert store.memory_report()["landmarks"] == expected, f"(seed={seed})"


def test_the_rule_on_hand_made_chunks():
    g = generator(8200)
    key = torch.randn(16, generator=g, dtype=torch.float64)
    centroids, n1 = R._two_centroids(key.repeat(CHUNK, 1))
    assert n1 == CHUNK, "identical keys are one cluster (ties go to the first)"
    scale = key.float().abs().max() / 448.0
    expected = ((key.float() / scale).to(torch.float8_e4m3fn).float() * scale).double()
    assert torch.equal(centroids[0], expected)
    # Two groups far apart: 3 keys near +u, 5 near -u. The farthest pair has one key in each group; the first
    # cluster is the group of the pair's first key (key 0 here, in the +u group).
    u = torch.randn(16, generator=g, dtype=torch.float64) * 4
    noise = 0.01 * torch.randn(CHUNK, 16, generator=g, dtype=torch.float64)
    keys = torch.cat([u.repeat(3, 1), (-u).repeat(5, 1)]) + noise
    centroids, n1 = R._two_centroids(keys)
    assert n1 == 3
    for m, rows in ((0, keys[:3]), (1, keys[3:])):
        mean = rows.mean(0)
        assert torch.allclose(centroids[m], mean, rtol=0.07, atol=0.02 * float(mean.abs().max())), m


def test_bad_chunk_score_is_rejected():
    with pytest.raises(ValueError, match="chunk_score"):
        KVStore(**small_config(chunk_score="three_centroids"))
