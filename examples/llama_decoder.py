"""A Llama-family decoder in plain PyTorch, with its KV cache either dense (`FullAttentionCache`) or in a
shadowkv_core `KVStore` (`ShadowKVCache`). Random weights, nothing downloaded: it exists to show how a decoder is
written around the store, to test it end to end, and to benchmark it (bench/e2e_benchmark.py).

    from llama_decoder import LlamaConfig, LlamaModel, LlamaDecoder, ShadowKVCache, generate
    model = LlamaModel(LlamaConfig(), device="cuda:0")                   # Llama-3-8B shapes, bf16 on a GPU
    cache = ShadowKVCache(model, max_batch=8, max_seq_len=131072, budget=2048, rank=160)
    decoder = LlamaDecoder(model, cache)
    slot = decoder.add_sequence(prompt_ids)                              # prefills this prompt alone
    logits = decoder.decode_step([slot, other], torch.tensor([t0, t1]))  # [B, vocab], the batch together
    decoder.release(slot)

Writing your own decoder around KVStore
=======================================
The store replaces the KV cache and the attention of decode steps; everything else (embeddings, projections, RoPE,
MLP, the prompt's attention) stays the model's. Per layer:

* **Prefill** (one prompt, or a right-padded batch with `lengths=`): compute q, k, v as usual; keep the key BEFORE
  RoPE. Run the prompt's own causal attention yourself (SDPA: the store does not do prefill attention), and hand the
  layer to the store once, with the whole prompt:

      store.prefill(layer, [slot], k_pre_rope[None], v[None], q_last=q_post_rope[-1][None])
      # k_pre_rope, v: [S, Hkv, D] -> [1, S, Hkv, D] (any strides); q_last [1, Hq, D] warms the first selection

  (Only post-RoPE keys at hand, e.g. from transformers? pass them with `keys_post_rope=True`.)
  A prompt can go through the projections and the MLP in chunks (as `LlamaModel.prefill` does, to bound activation
  memory) as long as the store gets the layer's keys and values of the whole prompt in one call: a second
  `prefill` of the same (layer, slot) is an error.

* **Decode** (all sequences of the batch together, each at its own length): compute q and the new token's k, v,
  apply RoPE at each sequence's own position, and let the store attend:

      out = store.decode(layer, slots, q, k, v)       # q [B, Hq, D], k, v [B, Hkv, D] post-RoPE -> out [B, Hq, D]

  The store appends the new token and tracks positions itself (pass `positions=` only if yours are not 0, 1, 2, ...).
  `out` replaces the SDPA output: reshape to [B, Hq*D] and apply o_proj.

* Construct the store with the model's attention shapes and RoPE: `rope_theta` (or `inv_freq=` for scaled RoPE),
  `rope_style="half"` for Llama-style rotate_half, `softmax_scale` if the model does not use 1/sqrt(head_dim);
  `dtype` is the storage precision (the model's dtype is fine). `max_batch` slots and `max_seq_len` tokens per
  sequence (prompt + generated) are reserved when the store is built (the CUDA backend reserves its device and
  pinned-host arenas then), so building it is where capacity errors (`MemoryError`) appear.
* Sequences join with `store.add_sequences(1)` and leave with `store.release(slot)`; slots are reused.
* On a GPU, pass CUDA tensors and `device="cuda:0"`: the store works on torch's current stream, so no
  synchronisation is needed around its calls.

This file keeps that split behind a two-method interface (`AttentionCache.store_prompt` / `.decode`) so that the
same model runs over a dense cache or the store and the two can be compared token for token.

Prefill in chunks (`prefill_chunk`): the model is run layer by layer over the whole prompt. The projections, o_proj
and the MLP run over `prefill_chunk` tokens at a time; the layer's queries, pre-RoPE keys and values of the whole
prompt are kept (for Llama-3-8B at 122K tokens: q 1 GB, k and v 0.25 GB each, in bf16) and the prompt's causal
attention is ONE SDPA call over the whole prompt, so every token sees all earlier prompt tokens without masks or
partial-softmax merging, and the store gets each layer once. The hidden state of the whole prompt (1 GB) is kept
between layers. Only the last prompt token goes through the LM head.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "LlamaConfig",
    "LlamaModel",
    "LlamaDecoder",
    "AttentionCache",
    "FullAttentionCache",
    "ShadowKVCache",
    "generate",
    "rope_tables",
    "apply_rope",
    "prompt_attention",
    "index_tensor",
]


# ----------------------------------------------------------------------------------------------------------------------
# configuration and weights
# ----------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LlamaConfig:
    """Shapes of a Llama-family decoder; the defaults are Llama-3-8B's."""

    vocab_size: int = 128256
    hidden_size: int = 4096
    num_layers: int = 32
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02  # std of the random weights (norm weights are 1)

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small config for tests (GQA 4/2, head_dim 64: a size the CUDA kernels take). Its weights use std
        1/sqrt(hidden) so that attention is far from uniform (0.02 would make every score ~0 at hidden 64)."""
        kw = dict(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate_size=128, rope_theta=10000.0, init_std=64 ** -0.5)
        kw.update(overrides)
        return cls(**kw)

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        per_layer = (h * (self.num_q_heads + 2 * self.num_kv_heads) * d + self.num_q_heads * d * h
                     + 3 * h * self.intermediate_size + 2 * h)
        return 2 * self.vocab_size * h + self.num_layers * per_layer + h

    def kv_bytes_per_token(self, element_size: int = 2) -> int:
        """Bytes of a plain KV cache per token over all layers (keys and values)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_size


