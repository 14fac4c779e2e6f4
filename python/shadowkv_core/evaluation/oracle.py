"""The best possible chunk selection, end to end: an upper bound for what any chunk score can reach at a budget.

`oracle_attention(spec)` makes the accuracy harness's attention function (decoding.py) attend, on the layers the
store would hold, to the chunks that hold the most true attention mass instead of the store's choice:

* prefill: dense, as for both other methods;
* every later query token (decode steps and the multi-token feeds of a conversation's next turn, one token at a time):
  per KV head, the softmax over *all* keys (exact keys: no low-rank factorisation) of each query head of the group,
  the mass of each whole prompt chunk averaged over the group's heads (the store's `group_score="mean"`), and the
  attention restricted to
    - the sink chunks and the last `local_chunks` chunks of the prompt (the store keeps both exact),
    - the prompt's tokens after its last whole chunk and every token after the prompt (the store keeps generated
      tokens exact in its window of 256 and folds older ones into chunks; here all stay: generous for long
      conversations),
    - the `outlier_chunks - sink_chunks + budget / chunk_size` other prompt chunks with the most mass (the store's
      outlier chunks, chosen at prefill by their keys, and its per-step selection, both replaced by this choice).

So it attends to as many prompt chunks as the store does, picked with knowledge of the true attention: if it falls
short of full attention at a budget, the budget bounds the task there, not the chunk score (docs/eval.md). Layers the
store does not hold (sliding windows) stay dense. CPU or GPU; float32 maths.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

__all__ = ["OracleSpec", "active_spec", "oracle_attention", "oracle_attention_forward"]

_state = threading.local()


@dataclass(frozen=True)
class OracleSpec:
    """The store settings the oracle mirrors (token counts as the store's `KVStore` arguments)."""

    prompt_length: int
    budget_tokens: int
    chunk_size: int = 8
    outlier_chunks: int = 4
    sink_chunks: int = 1
    local_chunks: int = 4
    store_layers: frozenset = frozenset()  # layer indices the store would hold (the rest stay dense)

    def __post_init__(self):
        if self.chunk_size < 1 or self.budget_tokens < 0 or self.prompt_length < 0:
            raise ValueError(f"oracle: chunk_size >= 1, budget_tokens >= 0 and prompt_length >= 0, got {self}")
        if not 0 <= self.sink_chunks <= self.outlier_chunks:
            raise ValueError(f"oracle: sink_chunks must be in [0, outlier_chunks], got {self.sink_chunks} of "
                             f"{self.outlier_chunks}")

    @property
    def chosen_chunks(self) -> int:
        """Prompt chunks picked by mass per KV head: the store's non-sink outliers plus its budget."""
        return self.outlier_chunks - self.sink_chunks + self.budget_tokens // self.chunk_size


@contextlib.contextmanager
def oracle_attention(spec: OracleSpec):
    """Within the block the harness's attention function attends as described in the module docstring."""
    _state.spec = spec
    try:
        yield spec
    finally:
        _state.spec = None


def active_spec():
    """The OracleSpec of the enclosing `oracle_attention` block, or None."""
    return getattr(_state, "spec", None)


def oracle_attention_forward(module, query, key, value, spec: OracleSpec, scaling: float):
    """([B, q_len, Hq, D], None) for a call on a store layer after the prompt: query [B, Hq, q_len, D] post-RoPE,
    key/value [B, Hkv, T, D], the last q_len of the T positions being the query tokens (a DynamicCache's layer)."""
    import torch

    batch, q_heads, q_len, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    chunk = spec.chunk_size
    whole = min(spec.prompt_length, total) // chunk  # whole prompt chunks
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling  # [B, Hq, q, T]
    position = torch.arange(total, device=query.device)
    query_position = total - q_len + torch.arange(q_len, device=query.device)
    causal = position[None, :] <= query_position[:, None]  # [q, T]
    scores = scores.masked_fill(~causal, float("-inf"))

    allowed = causal.expand(batch, q_heads, q_len, total).clone()
    if whole > 0:
        probs = torch.softmax(scores, dim=-1)
        mass = probs[..., :whole * chunk].reshape(batch, kv_heads, group, q_len, whole, chunk).sum(-1).mean(2)
        always = torch.zeros(whole, dtype=torch.bool, device=query.device)  # [whole]: sinks and the local window
        always[:min(spec.sink_chunks, whole)] = True
        always[max(0, whole - spec.local_chunks):] = True
        ranked = mass.masked_fill(always, float("-inf"))  # [B, Hkv, q, whole]
        take = min(spec.chosen_chunks, int((~always).sum()))
        keep = always.expand(batch, kv_heads, q_len, whole).clone()
        if take > 0:
            top = ranked.topk(take, dim=-1).indices
            keep.scatter_(-1, top, True)
        chunk_tokens = keep.repeat_interleave(chunk, dim=-1).repeat_interleave(group, dim=1)  # [B, Hq, q, whole*C]
        allowed[..., :whole * chunk] &= chunk_tokens
    out = torch.matmul(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1), v)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None
