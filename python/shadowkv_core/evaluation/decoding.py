"""The model side of the accuracy harness and the demo: greedy decoding through a cache, and a ShadowKVCache seeded from
a dense prefill that full attention shares.

* `register_attention()`: the adapter's attention function (`shadowkv_core.hf`) under the name "shadowkv_eval",
  recording each layer's last prompt query inside `recording_last_queries()`.
* `seed_store_cache(cache, dense, queries, modules, length)`: fills a fresh ShadowKVCache from a DynamicCache that holds
  the prompt, exactly as the adapter does during the model's own prefill (tests/python/test_eval.py checks that it
  decodes token for token like a cache filled by the model's prefill).
* `GreedyDecoder`: argmax decoding of one answer or a whole conversation (`tasks.Sample`) on one cache, or of one
  question of a document (`tasks.Document`) fed to a cache that holds the document.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
import time
from typing import Callable, List, Optional

from .tasks import PromptFormat, Sample

__all__ = ["ATTENTION_NAME", "GreedyDecoder", "attention_modules", "recording_last_queries", "register_attention",
           "seed_store_cache"]

ATTENTION_NAME = "shadowkv_eval"

_recording = threading.local()


def _eval_attention(module, query, key, value, attention_mask, **kwargs):
    """The adapter's attention function, recording each layer's last query during a recorded prefill; inside
    `oracle.oracle_attention`, the best possible chunk selection on the store's layers after the prompt."""
    import shadowkv_core.hf as skv

    from .oracle import active_spec, oracle_attention_forward

    queries = getattr(_recording, "queries", None)
    if queries is not None and query.shape[2] > 1:
        queries[module.layer_idx] = query[:, :, -1:, :].detach().clone()
    spec = active_spec()
    if spec is not None and module.layer_idx in spec.store_layers and key.shape[2] > spec.prompt_length:
        return oracle_attention_forward(module, query, key, value, spec, kwargs.get("scaling") or module.scaling)
    return skv.shadowkv_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> str:
    """Registers the recording attention function (and the sdpa mask) with transformers; returns its name for
    `model.set_attn_implementation`. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    import shadowkv_core.hf as skv

    skv.register()
    AttentionInterface.register(ATTENTION_NAME, _eval_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


@contextlib.contextmanager
def recording_last_queries():
    """Within the block, prefills through the registered attention record {layer: last query [B, Hq, 1, D]} into the
    dict this yields (for `seed_store_cache`)."""
    queries: dict = {}
    _recording.queries = queries
    try:
        yield queries
    finally:
        _recording.queries = None


def attention_modules(model) -> dict:
    """{layer index: attention module} of a transformers decoder (modules with an int `layer_idx`, `scaling` and
    `head_dim`)."""
    return {m.layer_idx: m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling") and hasattr(m, "head_dim")}


def seed_store_cache(cache, prefilled, queries: dict, modules: dict, length: int) -> None:
    """Fills a fresh ShadowKVCache from a DynamicCache that holds a `length`-token prompt (batch 1, no padding),
    as the adapter does during the model's own prefill: per full-attention layer, the cache layer's `update` with
    the prompt's post-RoPE keys/values, then the registered attention function with the last prompt query (the
    store only uses the prompt's last query, as q_last) -> `KVStore.prefill(..., keys_post_rope=True)`. Other
    layers (sliding windows) get a copy of the DynamicCache's layer."""
    import torch

    import shadowkv_core.hf as skv

    positions = torch.arange(length, dtype=torch.int64)[None]
    for idx, layer in enumerate(cache.layers):
        source = prefilled.layers[idx]
        if isinstance(layer, skv.ShadowKVLayer):
            keys, values = source.keys, source.values
            if keys is None or keys.shape[-2] != length:
                raise RuntimeError(f"layer {idx}: the prefilled cache holds {None if keys is None else keys.shape} "
                                   f"for a {length}-token prompt")
            module = modules[idx]
            layer.update(keys, values)
            skv.shadowkv_attention_forward(module, queries[idx], keys, values, None, scaling=module.scaling,
                                           position_ids=positions.to(keys.device))
            if not layer.prefilled:
                raise RuntimeError(f"layer {idx}: the adapter did not prefill the store")
        else:
            cache.layers[idx] = copy.deepcopy(source)