def default_dtype(device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class LayerWeights:
    """One decoder layer's weights; q/k/v and gate/up are fused (one GEMM each), split by the forward."""

    def __init__(self, cfg: LlamaConfig, make):
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_norm = make(h, ones=True)
        self.qkv = make((cfg.num_q_heads + 2 * cfg.num_kv_heads) * d, h)   # rows: q | k | v
        self.o = make(h, cfg.num_q_heads * d)
        self.post_norm = make(h, ones=True)
        self.gate_up = make(2 * cfg.intermediate_size, h)                  # rows: gate | up
        self.down = make(h, cfg.intermediate_size)


# ----------------------------------------------------------------------------------------------------------------------
# RoPE (half-split / rotate_half, as Llama)
# ----------------------------------------------------------------------------------------------------------------------

def inv_frequencies(cfg: LlamaConfig, device) -> torch.Tensor:
    """float32 [D/2]: 1 / theta^(2i/D), computed in float64 and rounded once (as shadowkv_core does)."""
    exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
    return (1.0 / cfg.rope_theta ** exponent).float().to(device)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor):
    """cos, sin float32 [N, D/2] of integer positions [N]; the angle is a float32 product (as transformers)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated at the rows' positions (cos, sin [N, D/2]); maths in float32, result in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# attention back-ends
# ----------------------------------------------------------------------------------------------------------------------

def index_tensor(values: Sequence[int], device) -> torch.Tensor:
    """int64 tensor of `values` on `device`; to a GPU through pinned memory without blocking (a plain copy from
    pageable memory would synchronise the host with the GPU on every call)."""
    t = torch.tensor(list(values), dtype=torch.long)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one prompt over itself: q [S, Hq, D], k, v [S, Hkv, D] post-RoPE -> [S, Hq, D].

    On a GPU only fused kernels are allowed: SDPA's math fallback would materialise [Hq, S, S] scores (terabytes at
    S = 122K). Where no fused kernel takes grouped KV heads, K and V are repeated per query head instead."""
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
    if not q.is_cuda:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    try:
        with sdpa_kernel(fused):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    except RuntimeError as exc:
        if "no available kernel" not in str(exc).lower():
            raise
        group = q.shape[1] // k.shape[1]
        with sdpa_kernel(fused):
            out = F.scaled_dot_product_attention(qt, kt.repeat_interleave(group, dim=1),
                                                 vt.repeat_interleave(group, dim=1), is_causal=True)
    return out[0].transpose(0, 1)


