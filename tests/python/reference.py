"""Pure-PyTorch (float64) reference of docs/semantics.md.

One sequence, one layer. Every step below names the section of docs/semantics.md it implements, so the two can be
read side by side. The reference rounds to the storage dtype exactly where the semantics say the store does
(exact keys/values, landmarks, rebuilt keys: ``dtype``; the factors A and B: the factor dtype), and does all arithmetic in
float64. It is written for clarity, not speed; the shapes in the tests are small.

Conventions: keys and values are ``[T, Hkv, D]``; queries ``[Hq, D]`` (or ``[Tq, Hq, D]`` for prefill's q_last);
query head ``j`` reads KV head ``j // G``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

F64 = torch.float64
F32 = torch.float32

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=STORAGE_DTYPES[dtype]).element_size()


def round_to(x: torch.Tensor, dtype) -> torch.Tensor:
    """Round a float64 tensor to ``dtype`` (round to nearest even) and return it as float64 again."""
    if isinstance(dtype, str):
        dtype = STORAGE_DTYPES[dtype]
    return x.to(dtype).to(F64)


# --------------------------------------------------------------------------------------------------------------------
# RoPE (semantics.md "RoPE")
# --------------------------------------------------------------------------------------------------------------------

def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """``inv_freq[i] = theta^(-2i/rotary_dim)``, i < rotary_dim/2, evaluated in float64 and rounded to float32."""
    i = torch.arange(rotary_dim // 2, dtype=F64)
    return (float(theta) ** (-2.0 * i / rotary_dim)).to(F32)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``a = float32(p) * inv_freq`` computed in float32 (as transformers does). Returns float32 ``[T, R/2]``."""
    p = torch.as_tensor(positions).reshape(-1).to(torch.int64).to(F32)
    return p[:, None] * inv_freq.to(F32)[None, :]