class GreedyDecoder:
    """Greedy decoding of an answer, or of a conversation, on one cache.

    Written out rather than `model.generate(stop_strings=...)`: generate cannot start from logits computed outside
    it (it would run the prompt's last token through the cache again, so the store's first token would come from
    a decode step instead of the dense prefill that both methods share), and it times no single decode step."""

    def __init__(self, model, tokenizer, fmt: PromptFormat) -> None:
        self.model, self.tokenizer, self.fmt = model, tokenizer, fmt
        forward = inspect.signature(type(model).forward).parameters
        self.cache_kw = "cache" if "cache" in forward else "past_key_values"
        eos = set()
        for source in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(t) for t in source)
        self.eos = eos

    def forward(self, ids: List[int], cache):
        """Logits [vocab] (float32) of the last of `ids`, fed through `cache`."""
        import torch

        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.model.device),
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[0, -1].float()

    def done(self, tokens: List[int]) -> bool:
        """An answer ends at an end-of-sequence token, or for base models (no chat template) at its first newline."""
        if tokens[-1] in self.eos:
            return True
        return self.fmt.stop_at_newline and "\n" in self.tokenizer.decode(tokens, skip_special_tokens=True)

    def answer(self, cache, logits, max_new: int, on_token: Optional[Callable[[], None]] = None) -> tuple:
        """(tokens, decode seconds, decode steps) of one answer whose first token is the argmax of `logits`; at
        most `max_new` tokens, until `done`. `on_token()` is called after each token."""
        tokens, seconds, steps = [int(logits.argmax())], 0.0, 0
        if on_token:
            on_token()
        while len(tokens) < max_new and not self.done(tokens):
            started = time.perf_counter()
            logits = self.forward([tokens[-1]], cache)
            seconds += time.perf_counter() - started
            steps += 1
            tokens.append(int(logits.argmax()))
            if on_token:
                on_token()
        return tokens, seconds, steps

    def ask(self, cache, question: List[int], max_new: int) -> dict:
        """Feeds a question's tokens (`tasks.question_prompt`) to a cache that holds the document (one forward: the
        store's `extend`) and answers it; shaped like `converse`'s result (one answer; turn_prefill_seconds: the
        question's forward)."""
        started = time.perf_counter()
        logits = self.forward(question, cache)
        question_seconds = time.perf_counter() - started
        tokens, seconds, steps = self.answer(cache, logits, max_new)
        return dict(answers=[self.tokenizer.decode(tokens, skip_special_tokens=True)], decode_seconds=seconds,
                    decode_steps=steps, turn_prefill_seconds=question_seconds)

    def converse(self, cache, first_logits, sample: Sample, max_new: int) -> dict:
        """Answers every turn of `sample`, the first from `first_logits` (the prompt's last position)."""
        answers, decode_seconds, decode_steps, turn_seconds = [], 0.0, 0, 0.0
        logits, last = first_logits, None
        for t, turn in enumerate(sample.turns):
            if t > 0:
                feed = self.fmt.encode_next(self.fmt.next(turn))
                text_of_last = self.tokenizer.decode([last], skip_special_tokens=True)
                if last not in self.eos and text_of_last.strip():
                    feed = [last] + feed
                started = time.perf_counter()
                logits = self.forward(feed, cache)
                turn_seconds += time.perf_counter() - started
            tokens, seconds, steps = self.answer(cache, logits, max_new)
            decode_seconds += seconds
            decode_steps += steps
            last = tokens[-1]
            answers.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return dict(answers=answers, decode_seconds=decode_seconds, decode_steps=decode_steps,
                    turn_prefill_seconds=turn_seconds)
