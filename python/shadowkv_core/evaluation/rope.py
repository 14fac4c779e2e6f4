"""The tooling's one RoPE helper: half-split rotary embedding (transformers' `rotate_half`, as Llama, Qwen3 and
Gemma-3 apply it) and its inverse, on [T, H, D] tensors at positions [T].

Angles are computed in float32 (`float32(position) * inv_freq`, as transformers computes them) and then cast to the
working `dtype` (float64 by default: the fidelity tool's exact reference; the synthetic demo uses float32). Only the
first 2 * len(inv_freq) dims rotate (partial rotary); the others pass through. The store's own RoPE is in C++
(docs/semantics.md); tests/python/reference.py holds the tests' independent reference.
"""

from __future__ import annotations

import torch

__all__ = ["rope", "rope_tables", "rotate_half", "unrope"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (-x2, x1) for the halves x1 = x[..., :D/2], x2 = x[..., D/2:]."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                dtype: torch.dtype = torch.float64):
    """cos, sin [T, 2 * len(inv_freq)] in `dtype`, from float32 angles, both multiplied by attention_scaling."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    angles = torch.cat((angles, angles), dim=-1).to(dtype)
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
         dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Post-RoPE [T, H, D] (in `dtype`) of pre-RoPE x [T, H, D] at positions [T]."""
    rot = 2 * inv_freq.numel()
    cos, sin = rope_tables(positions, inv_freq, attention_scaling, dtype)
    k = x.to(dtype)
    kr, rest = k[..., :rot], k[..., rot:]
    post = kr * cos[:, None, :] + rotate_half(kr) * sin[:, None, :]
    return torch.cat((post, rest), dim=-1) if rot < k.shape[-1] else post


def unrope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
           dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Pre-RoPE [T, H, D] (in `dtype`) of post-RoPE x: rotate back by the same angles and divide the rotary dims by
    attention_scaling (the inverse of `rope`)."""
    rot = 2 * inv_freq.numel()
    cos, sin = rope_tables(positions, inv_freq, 1.0, dtype)
    k = x.to(dtype)
    kr, rest = k[..., :rot], k[..., rot:]
    pre = (kr * cos[:, None, :] - rotate_half(kr) * sin[:, None, :]) / attention_scaling
    return torch.cat((pre, rest), dim=-1) if rot < k.shape[-1] else pre