def rope_tables(positions, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """``(cos, sin)`` float64 ``[T, R/2]``: cos/sin of the float32 angle, evaluated in float64, times the scaling."""
    a = rope_angles(positions, inv_freq).to(F64)
    return torch.cos(a) * attention_scaling, torch.sin(a) * attention_scaling


def _split_pairs(x: torch.Tensor, rotary_dim: int, style: str):
    if style == "half":
        return x[..., : rotary_dim // 2], x[..., rotary_dim // 2: rotary_dim]
    if style == "interleaved":
        return x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    raise ValueError(f"unknown rope_style {style!r}")


def _merge_pairs(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, rotary_dim: int, style: str):
    out = x.clone()
    if style == "half":
        out[..., : rotary_dim // 2] = first
        out[..., rotary_dim // 2: rotary_dim] = second
    else:
        out[..., 0:rotary_dim:2] = first
        out[..., 1:rotary_dim:2] = second
    return out


def _broadcast_table(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # tables are [T, R/2]; x is [T, R... ] or [T, H, D]: insert head axes between T and the last axis
    while t.dim() < x.dim():
        t = t.unsqueeze(-2)
    return t


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half") -> torch.Tensor:
    """RoPE of ``x`` ``[T, ..., D]`` (float64 result) with tables from :func:`rope_tables`.

    ``rope(x)_first = x1*cos - x2*sin``, ``rope(x)_second = x2*cos + x1*sin``; dims >= rotary_dim pass through.
    """
    x = x.to(F64)
    rotary_dim = 2 * cos.shape[-1]
    c, s = _broadcast_table(cos, x), _broadcast_table(sin, x)
    x1, x2 = _split_pairs(x, rotary_dim, style)
    return _merge_pairs(x, x1 * c - x2 * s, x2 * c + x1 * s, rotary_dim, style)


def unapply_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half",
                 attention_scaling: float = 1.0) -> torch.Tensor:
    """Exact inverse of :func:`apply_rope`: rotate by ``-a`` and divide by ``attention_scaling`` (rotary dims only)."""
    y = y.to(F64)
    rotary_dim = 2 * cos.shape[-1]
    # the tables carry the scaling: (cos, sin) = s * (cos a, sin a); rotating by -a and dividing by s is
    # (y1*cos a + y2*sin a) / s = (y1*cos + y2*sin) / s^2
    s2 = float(attention_scaling) ** 2
    c, s = _broadcast_table(cos, y), _broadcast_table(sin, y)
    y1, y2 = _split_pairs(y, rotary_dim, style)
    return _merge_pairs(y, (y1 * c + y2 * s) / s2, (y2 * c - y1 * s) / s2, rotary_dim, style)


# --------------------------------------------------------------------------------------------------------------------
# Full attention (the thing the store approximates)
# --------------------------------------------------------------------------------------------------------------------

def full_attention(q: torch.Tensor, keys_post: torch.Tensor, values: torch.Tensor, scale: Optional[float] = None):
    """Float64 softmax attention of one query token ``q [Hq, D]`` over ``keys_post``/``values`` ``[T, Hkv, D]``.

    GQA aware: query head ``j`` reads KV head ``j // (Hq / Hkv)``. Returns ``[Hq, D]`` float64.
    """
    q, k, v = q.to(F64), keys_post.to(F64), values.to(F64)
    hq, d = q.shape
    hkv = k.shape[1]
    assert hq % hkv == 0
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    qg = q.reshape(hkv, hq // hkv, d)                                 # [Hkv, G, D]: query heads of each KV head
    w = torch.softmax(scale * torch.einsum("hgd,thd->hgt", qg, k), dim=-1)
    return torch.einsum("hgt,thd->hgd", w, v).reshape(hq, d)


# --------------------------------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------------------------------

@dataclass
class RefConfig:
    """Same names and defaults as ``KVStore``'s keyword arguments (layers/batch/capacity left out)."""
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    inv_freq: Optional[torch.Tensor] = None
    rotary_dim: Optional[int] = None
    rope_style: str = "half"
    attention_scaling: float = 1.0
    softmax_scale: Optional[float] = None
    rank: int = 160
    chunk_size: int = 8
    budget: int = 2048                 # tokens; a multiple of chunk_size
    cache_tokens: int = 0              # selection cache slots x chunk_size; 0: the budget (semantics.md Decode 6)
    outlier_chunks: int = 48
    sink_chunks: int = 1                # of the outliers, the prompt's first chunks (attention sinks)
    local_chunks: int = 4
    generation_window: int = 256       # tokens; a multiple of chunk_size
    factorization: str = "gram"        # "gram" or "svd"
    dtype: str = "float32"
    factor_dtype: Optional[str] = None  # None/"auto": bfloat16 for 16-bit dtypes, float32 for float32 (semantics.md)
    group_score: str = "mean"           # "max" or "mean" over the group's query heads (semantics.md Decode 4)
    chunk_score: str = "landmark"       # "landmark" or "two_centroids" (semantics.md "Chunk scores")

    @classmethod
    def from_kwargs(cls, **kw) -> "RefConfig":
        """Build from a ``KVStore`` keyword dict, ignoring the store-only keys (layers, batch, device...)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in names})

    def __post_init__(self):
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if self.inv_freq is None:
            self.inv_freq = default_inv_freq(self.rope_theta, self.rotary_dim)
        else:
            self.inv_freq = torch.as_tensor(self.inv_freq).to(F32).reshape(-1)
        if self.softmax_scale is None:
            self.softmax_scale = 1.0 / math.sqrt(self.head_dim)
        assert self.budget % self.chunk_size == 0
        assert self.cache_tokens == 0 or (self.cache_tokens % self.chunk_size == 0 and self.cache_tokens >= self.budget)
        assert self.generation_window % self.chunk_size == 0
        assert self.num_q_heads % self.num_kv_heads == 0
        assert self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim
        assert self.inv_freq.numel() == self.rotary_dim // 2

    @property
    def factor_storage(self) -> str:
        """The element type A and B are held in (semantics.md "Low-rank factors")."""
        if self.factor_dtype in (None, "auto"):
            return "float32" if self.dtype == "float32" else "bfloat16"
        return self.factor_dtype

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def budget_chunks(self) -> int:
        return self.budget // self.chunk_size

    @property
    def cache_slots(self) -> int:
        """K, the selection cache's slots per KV head (k when cache_tokens is 0)."""
        return (self.cache_tokens or self.budget) // self.chunk_size


def _two_centroids(keys: torch.Tensor):
    """semantics.md "Chunk scores": the 2-means of one chunk's stored keys ``[C, D]`` (float64), encoded as two e4m3
    centroids with a float32 scale each. Returns (the decoded centroids ``[2, D]`` float64, n1 = keys in the first)."""
    keys = keys.to(F64)
    C = keys.shape[0]
    best, pair = -1.0, (0, 1 if C > 1 else 0)
    for i in range(C):
        for j in range(i + 1, C):
            dist = float(((keys[i] - keys[j]) ** 2).sum())
            if dist > best:
                best, pair = dist, (i, j)
    c1, c2 = keys[pair[0]].clone(), keys[pair[1]].clone()
    second = torch.zeros(C, dtype=torch.bool)
    for _ in range(8):
        second = ((keys - c2) ** 2).sum(-1) < ((keys - c1) ** 2).sum(-1)
        if (~second).any():
            c1 = keys[~second].sum(0) / int((~second).sum())
        if second.any():
            c2 = keys[second].sum(0) / int(second.sum())
    decoded = []
    for c in (c1, c2):
        cf = c.to(F32)
        amax = float(cf.abs().max())
        scale = torch.tensor(amax / 448.0 if amax > 0 else 1.0, dtype=F32)
        codes = (cf / scale).to(torch.float8_e4m3fn)
        decoded.append((codes.to(F32) * scale).to(F64))
    return torch.stack(decoded), C - int(second.sum())


def _min_cos(landmark: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``min_t cos(L, k_t)`` with ``cos(a, b) = a.b / max(|a||b|, 1e-30)``; landmark ``[D]``, keys ``[C, D]``."""
    dots = keys @ landmark
    norms = (keys.norm(dim=-1) * landmark.norm()).clamp_min(1e-30)
    return (dots / norms).min()


def _order(values: torch.Tensor, descending: bool) -> torch.Tensor:
    """Indices ordering ``values``, ties kept in index order (= smaller chunk id first)."""
    return torch.sort(values, descending=descending, stable=True).indices


class ReferenceStore:
    """One sequence, one layer of the store, exactly as docs/semantics.md describes it.

    Public state after each call:
      ``outliers``   list (per KV head) of sorted outlier chunk ids (fixed at prefill)
      ``selected``   list (per KV head) of sorted chunk ids of the last selection
      ``last_scores`` list (per KV head) of ``(candidate_ids, scores)`` of the last selection (float64)
      ``min_cos``    ``[n, Hkv]`` the outlier criterion at prefill
      ``hits``, ``misses``, ``chunks_rebuilt``, ``bytes_fetched``, ``selections``, ``decode_steps``, ``folds``
      ``last_hits``, ``last_misses``  counters of the last selection alone
    """

    def __init__(self, config: RefConfig):
        self.cfg = config
        c = config
        self.e = dtype_bytes(c.dtype)
        self.prefilled = False
        self.hits = self.misses = self.chunks_rebuilt = self.bytes_fetched = 0
        self.selections = self.decode_steps = self.folds = 0
        self.last_hits = self.last_misses = 0
        self.selected = [[] for _ in range(c.num_kv_heads)]
        self.outliers = [[] for _ in range(c.num_kv_heads)]
        self.last_scores = [(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=F64))
                            for _ in range(c.num_kv_heads)]
        self._empty_cache()

    # ---------------------------------------------------------------- selection cache (semantics.md Decode 6)
    def _empty_cache(self):
        """Per KV head, K slots; a slot holds ``None`` (empty) or ``[chunk id, last used step, keys, values]``."""
        self.cache_slots = [[None] * self.cfg.cache_slots for _ in range(self.cfg.num_kv_heads)]
        self.selection_step = 0

    @property
    def cache(self):
        """Per KV head: chunk id -> (keys [C, D], values [C, D]) of every chunk the cache holds."""
        return [{s[0]: (s[2], s[3]) for s in slots if s is not None} for slots in self.cache_slots]

    def _place_in_cache(self, h: int, chosen: list) -> list:
        """Puts the selection ``chosen`` (ascending ids) of head ``h`` into its slots; returns the missed ids.

        Hits (chosen chunks held by a slot) are stamped with this step. Misses, in ascending id, each take the lowest
        empty slot, else the slot not chosen at this step that was used longest ago (ties: lowest slot index). With
        K = k this keeps exactly the selection (the store's K = k path frees unselected slots instead; same hits)."""
        now = self.selection_step
        slots = self.cache_slots[h]
        held = {s[0]: i for i, s in enumerate(slots) if s is not None}
        taken = set()                                   # slot indices chosen at this step
        for ci in chosen:
            if ci in held:
                slots[held[ci]][1] = now
                taken.add(held[ci])
        missed = [ci for ci in chosen if ci not in held]
        rebuilt = self.rebuild_keys(missed, h) if missed else None
        for i, ci in enumerate(missed):
            empty = [j for j, s in enumerate(slots) if s is None]
            if empty:
                j = empty[0]
            else:
                j = min((j for j in range(len(slots)) if j not in taken), key=lambda j: (slots[j][1], j))
            slots[j] = [ci, now, rebuilt[i], self.value_store[ci, :, h].clone()]
            taken.add(j)
        return missed

    # ---------------------------------------------------------------- helpers
    def _rope(self, x, positions):
        cos, sin = rope_tables(positions, self.cfg.inv_freq, self.cfg.attention_scaling)
        return apply_rope(x, cos, sin, self.cfg.rope_style)

    def _unrope(self, y, positions):
        cos, sin = rope_tables(positions, self.cfg.inv_freq, self.cfg.attention_scaling)
        return unapply_rope(y, cos, sin, self.cfg.rope_style, self.cfg.attention_scaling)

    def _store(self, x):
        return round_to(x, self.cfg.dtype)

    def _factorise(self, k_pre_flat: torch.Tensor) -> torch.Tensor:
        """``V_r`` ``[Hkv*D, r]``: the r leading right singular vectors of ``K_pre`` (semantics.md Prefill 2)."""
        r = self.cfg.rank
        s, hd = k_pre_flat.shape
        if self.cfg.factorization == "svd":
            _, _, vh = torch.linalg.svd(k_pre_flat, full_matrices=r > min(s, hd))
            return vh[:r].T.contiguous()
        if self.cfg.factorization == "gram":
            evals, evecs = torch.linalg.eigh(k_pre_flat.T @ k_pre_flat)   # ascending
            order = torch.argsort(evals, descending=True, stable=True)
            return evecs[:, order[:r]].contiguous()
        raise ValueError(f"unknown factorization {self.cfg.factorization!r}")

    # ---------------------------------------------------------------- prefill
    def prefill(self, keys, values, positions=None, q_last=None, keys_post_rope: bool = False):
        """Prompt of ``S`` tokens: ``keys``/``values`` ``[S, Hkv, D]``, ``positions`` int ``[S]`` (default arange).

        ``q_last`` ``[Hq, D]`` or ``[Tq, Hq, D]`` (post-RoPE) runs one selection.
        """
        c = self.cfg
        C, hkv, d = c.chunk_size, c.num_kv_heads, c.head_dim
        keys, values = keys.to(F64), values.to(F64)
        S = keys.shape[0]
        assert S >= 1 and keys.shape == (S, hkv, d) and values.shape == (S, hkv, d)
        if positions is None:
            positions = torch.arange(S, dtype=torch.int64)
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        assert positions.numel() == S

        # 1. context chunks and local window
        n = max(0, S // C - c.local_chunks)
        self.prompt_len = S
        self.n_prompt_chunks = n

        # 2. K_pre (float32), factorisation, A for context rows (A, B in the factor dtype)
        k_pre = self._unrope(keys, positions) if keys_post_rope else keys
        k_pre = round_to(k_pre, F32)
        k_flat = k_pre.reshape(S, hkv * d)
        v_r = self._factorise(k_flat)
        factor = c.factor_storage
        self.B = round_to(v_r.T.contiguous(), factor)                      # [r, Hkv*D]
        self.A = round_to(round_to(k_flat[: n * C] @ self.B.T, F32), factor)  # [n*C, r]
        self.ctx_positions = positions[: n * C].clone()

        # 3. exact post-RoPE keys (rounded), landmarks
        kp = self._store(self._rope(k_pre, positions))                    # [S, Hkv, D]
        vs = self._store(values)
        kp_chunks = kp[: n * C].reshape(n, C, hkv, d)
        self.landmarks = self._store(kp_chunks.mean(dim=1))               # [n, Hkv, D]
        self.centroids = torch.zeros(n, hkv, 2, d, dtype=F64)            # chunk_score = "two_centroids"
        self.first_counts = torch.zeros(n, hkv, dtype=torch.long)
        if c.chunk_score == "two_centroids":
            for ci in range(n):
                for h in range(hkv):
                    self.centroids[ci, h], self.first_counts[ci, h] = _two_centroids(kp_chunks[ci, :, h])

        # 4. outliers: min cosine, smallest first, ties by smaller chunk id
        m = torch.empty(n, hkv, dtype=F64)
        for ci in range(n):
            for h in range(hkv):
                m[ci, h] = _min_cos(self.landmarks[ci, h], kp_chunks[ci, :, h])
        self.min_cos = m
        n_out = min(c.outlier_chunks, n)
        m = m.clone()
        m[: min(c.sink_chunks, n_out)] = -2.0      # sinks: below any cosine, so chosen first
        self.outliers = [sorted(_order(m[:, h], descending=False)[:n_out].tolist()) for h in range(hkv)]
        self.outlier_keys = kp_chunks.clone()      # only the outlier chunks' entries are ever read
        self.outlier_values = vs[: n * C].reshape(n, C, hkv, d).clone()

        # 5. value store and the exact local window
        self.value_store = vs[: n * C].reshape(n, C, hkv, d).clone()     # [chunk][C][head][D] (any layout is fine)
        self.local_keys, self.local_values = kp[n * C:].clone(), vs[n * C:].clone()
        self.local_positions = positions[n * C:].clone()
        self.gen_keys = torch.empty(0, hkv, d, dtype=F64)
        self.gen_values = torch.empty(0, hkv, d, dtype=F64)
        self.gen_positions = torch.empty(0, dtype=torch.int64)
        self.last_position = int(positions[-1])
        self._empty_cache()
        self.selected = [[] for _ in range(hkv)]
        self.prefilled = True

        # 6. optional warm-up selection
        if q_last is not None:
            q_last = q_last.to(F64)
            if q_last.dim() == 2:
                q_last = q_last.unsqueeze(0)
            self._select(q_last)

    # ---------------------------------------------------------------- selection
    @property
    def n_ctx_chunks(self) -> int:
        return self.landmarks.shape[0]

    def rebuild_keys(self, chunks, h: int) -> torch.Tensor:
        """Rebuilt post-RoPE keys ``[len(chunks), C, D]`` of context chunks of head ``h``:
        ``rope(A[t] . B[:, h*D:(h+1)*D], pos[t])`` rounded to dtype (semantics.md Decode 6).

        Chunk ids are context chunk ids (prompt context chunks, then folded chunks in folding order), not
        token index / C: the local window sits between the two."""
        C, d = self.cfg.chunk_size, self.cfg.head_dim
        if isinstance(chunks, int):
            chunks = [chunks]
        rows = torch.cat([torch.arange(c * C, (c + 1) * C) for c in chunks])
        k_pre = self.A[rows] @ self.B[:, h * d:(h + 1) * d]                 # [len*C, D]
        return self._store(self._rope(k_pre, self.ctx_positions[rows])).reshape(len(chunks), C, d)

    def _select(self, q: torch.Tensor):
        """Decode 3-6 for query tokens ``q`` ``[Tq, Hq, D]``."""
        c = self.cfg
        g, hkv = c.group, c.num_kv_heads
        self.selections += 1
        self.selection_step += 1
        self.last_hits = self.last_misses = 0
        for h in range(hkv):
            out_set = set(self.outliers[h])
            cand = torch.tensor([ci for ci in range(self.n_ctx_chunks) if ci not in out_set], dtype=torch.long)
            if cand.numel() == 0:
                self._place_in_cache(h, [])
                self.selected[h] = []
                self.last_scores[h] = (cand, torch.empty(0, dtype=F64))
                continue
            qg = q[:, h * g:(h + 1) * g]                                      # [Tq, G, D]
            if c.chunk_score == "two_centroids":
                cents = self.centroids[cand, h]                               # [Nc, 2, D]
                n1 = self.first_counts[cand, h].to(F64)
                log_w = torch.log(torch.stack([n1, c.chunk_size - n1], dim=-1) / c.chunk_size)  # log 0 = -inf
                x = c.softmax_scale * torch.einsum("tjd,cmd->tjcm", qg, cents) + log_w
                logits = torch.logsumexp(x, dim=-1)                           # [Tq, G, Nc]
            else:
                lm = self.landmarks[cand, h]                                  # [Nc, D]
                logits = c.softmax_scale * torch.einsum("tjd,cd->tjc", qg, lm)
            p = torch.softmax(logits, dim=-1)
            summed = p.sum(dim=0)                                             # sum over tokens: [G, Nc]
            score = summed.mean(dim=0) if c.group_score == "mean" else summed.max(dim=0).values
            order = _order(score, descending=True)
            k = min(c.budget_chunks, cand.numel())
            chosen = sorted(cand[order[:k]].tolist())
            self.last_scores[h] = (cand, score)
            # temporal cache: hits keep their buffers, misses are rebuilt and fetched into slots
            missed = self._place_in_cache(h, chosen)
            self.last_hits += len(chosen) - len(missed)
            self.last_misses += len(missed)
            self.selected[h] = chosen
        self.hits += self.last_hits
        self.misses += self.last_misses
        self.chunks_rebuilt += self.last_misses
        self.bytes_fetched += self.last_misses * c.chunk_size * c.head_dim * self.e

    # ---------------------------------------------------------------- decode
    def _fold(self):
        """Decode 1: the oldest C generated tokens become the next context chunk."""
        c = self.cfg
        C = c.chunk_size
        keys, values, pos = self.gen_keys[:C], self.gen_values[:C], self.gen_positions[:C]
        k_pre = self._unrope(keys, pos).reshape(C, -1)                     # un-RoPE of the stored exact keys
        a = round_to(round_to(k_pre @ self.B.T, F32), self.cfg.factor_storage)
        self.A = torch.cat([self.A, a])
        self.ctx_positions = torch.cat([self.ctx_positions, pos])
        self.landmarks = torch.cat([self.landmarks, self._store(keys.mean(dim=0))[None]])
        folded = torch.zeros(1, c.num_kv_heads, 2, c.head_dim, dtype=F64)
        counts = torch.zeros(1, c.num_kv_heads, dtype=torch.long)
        if c.chunk_score == "two_centroids":
            for h in range(c.num_kv_heads):
                folded[0, h], counts[0, h] = _two_centroids(keys[:, h])
        self.centroids = torch.cat([self.centroids, folded])
        self.first_counts = torch.cat([self.first_counts, counts])
        self.value_store = torch.cat([self.value_store, values[None]])
        self.gen_keys, self.gen_values = self.gen_keys[C:], self.gen_values[C:]
        self.gen_positions = self.gen_positions[C:]
        self.folds += 1

    def decode(self, q, k_new, v_new, position=None, k_new_post_rope: bool = True):
        """One token: ``q`` ``[Hq, D]`` post-RoPE, ``k_new``/``v_new`` ``[Hkv, D]``. Returns ``[Hq, D]`` float64."""
        assert self.prefilled, "decode before prefill"
        c = self.cfg
        C, g, d = c.chunk_size, c.group, c.head_dim
        q = q.to(F64)
        position = self.last_position + 1 if position is None else int(position)
        pos_t = torch.tensor([position], dtype=torch.int64)

        if self.gen_keys.shape[0] >= c.generation_window:                 # 1. fold
            self._fold()
        k_new = k_new.to(F64)                                              # 2. append
        if not k_new_post_rope:
            k_new = self._rope(k_new[None], pos_t)[0]
        self.gen_keys = torch.cat([self.gen_keys, self._store(k_new)[None]])
        self.gen_values = torch.cat([self.gen_values, self._store(v_new.to(F64))[None]])
        self.gen_positions = torch.cat([self.gen_positions, pos_t])
        self.last_position = position
        self.decode_steps += 1

        self._select(q[None])                                              # 3-6

        out = torch.empty(c.num_q_heads, d, dtype=F64)                     # 7. exact attention over the union
        for h in range(c.num_kv_heads):
            ks, vs = self.union_kv(h)
            qg = q[h * g:(h + 1) * g]
            w = torch.softmax(c.softmax_scale * qg @ ks.T, dim=-1)
            out[h * g:(h + 1) * g] = w @ vs
        return out

    def union_kv(self, h: int):
        """Keys and values ``[N, D]`` head ``h`` attends over: outliers ∪ local ∪ selected ∪ generated."""
        parts_k, parts_v = [], []
        for ci in self.outliers[h]:
            parts_k.append(self.outlier_keys[ci, :, h])
            parts_v.append(self.outlier_values[ci, :, h])
        parts_k.append(self.local_keys[:, h])
        parts_v.append(self.local_values[:, h])
        for ci in self.selected[h]:
            kk, vv = self.cache[h][ci]
            parts_k.append(kk)
            parts_v.append(vv)
        parts_k.append(self.gen_keys[:, h])
        parts_v.append(self.gen_values[:, h])
        return torch.cat(parts_k), torch.cat(parts_v)

    # ---------------------------------------------------------------- reports
    def sequence_info(self) -> dict:
        C = self.cfg.chunk_size
        return dict(prompt_len=self.prompt_len,
                    total_len=self.prompt_len + self.decode_steps,
                    context_chunks=self.n_ctx_chunks,
                    local_len=self.prompt_len - self.n_prompt_chunks * C,
                    generated_exact_len=int(self.gen_keys.shape[0]),
                    last_position=self.last_position)

    def memory_report(self) -> dict:
        """semantics.md "Memory report" for this (sequence, layer)."""
        c, e = self.cfg, self.e
        C, hkv, d, r = c.chunk_size, c.num_kv_heads, c.head_dim, c.rank
        info = self.sequence_info()
        n_ctx = info["context_chunks"]
        rep = dict(
            low_rank_factors=(n_ctx * C * r + r * hkv * d) * dtype_bytes(c.factor_storage),
            landmarks=n_ctx * hkv * ((2 * d + 2 * 4 + 1) if c.chunk_score == "two_centroids" else d * e),
            outliers=min(c.outlier_chunks, self.n_prompt_chunks) * C * hkv * d * 2 * e,
            exact_tokens=(info["local_len"] + info["generated_exact_len"]) * hkv * d * 2 * e,
            value_store=n_ctx * C * hkv * d * e,
            selection_cache=c.cache_slots * C * hkv * d * 2 * e,
            # the fold journal: the exact rows of every folded generated chunk (semantics.md, "Truncate")
            fold_journal=self.folds * C * hkv * d * 2 * e,
        )
        rep["total"] = sum(rep.values())
        rep["full_attention_equivalent"] = info["total_len"] * hkv * d * 2 * e
        return rep
