"""Attention fidelity on real KV: how far the store's decode output is from full attention, on captured Q/K/V.

    python -m shadowkv_core.evaluation.fidelity --model smollm2 --tokens 4096 --steps 32 \\
        --json docs/results/fidelity_smollm2_4k.json
    python -m shadowkv_core.evaluation.fidelity --capture tests/fixtures/fidelity_smollm2_1k.npz   # a saved capture

Two halves:

* **Capture** (`capture_model`): the model runs a prompt of haystack text (the licence texts under
  /usr/share/common-licenses) and then `steps` greedy decode steps, with an attention function registered through
  transformers' `AttentionInterface` that records, for the chosen full-attention layers, the post-RoPE keys and
  values of the prompt, the last prompt query, and every decode step's post-RoPE query, new key, new value and the
  model's own attention output; forward hooks record the model's own pre-RoPE keys (the output of `k_norm` where the
  model has one, as Gemma-3 and Qwen3 do, else of `k_proj`). The attention itself is the model's sdpa, unchanged.
  A capture can be saved (fp16 `.npz`) and loaded again (`save_capture`, `load_capture`): the test fixtures under
  tests/fixtures/ are such captures.
* **Evaluation** (`evaluate`): for each rank and budget a fresh CPU `KVStore` gets the prompt (post-RoPE keys, as
  the transformers adapter hands them over, plus the last prompt query to warm the selection) and the decode steps
  in order; each decode output is compared with exact full attention (float64) over the same captured tokens.
  Reported per layer: the relative error ``|o_store - o_full| / |o_full|`` (Frobenius over all query heads; mean and
  max over steps), the temporal hit rate across the decode steps (a selected chunk that was also selected at the
  step before, per KV head; the first step compares with the prompt's warm-up selection), the share of full
  attention's probability mass that lies on the tokens the store attended to, and the mass that the best possible
  choice of the same number of chunks would cover (an upper bound for any selection rule); and per layer the rank
  that keeps 95 / 99 / 99.9 % of the energy of the pre-RoPE keys (squared singular values of ``K_pre[S, Hkv*D]``,
  heads concatenated, not centred: exactly what the store factorises).

The store runs with float32 storage by default, so that the numbers are the algorithm's error (selection and
rank), not bf16 rounding; `--dtype bfloat16` measures the store as it is usually run.

The modules, one job each: `capture` (capturing; captures on disk), `metrics` (exact attention, key energy, mass,
rank-only error, capture checks), `replay` (`evaluate`: the store over a capture), `report` (`format_tables`) and
`cli` (`main`; `__main__` runs it).
"""

from ..haystack import LICENSES_DIR, PROMPT_SUFFIX, haystack_ids
from ..rope import rope, unrope
from .capture import (CAPTURE_ATTENTION, Capture, LayerCapture, capture_model, full_attention_layers, load_capture,
                      register_capture_attention, save_capture)
from .cli import main
from .metrics import (DEFAULT_FRACTIONS, capture_checks, chunk_starts, energy_ranks, full_attention, mass_of_head,
                      rank_only_error)
from .replay import DEFAULT_BUDGETS, evaluate, parse_budgets
from .report import format_tables

__all__ = [
    "CAPTURE_ATTENTION",
    "Capture",
    "DEFAULT_BUDGETS",
    "DEFAULT_FRACTIONS",
    "LICENSES_DIR",
    "LayerCapture",
    "PROMPT_SUFFIX",
    "capture_checks",
    "capture_model",
    "chunk_starts",
    "energy_ranks",
    "evaluate",
    "format_tables",
    "full_attention",
    "full_attention_layers",
    "haystack_ids",
    "load_capture",
    "main",
    "mass_of_head",
    "parse_budgets",
    "rank_only_error",
    "register_capture_attention",
    "rope",
    "save_capture",
    "unrope",
]
