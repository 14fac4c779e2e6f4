"""Capture of real Q/K/V from a transformers model, and captures on disk (the fidelity tool's first half).

`capture_model` runs a prompt and `steps` greedy decode steps with an attention function registered through
transformers' `AttentionInterface` that records, for the chosen full-attention layers, the post-RoPE keys and values
of the prompt, the last prompt query, and every decode step's post-RoPE query, new key, new value and the model's own
attention output; forward hooks record the model's own pre-RoPE keys (the output of `k_norm` where the model has one,
as Gemma-3 and Qwen3 do, else of `k_proj`). The attention itself is the model's sdpa, unchanged. `save_capture` /
`load_capture` write and read them (fp16 `.npz`; the test fixtures under tests/fixtures/ are such captures).
"""

from __future__ import annotations

import inspect
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..decoding import attention_modules

__all__ = ["CAPTURE_ATTENTION", "Capture", "LayerCapture", "capture_model", "full_attention_layers", "load_capture",
           "register_capture_attention", "save_capture"]

CAPTURE_ATTENTION = "shadowkv_capture"


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


def _model_meta(model) -> dict:
    from ...hf import store_kwargs_for

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
    modules = attention_modules(model)
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
            # Step by step rather than model.generate: the recorder switches to its decode phase after the prefill.
            for _ in tqdm(range(steps), desc="  decode steps", disable=not verbose or not steps):
                out = model(input_ids=token[:, None], use_cache=True, logits_to_keep=1, **{cache_kw: cache})
                token = out.logits[:, -1].argmax(-1)
                generated.append(int(token))
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