class AttentionCache:
    """What the model needs from a KV cache. Slots are sequence ids; `length(slot)` is the next token's position.

    The model calls, per layer: `store_prompt` (prefill; the prompt's attention itself is `prompt_attention`) and
    `decode` (one new token per sequence of the batch). After a whole decode step it calls `advance(slots)`.
    """

    def __init__(self):
        self._lengths = {}

    # sequences
    def add_sequence(self) -> int:
        raise NotImplementedError

    def release(self, slot: int) -> None:
        self._lengths.pop(slot, None)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def set_prompt_length(self, slot: int, length: int) -> None:
        self._lengths[slot] = int(length)

    def advance(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._lengths[s] += 1

    @property
    def active_slots(self) -> List[int]:
        return sorted(self._lengths)

    # per layer
    def store_prompt(self, layer: int, slot: int, k_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     q_last: torch.Tensor) -> None:
        """Keeps one layer of one prompt: k_pre (pre-RoPE), k (post-RoPE), v [S, Hkv, D]; q_last [Hq, D] post-RoPE.
        Copies what it keeps: the caller frees these tensors afterwards."""
        raise NotImplementedError

    def decode(self, layer: int, slots: Sequence[int], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Appends the new tokens (k, v [B, Hkv, D] post-RoPE) and returns attention of q [B, Hq, D] -> [B, Hq, D]."""
        raise NotImplementedError


_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class FullAttentionCache(AttentionCache):
    """A plain preallocated KV cache: per layer, keys and values [max_batch, Hkv, max_seq_len, D] (post-RoPE).

    Decode attention is SDPA over each sequence's valid length. The query heads of one KV head are laid out as the
    "query length" of SDPA (q [B, Hkv, G, D]), so no key/value is repeated for GQA and a ragged batch needs only a
    boolean key mask [B, 1, 1, L]. Slots forming a contiguous range (the usual case: slots 0..B-1) are attended with
    one SDPA call per layer (no mask when all lengths are equal); any other set of slots with one call per sequence
    (gathering them into one batch would copy their whole caches).
    """

    def __init__(self, cfg: LlamaConfig, max_batch: int, max_seq_len: int, device, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.max_batch, self.max_seq_len = cfg, int(max_batch), int(max_seq_len)
        self.device, self.dtype = torch.device(device), dtype
        shape = (self.max_batch, cfg.num_kv_heads, self.max_seq_len, cfg.head_dim)
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        # Zeros, not empty: a ragged batch's mask gives the padding weight 0, and 0 * NaN (uninitialised memory)
        # would still be NaN in the weighted sum of values. OutOfMemoryError here: this max_batch does not fit.
        for _ in range(cfg.num_layers):
            self.keys.append(torch.zeros(shape, device=self.device, dtype=dtype))
            self.values.append(torch.zeros(shape, device=self.device, dtype=dtype))
        self._free = list(range(self.max_batch))

    def add_sequence(self) -> int:
        if not self._free:
            raise ValueError(f"all {self.max_batch} slots of the cache are in use")
        slot = self._free.pop(0)
        self._lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._lengths:
            super().release(slot)
            self._free.append(slot)
            self._free.sort()

    def store_prompt(self, layer, slot, k_pre, k, v, q_last):
        s = k.shape[0]
        if s > self.max_seq_len:
            raise ValueError(f"prompt of {s} tokens exceeds max_seq_len {self.max_seq_len}")
        self.keys[layer][slot, :, :s] = k.transpose(0, 1)
        self.values[layer][slot, :, :s] = v.transpose(0, 1)

    def _step_indices(self, slots, lengths):
        """Index tensors and mask of one decode step, made once and reused by every layer of the step."""
        key = (tuple(slots), tuple(lengths))
        if getattr(self, "_step_key", None) != key:
            slot_t, pos_t = index_tensor(slots, self.device), index_tensor(lengths, self.device)
            mask = None
            if min(lengths) != max(lengths):  # ragged: key j of sequence b is valid when j <= its new position
                mask = (torch.arange(max(lengths) + 1, device=self.device)[None, :] <= pos_t[:, None])[:, None, None]
            self._step_key, self._step = key, (slot_t, pos_t, mask)
        return self._step

    def decode(self, layer, slots, q, k, v):
        b = len(slots)
        lengths = [self._lengths[s] for s in slots]  # position of the new token = tokens already cached
        if max(lengths) >= self.max_seq_len:
            raise ValueError(f"a sequence would exceed max_seq_len {self.max_seq_len}")
        slot_t, pos_t, mask = self._step_indices(slots, lengths)
        keys, values = self.keys[layer], self.values[layer]
        keys[slot_t, :, pos_t] = k
        values[slot_t, :, pos_t] = v
        hkv, g, d = self.cfg.num_kv_heads, self.cfg.group_size, self.cfg.head_dim
        qg = q.reshape(b, hkv, g, d)  # query head j uses KV head j // G
        first = slots[0]
        if list(slots) == list(range(first, first + b)):
            valid = max(lengths) + 1
            kk, vv = keys[first:first + b, :, :valid], values[first:first + b, :, :valid]
            # Not cuDNN: its attention builds an execution plan per key length, and the length grows by one every
            # step (suspected cause of a ~50 ms step at every batch on the H200: see docs/performance.md); flash takes
            # any length (0.84 ms a layer at B=7, S=122880, bench/probes/sdpa_decode_probe.py).
            with sdpa_kernel(_DECODE_BACKENDS):
                if mask is None:
                    # One query token per head, GQA in the kernel. Folding the G query heads into a query length
                    # of G instead leaves the kernel Hkv*B blocks (1.41 ms a layer at B=7).
                    out = F.scaled_dot_product_attention(q.reshape(b, hkv * g, 1, d), kk, vv, enable_gqa=True)
                else:
                    out = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask)
        else:
            out = torch.cat([F.scaled_dot_product_attention(qg[i:i + 1], keys[s:s + 1, :, :n + 1],
                                                            values[s:s + 1, :, :n + 1])
                             for i, (s, n) in enumerate(zip(slots, lengths))])
        return out.reshape(b, hkv * g, d)


class ShadowKVCache(AttentionCache):
    """The KV cache as a shadowkv_core `KVStore` (one store layer per model layer).

    `store_kwargs` go to KVStore unchanged (rank, budget, chunk_size, outlier_chunks, local_chunks,
    generation_window, value_store, ...); shapes, RoPE and device come from the model. Prefill hands each layer's
    pre-RoPE keys, values and the last post-RoPE query to `store.prefill`; decode is `store.decode`.
    """

    def __init__(self, model: "LlamaModel", max_batch: int, max_seq_len: int, store=None, **store_kwargs):
        super().__init__()
        cfg = model.config
        self.cfg = cfg
        if store is None:
            from shadowkv_core import KVStore

            kw = dict(rope_theta=cfg.rope_theta, rope_style="half", dtype=model.dtype, device=str(model.device))
            kw.update(store_kwargs)
            store = KVStore(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, max_batch=max_batch,
                            max_seq_len=max_seq_len, **kw)
        self.store = store

    def add_sequence(self) -> int:
        slot = self.store.add_sequences(1)[0]
        self._lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._lengths:
            super().release(slot)
            self.store.release([slot])

    def store_prompt(self, layer, slot, k_pre, k, v, q_last):
        self.store.prefill(layer, [slot], k_pre[None], v[None], q_last=q_last[None], keys_post_rope=False)

    def decode(self, layer, slots, q, k, v):
        return self.store.decode(layer, slots, q, k, v)


# ----------------------------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------------------------

class LlamaModel:
    """Weights and forward passes of a Llama-family decoder; sequences' state lives in an `AttentionCache`.

    Random weights (normal, std `config.init_std`; norm weights 1) are made directly on `device` from a seeded
    generator: `torch.empty(..., device=device).normal_(generator=g)`, so an 8B model is built in seconds on a GPU.
    """

    def __init__(self, config: LlamaConfig, device="cpu", dtype: Optional[torch.dtype] = None, seed: int = 0,
                 prefill_chunk: int = 4096):
        self.config = cfg = config
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.prefill_chunk = int(prefill_chunk)
        gen = torch.Generator(device=self.device).manual_seed(int(seed))

        def make(*shape, ones=False):
            t = torch.empty(shape, device=self.device, dtype=self.dtype)
            return t.fill_(1.0) if ones else t.normal_(0.0, cfg.init_std, generator=gen)

        with torch.no_grad():
            self.embed = make(cfg.vocab_size, cfg.hidden_size)
            self.layers = [LayerWeights(cfg, make) for _ in range(cfg.num_layers)]
            self.final_norm = make(cfg.hidden_size, ones=True)
            self.lm_head = make(cfg.vocab_size, cfg.hidden_size)
        self.inv_freq = inv_frequencies(cfg, self.device)

    # building blocks ------------------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def qkv(self, w: LayerWeights, x: torch.Tensor):
        """x [N, H] -> q [N, Hq, D], k [N, Hkv, D] (both pre-RoPE), v [N, Hkv, D]."""
        cfg = self.config
        n, d = x.shape[0], cfg.head_dim
        qkv = F.linear(self.rms_norm(x, w.input_norm), w.qkv)
        q, k, v = qkv.split([cfg.num_q_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
        return q.reshape(n, cfg.num_q_heads, d), k.reshape(n, cfg.num_kv_heads, d), v.reshape(n, cfg.num_kv_heads, d)

    def mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self.rms_norm(x, w.post_norm), w.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.down)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a row-parallel projection (o_proj, the MLP's down_proj) before it joins the residual stream.
        One process holds every head and the whole MLP, so this is the identity; a tensor-parallel model (examples/
        tp_llama_decoder.py) sums the ranks' partial results here: one all-reduce per attention block and one per
        MLP block."""
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.rms_norm(x, self.final_norm), self.lm_head).float()

    # prefill --------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, cache: AttentionCache, prompt_ids) -> tuple:
        """Prefills one prompt alone into a new slot of `cache`; returns (slot, logits of the last token [vocab]).
        On any error (e.g. out of memory) the slot is released again."""
        cfg = self.config
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(self.device)
        s = ids.numel()
        if s < 1:
            raise ValueError("empty prompt")
        slot = cache.add_sequence()
        try:
            h = self.embed[ids]                                                   # [S, H] residual stream
            cos, sin = rope_tables(torch.arange(s, device=self.device), self.inv_freq)
            chunks = [(a, min(a + self.prefill_chunk, s)) for a in range(0, s, self.prefill_chunk)]
            for layer, w in enumerate(self.layers):
                q = torch.empty(s, cfg.num_q_heads, cfg.head_dim, device=self.device, dtype=self.dtype)
                k_pre = torch.empty(s, cfg.num_kv_heads, cfg.head_dim, device=self.device, dtype=self.dtype)
                k, v = torch.empty_like(k_pre), torch.empty_like(k_pre)
                for a, b in chunks:
                    qc, kc, vc = self.qkv(w, h[a:b])
                    q[a:b] = apply_rope(qc, cos[a:b], sin[a:b])
                    k_pre[a:b] = kc
                    k[a:b] = apply_rope(kc, cos[a:b], sin[a:b])
                    v[a:b] = vc
                cache.store_prompt(layer, slot, k_pre, k, v, q[-1])
                del k_pre                                                         # caches copy what they keep
                attn = prompt_attention(q, k, v)                                  # [S, Hq, D]
                del q, k, v
                for a, b in chunks:
                    hc = h[a:b] + self.reduce(F.linear(attn[a:b].reshape(b - a, -1), w.o))
                    h[a:b] = hc + self.reduce(self.mlp(w, hc))
                del attn
            cache.set_prompt_length(slot, s)
            return slot, self.logits(h[-1:])[0]
        except BaseException:
            cache.release(slot)
            raise

    # decode ---------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode_step(self, cache: AttentionCache, slots: Sequence[int], token_ids) -> torch.Tensor:
        """One token for each sequence of `slots`, all in one batch: token_ids [B] -> logits [B, vocab] (float32)."""
        slots = [int(s) for s in slots]
        tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).to(self.device)
        if tokens.numel() != len(slots):
            raise ValueError(f"{tokens.numel()} tokens for {len(slots)} slots")
        positions = index_tensor([cache.length(s) for s in slots], self.device)
        cos, sin = rope_tables(positions, self.inv_freq)
        x = self.embed[tokens]                                                    # [B, H]
        for layer, w in enumerate(self.layers):
            q, k, v = self.qkv(w, x)
            out = cache.decode(layer, slots, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
            x = x + self.reduce(F.linear(out.reshape(len(slots), -1), w.o))
            x = x + self.reduce(self.mlp(w, x))
        cache.advance(slots)
        return self.logits(x)


class LlamaDecoder:
    """A model and one cache: the sequence-level API (sequences join one at a time, decode together)."""

    def __init__(self, model: LlamaModel, cache: AttentionCache):
        self.model, self.cache = model, cache
        self.prompt_logits = {}

    def add_sequence(self, prompt_ids) -> int:
        """Prefills `prompt_ids` alone; returns its slot. Its last-token logits are in `prompt_logits[slot]`."""
        slot, logits = self.model.prefill(self.cache, prompt_ids)
        self.prompt_logits[slot] = logits
        return slot

    def decode_step(self, slots: Sequence[int], token_ids) -> torch.Tensor:
        return self.model.decode_step(self.cache, slots, token_ids)

    def release(self, slot: int) -> None:
        self.prompt_logits.pop(slot, None)
        self.cache.release(slot)


def generate(decoder: LlamaDecoder, prompts: Iterable, max_new_tokens: int, return_logits: bool = False):
    """Greedy decoding: the prompts join one at a time (each prefilled alone), then decode together.

    Returns (slots, tokens [B, max_new_tokens] long on the CPU) and, with return_logits, the logits of every decode
    step [steps, B, vocab] (step i's logits are those that chose token i+1; token 0 comes from the prefill)."""
    slots = [decoder.add_sequence(p) for p in prompts]
    token = torch.stack([decoder.prompt_logits[s].argmax() for s in slots])
    tokens, logits = [token], []
    for _ in range(max_new_tokens - 1):
        step = decoder.decode_step(slots, token)
        token = step.argmax(-1)
        tokens.append(token)
        if return_logits:
            logits.append(step)
    result = (slots, torch.stack(tokens, dim=1).cpu())
    if return_logits:
        result += (torch.stack(logits).cpu() if logits else torch.empty(0),)
    return result


if __name__ == "__main__":  # a quick look on the CPU: the same prompts through both caches
    cfg = LlamaConfig.tiny()
    model = LlamaModel(cfg, "cpu", torch.float32, seed=0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (90, 130)]
    full = LlamaDecoder(model, FullAttentionCache(cfg, max_batch=2, max_seq_len=256, device="cpu", dtype=model.dtype))
    store = LlamaDecoder(model, ShadowKVCache(model, max_batch=2, max_seq_len=256, rank=cfg.num_kv_heads * cfg.head_dim,
                                              budget=256, chunk_size=8, outlier_chunks=1, local_chunks=1,
                                              generation_window=32))
    _, a = generate(full, prompts, 12)
    _, b = generate(store, prompts, 12)
    print("full  :", a.tolist())
    print("store :", b.tolist())
    print("identical:", bool(torch.equal(a, b)), "| store stats:", store.cache.store.stats())
