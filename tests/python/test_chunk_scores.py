"""bench/chunk_scores.py (chunk-score rules compared by the attention mass their selections cover), on the committed
real-model captures (tests/fixtures). What its numbers rest on:

* the "landmark" rule selects exactly what the store selects, step by step, and covers exactly the mass
  `shadowkv_core.evaluation.fidelity.evaluate` reports for the store;
* the exact-keys rule ("exact-lse", group combined by estimated mass) covers exactly the "best possible" mass, so the
  best column and the selection code agree;
* the bounds are bounds: Quest's per-channel score and the radius score are >= every key's logit in the chunk, and
  the low-rank rules at full rank are the exact keys' rules;
* the byte counts match docs/performance.md (755 MB of landmarks at B=24, S=122880).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from shadowkv_core.evaluation import fidelity as F

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = [os.path.join(HERE, "..", "fixtures", f"fidelity_{m}_1k.npz") for m in ("smollm2", "gemma3")]


def _load_bench():
    path = os.path.join(HERE, "..", "..", "bench", "chunk_scores.py")
    spec = importlib.util.spec_from_file_location("chunk_scores", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CS = _load_bench()


@pytest.fixture(scope="module", params=FIXTURES, ids=["smollm2", "gemma3"])
def capture(request):
    return F.load_capture(request.param)


def test_landmark_rule_is_the_store_and_exact_rule_is_the_best(capture):
    res = CS.measure(capture, [32, 64], ["landmark", "exact-lse", "quest"], store_check=True)
    check = res["store_check"]
    assert check["compared_per_budget"] == len(capture.layers) * capture.steps * capture.meta["num_kv_heads"]
    assert check["mismatched_head_steps"] == {"32": 0, "64": 0}
    ev = F.evaluate(capture, budgets=[32, 64], ranks=["full"], outlier_chunks=4, local_chunks=4, chunk_size=8,
                    sink_chunks=1, group_score="max")  # the "landmark" rule combines the group by the max
    for run in ev["runs"]:
        b = str(run["budget"])
        assert res["rules"]["landmark"][b]["overall"] == pytest.approx(run["overall"]["mass_covered"], abs=1e-12)
        assert res["best"][b]["overall"] == pytest.approx(run["overall"]["mass_oracle"], abs=1e-12)
        assert res["rules"]["exact-lse"][b]["overall"] == pytest.approx(res["best"][b]["overall"], abs=1e-12)
        assert res["fixed_only"]["overall"] < res["rules"]["quest"][b]["overall"] <= res["best"][b]["overall"] + 1e-12


def test_bounds_and_full_rank(capture):
    m = capture.meta
    layer = sorted(capture.layers)[0]
    lc = capture.layers[layer]
    full_rank = m["num_kv_heads"] * m["head_dim"]
    st = CS.LayerStats(lc, m, 8, 4, full_rank)
    scale = float(m["softmax_scale"])
    S = lc.prompt_len
    q = lc.q[0].double()
    tokens = CS._token_logits(CS._group_view(q, st.hkv), st.kp.reshape(-1, st.hkv, st.d), st.n, st.C)
    top = tokens.amax(-1)
    assert torch.all(CS.rule_quest(st, q, S, scale) >= top - 1e-9)
    assert torch.all(CS.RULES["radius"](st, q, S, scale) >= top - 1e-9)
    assert torch.all(CS.rule_landmark(st, q, S, scale) <= top + 1e-6)        # a mean is below the max
    # full rank: the rebuilt keys are the stored keys (float32 factor rounding aside)
    assert torch.allclose(CS.rule_lowrank_max(st, q, S, scale), top, rtol=0, atol=1e-3 * top.abs().max())
    assert torch.allclose(CS.rule_lowrank_lse(st, q, S, scale), CS.rule_exact_lse(st, q, S, scale), rtol=0,
                          atol=1e-3 * top.abs().max())


def test_bytes_and_gpu_estimate():
    est = CS.gpu_estimate("landmark")
    assert est["bytes"] == 24 * 15360 * 8 * 128 * 2 and est["ratio"] == 1.0
    assert CS.gpu_estimate("quest")["ratio"] == 2.0 and CS.gpu_estimate("quest-fp8")["ratio"] < 1.02
    assert CS.gpu_estimate("latent-max")["ratio"] == 2.5                     # A: 8 rows x 160 float32 / 8 heads
    with pytest.raises(ValueError):
        CS.parse_rule("landmark@median")
