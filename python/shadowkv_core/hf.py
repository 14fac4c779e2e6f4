"""transformers adapter: `model.generate(...)` with a KVStore holding the full-attention layers' KV cache.

    import shadowkv_core.hf as skv
    cache = skv.enable(model, budget=2048, rank=160)        # switches model to attn_implementation="shadowkv"
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)

Two pieces, both in transformers' own terms:

* `ShadowKVCache`, a `transformers.Cache` whose full-attention layers are `ShadowKVLayer`s sharing one `KVStore`
  (one store layer per full-attention model layer). Other layer types (e.g. Gemma-3's sliding-window layers) keep
  transformers' own cache layer classes and attention.
* the attention function registered as ``"shadowkv"`` with `AttentionInterface` (and the same name with
  `ALL_MASK_ATTENTION_FUNCTIONS`, using the sdpa mask). For a store layer it runs the prompt through the model's
  dense sdpa attention and hands the prompt's post-RoPE keys, values, positions and last query to `KVStore.prefill`
  (pad tokens removed); later forwards go through `KVStore.decode` (one token) or `KVStore.extend` (several: a
  continued conversation's new turn, a draft to verify). Every other layer gets plain sdpa.
* `ShadowKVCache.crop` (assisted generation's rejected draft tokens) is `KVStore.truncate`.
* Copies of sequences go through `KVStore.fork`, which shares the prompt's compressed state instead of copying it:
  `num_return_sequences > 1` and beam search prefill each prompt once and fork it; beam search's `reorder_cache` forks
  the rows it keeps several times and releases those it drops; `copy.deepcopy(cache)` forks every row into new slots
  of the same store (e.g. several questions about one prefilled document).

`Cache.update` cannot return what the store holds (keys are a low-rank factorisation, values live in host memory), so
a store layer's `update` only records the new tokens' keys and values; the attention function of the same layer,
called right after it, picks them up (a thread-local hand-over, checked by layer index).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import threading
import types
from typing import Any, Optional

import torch

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shadowkv_core.hf needs transformers>=5.17,<6 (pip install 'transformers>=5.17,<6')"
    ) from exc

from ._store import KVStore

__all__ = [
    "ATTENTION_NAME",
    "ShadowKVCache",
    "ShadowKVLayer",
    "disable",
    "enable",
    "enabled",
    "make_cache",
    "register",
    "shadowkv_attention_forward",
    "store_kwargs_for",
]

ATTENTION_NAME = "shadowkv"

# RoPE variants whose inv_freq changes with the sequence length at run time: the store's tables are fixed.
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}

_local = threading.local()

# transformers >= 5.18: a cache layer's `crop(n)` takes a count to remove (negative) and `crop(0)` may shrink a sliding
# window layer; before, `crop(max_length)` (a positive value: the length to keep, so `crop(0)` would empty it).
_LAYER_CROP_REMOVES = "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters


# ---------------------------------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------------------------------

def register(name: str = ATTENTION_NAME) -> str:
    """Registers the attention function and its mask function (the sdpa mask) under `name`; idempotent."""
    AttentionInterface.register(name, shadowkv_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


# ---------------------------------------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------------------------------------

class _Pending:
    """What a store layer's `update` hands to the attention function of the same layer."""

    __slots__ = ("layer", "keys", "values", "phase")

    def __init__(self, layer: "ShadowKVLayer", keys: torch.Tensor, values: torch.Tensor, phase: str) -> None:
        self.layer, self.keys, self.values, self.phase = layer, keys, values, phase


def _take_pending(layer_idx: Optional[int]) -> Optional[_Pending]:
    pending = getattr(_local, "pending", None)
    if pending is None or pending.layer.layer_idx != layer_idx:
        return None
    _local.pending = None
    return pending


class ShadowKVLayer(CacheLayerMixin):
    """One full-attention layer of a `ShadowKVCache`; its tokens live in the owner's KVStore (layer `store_layer`).

    `keys`/`values` stay None: the store holds them. `update` returns the new tokens' keys and values unchanged and
    leaves them for the attention function. The sequence length counted here is the padded one transformers sees
    (prompt columns including left padding + tokens fed since), which is what its mask sizes need.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True  # through the owner: `ShadowKVCache.crop` truncates every store layer at once

    def __init__(self, owner: "ShadowKVCache", layer_idx: int, store_layer: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.store_layer = store_layer
        self.seq_len = 0
        self.prompt_len = 0  # columns of the prefill (left padding included): `crop` never goes below
        self.prefilled = False

    def __repr__(self) -> str:
        return f"ShadowKVLayer(layer={self.layer_idx}, store_layer={self.store_layer}, seq_len={self.seq_len})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        stale = getattr(_local, "pending", None)
        if stale is not None and stale.layer.owner is self.owner:
            _local.pending = None
            raise RuntimeError(
                f"ShadowKVCache: layer {stale.layer.layer_idx}'s new tokens were never consumed by the attention "
                f"function; the model must run with attn_implementation='{ATTENTION_NAME}' "
                f"(shadowkv_core.hf.enable(model, ...) or model.set_attn_implementation('{ATTENTION_NAME}'))"
            )
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(
                f"ShadowKVCache expects keys and values [batch, kv_heads, tokens, head_dim] of one shape, got "
                f"{list(key_states.shape)} and {list(value_states.shape)}"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _local.pending = _Pending(self, key_states, value_states, "extend" if self.prefilled else "prefill")
        self.seq_len += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seq_len = 0
        self.prompt_len = 0
        self.prefilled = False
        self.is_initialized = False

    # Rows are copied, reordered and dropped by the owner for every store layer at once (`ShadowKVCache.reorder_cache`,
    # `batch_select_indices`, `batch_repeat_interleave`: the store forks and releases whole sequences).
    def _unsupported(self, what: str) -> None:
        if self.seq_len > 0:
            raise NotImplementedError(f"ShadowKVCache: {what} the whole cache (cache.{what}(...)), not one of its "
                                      "layers: the store copies and releases whole sequences, every layer at once")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("reorder_cache")

    def crop(self, tokens_to_remove: int) -> None:
        # The store truncates all its layers at once: one layer alone cannot be cropped.
        if tokens_to_remove != 0:
            raise NotImplementedError("ShadowKVCache: crop the whole cache (cache.crop(...)), not one of its layers: "
                                      "the store removes tokens from every layer at once")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("batch_select_indices")

    def offload(self) -> None:  # the store manages its own memory
        pass

    def prefetch(self) -> None:
        pass


class ShadowKVCache(Cache):
    """A transformers `Cache` whose full-attention layers live in one `KVStore` (build it with `make_cache`).

    Each batch row of the first forward gets a store slot; the slots are released by `reset()` / `release()` (and
    when the cache is garbage-collected). Run the model with `attn_implementation="shadowkv"`.

    Args:
        store: a KVStore with one layer per full-attention model layer and `max_batch` >= the batch size.
        layer_types: the model's layer types ("full_attention" layers go to the store, in order).
        layer_kwargs: per layer, the keyword arguments of transformers' own cache layer for non-full layers
            (e.g. {"sliding_window": 512}).
    """

    def __init__(self, store: KVStore, layer_types: list, layer_kwargs: Optional[list] = None) -> None:
        layer_kwargs = layer_kwargs or [{} for _ in layer_types]
        layers: list = []
        store_layer = 0
        for idx, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                layers.append(ShadowKVLayer(self, idx, store_layer))
                store_layer += 1
            else:
                if kind not in DYNAMIC_LAYER_TYPE_MAPPING:
                    raise ValueError(f"ShadowKVCache: unknown layer type {kind!r} at layer {idx}")
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
        if store_layer == 0:
            raise ValueError("ShadowKVCache: the model has no full-attention layer for the store")
        if store.config["num_layers"] != store_layer:
            raise ValueError(f"ShadowKVCache: the store has {store.config['num_layers']} layers but the model has "
                             f"{store_layer} full-attention layers")
        super().__init__(layers=layers)
        self.store = store
        self.slots: Optional[list] = None
        self._tokens: Optional[torch.Tensor] = None  # the last generate call's sequences (see _check_generate)
        # Columns of the prompt of the generate call running on an empty cache (set by `_checked_generate`): a first
        # forward with more columns (assisted generation verifies its first draft together with the prompt) prefills
        # these and extends by the rest, so that the draft can be cropped.
        self._prompt_columns: Optional[int] = None
        # Rows per prompt of the generate call running on an empty cache (num_beams / num_return_sequences: transformers
        # repeats each prompt that often before the first forward; set by `_check_generate`): the first forward
        # prefills one row per prompt into `_sources` and forks it into the others once every store layer holds it.
        self._expand = 1
        self._sources: Optional[list] = None
        self._softmax_scale = float(store.config["softmax_scale"]) or store.config["head_dim"] ** -0.5

    @property
    def store_layers(self) -> list:
        return [layer for layer in self.layers if isinstance(layer, ShadowKVLayer)]

    # --- slots --------------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Frees this cache's store slots and forgets every layer's tokens (the cache can be used again)."""
        self._tokens = None
        for name in ("slots", "_sources"):
            slots = getattr(self, name, None)
            if slots is not None:
                setattr(self, name, None)
                self.store.release(slots)

    def reset(self) -> None:
        self.release()
        super().reset()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - never raise from a destructor
            pass

    # --- crop (assisted generation) ----------------------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """transformers' `Cache.crop`: a negative `max_length` removes that many tokens, a positive one keeps the first
        `max_length` (nothing happens if the cache holds no more), 0 removes nothing (as transformers >= 5.18 reads
        it). The store's layers lose the tokens through one `KVStore.truncate` (every layer of every row at once: the
        rows then equal sequences that never saw them); other layers (sliding-window) crop as transformers' own.

        Raises ValueError, changing nothing, when the cut would go into the prompt (the prefill's columns): the store
        only removes tokens appended after the prefill."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            if isinstance(max_length, torch.Tensor) and max_length.numel() == 1 and not max_length.is_floating_point():
                max_length = int(max_length)
            else:
                raise TypeError(f"ShadowKVCache.crop: max_length must be an int, got {max_length!r}")
        layers = self.store_layers
        held = layers[0].seq_len
        if max_length < 0:
            remove = -max_length
        else:
            remove = max(0, held - max_length) if max_length > 0 else 0
        if held == 0:
            remove = 0  # nothing stored yet: nothing to remove (as transformers' layers before their first update)
        if remove > 0:
            prompt = layers[0].prompt_len
            if held - remove < prompt:
                raise ValueError(
                    f"ShadowKVCache.crop({max_length}): would keep {held - remove} tokens but the prompt (the first "
                    f"forward, {prompt} columns) is in the store's compressed prefill, which cannot be cut; crop at most "
                    f"{held - prompt} tokens (cache.reset() drops everything)")
            self.store.truncate(self.slots, remove)
            for layer in layers:
                layer.seq_len -= remove
        for layer in self.layers:
            if not isinstance(layer, ShadowKVLayer) and (remove > 0 or _LAYER_CROP_REMOVES):
                layer.crop(-remove)  # negative: "remove that many" in every 5.x; crop(0) shrinks sliding layers

    # --- copies of rows: beam search, several sequences per prompt, deepcopy (through KVStore.fork) ----------------
    def _gather_rows(self, rows: list) -> None:
        """Row i of the store's sequences becomes what row rows[i] is now: the first use of a row keeps its slot, each
        further use is a fork of it (sharing its prompt state), and the rows no longer used are released first (so the
        forks find their slots). Raises ValueError, changing nothing, when the store has too few free slots."""
        if self.slots is None:
            return  # nothing stored yet
        old = self.slots
        if any(not 0 <= r < len(old) for r in rows):
            raise ValueError(f"ShadowKVCache: row indices {rows} out of range for {len(old)} sequences")
        if rows == list(range(len(old))):
            return
        counts: dict = {}
        for r in rows:
            counts[r] = counts.get(r, 0) + 1
        dropped = [old[j] for j in range(len(old)) if j not in counts]
        forks = len(rows) - len(counts)
        free = int(self.store.config["max_batch"]) - len(self.store.active_slots()) + len(dropped)
        if forks > free:
            raise ValueError(f"ShadowKVCache: copying rows {rows} needs {forks} more store slots but {free} are free "
                             f"(max_batch={self.store.config['max_batch']}); build the cache with a larger max_batch")
        if dropped:
            self.store.release(dropped)
        made: dict = {}
        try:
            for r, count in counts.items():
                if count > 1:
                    made[r] = self.store.fork(old[r], count - 1)
        except BaseException:
            # Out of memory: the cache cannot hold its rows; free everything it has (cache.reset() starts over).
            self.store.release([old[r] for r in counts] + [slot for children in made.values() for slot in children])
            self.slots = None
            raise
        slots, seen = [], set()
        for r in rows:
            if r in seen:
                slots.append(made[r].pop(0))
            else:
                seen.add(r)
                slots.append(old[r])
        self.slots = slots

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row beam_idx[i] (forks for rows kept several times, releases for dropped ones);
        other layers reorder as transformers' own."""
        self._gather_rows([int(i) for i in beam_idx.tolist()])
        for layer in self.layers:
            if not isinstance(layer, ShadowKVLayer):
                layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the rows `indices` (in that order; a repeated index is a fork)."""
        self._gather_rows([int(i) for i in torch.as_tensor(indices).tolist()])
        for layer in self.layers:
            if not isinstance(layer, ShadowKVLayer):
                layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows (forks of it), in place: rows i*repeats ... i*repeats + repeats - 1."""
        if self.slots is not None:
            self._gather_rows([i for i in range(len(self.slots)) for _ in range(repeats)])
        for layer in self.layers:
            if not isinstance(layer, ShadowKVLayer):
                layer.batch_repeat_interleave(repeats)

    def __deepcopy__(self, memo: dict) -> "ShadowKVCache":
        """A cache of the same store whose rows are forks of this cache's (KVStore.fork: the prompt's compressed state
        is shared, the rest copied; nothing in the store is duplicated that need not be). The copy and the original
        then evolve independently; each releases its own slots. Layers outside the store are deep-copied."""
        if self._sources is not None:
            raise RuntimeError("ShadowKVCache: cannot copy a cache whose prompt is half stored (a forward failed); "
                               "call cache.reset()")
        twin = ShadowKVCache.__new__(ShadowKVCache)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            if name not in ("store", "slots", "layers"):
                setattr(twin, name, copy.deepcopy(value, memo))
        twin.store, twin.slots = self.store, None
        layers = []
        for layer in self.layers:
            if isinstance(layer, ShadowKVLayer):
                copied = copy.copy(layer)  # counters; keys and values stay None (the store holds them)
                copied.owner = twin
                layers.append(copied)
            else:
                layers.append(copy.deepcopy(layer, memo))
        twin.layers = layers
        if self.slots is not None:
            children: list = []
            try:
                for slot in self.slots:
                    children.extend(self.store.fork(slot))
            except BaseException:
                if children:
                    self.store.release(children)
                raise
            twin.slots = children
        return twin

    def _slots_for(self, batch: int) -> list:
        if self.slots is None:
            self.slots = self.store.add_sequences(batch)
        elif len(self.slots) != batch:
            raise ValueError(f"ShadowKVCache holds {len(self.slots)} sequences but the forward has batch {batch}; "
                             "call cache.reset() before a new batch")
        return self.slots

    # --- the work, called by the attention function ------------------------------------------------------------------
    def _check_module(self, module: torch.nn.Module, scaling: Optional[float], kwargs: dict) -> None:
        scale = scaling if scaling is not None else getattr(module, "scaling", None)
        if scale is not None and not math.isclose(float(scale), self._softmax_scale, rel_tol=1e-6):
            raise ValueError(f"layer {module.layer_idx}: attention scale {scale} differs from the store's "
                             f"softmax_scale {self._softmax_scale}")
        if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("ShadowKVCache: attention logit soft-capping is not supported by the store")

    def _prefill(self, layer: ShadowKVLayer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor]) -> None:
        batch = keys.shape[0]
        n = self._expand
        if n == 1 or self.slots is not None or batch % n != 0:
            self._prefill_rows(layer, self._slots_for(batch), query, keys, values, attention_mask, position_ids)
            return
        # generate repeated each prompt n times (rows b*n ... b*n + n-1, repeat_interleave): one row per prompt enters
        # the store, and once every store layer holds it, it is forked into the other n - 1.
        if self._sources is None:
            self._sources = self.store.add_sequences(batch // n)

        def rows(tensor, dim=0):
            return tensor if tensor is None or tensor.shape[dim] != batch else tensor[::n]

        position_rows = position_ids if position_ids is None or position_ids.dim() != 2 else rows(position_ids)
        self._prefill_rows(layer, self._sources, query[::n], keys[::n], values[::n], rows(attention_mask),
                           position_rows)
        if layer is self.store_layers[-1]:
            slots = []
            for source in self._sources:
                slots += [source] + self.store.fork(source, n - 1)
            self.slots, self._sources = slots, None

    def _prefill_rows(self, layer: ShadowKVLayer, slots: list, query: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      position_ids: Optional[torch.Tensor]) -> None:
        batch, kv_heads, length, head_dim = keys.shape
        positions = _positions(position_ids, batch, length, keys.device)
        valid = _visible_tokens(attention_mask, batch, length)
        keys_bshd, values_bshd = keys.transpose(1, 2), values.transpose(1, 2)  # [B, S, Hkv, D] views
        if valid is None:
            lengths = None
            q_last = query[:, :, -1, :]
        else:
            counts = valid.sum(dim=1)
            if bool((counts == 0).any()):
                raise ValueError("ShadowKVCache: a prompt in the batch has no token that is not padding")
            # Re-pack right-padded: each row's visible tokens first, in order (a stable sort on "is padding").
            order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
            gather = order[:, :, None, None].expand(-1, -1, kv_heads, head_dim)
            keys_bshd = torch.gather(keys_bshd, 1, gather)
            values_bshd = torch.gather(values_bshd, 1, gather)
            positions = torch.gather(positions, 1, order)
            last = order.gather(1, (counts - 1)[:, None]).squeeze(1)  # index of each row's last visible token
            q_last = query[torch.arange(batch, device=query.device), :, last, :]
            lengths = counts.tolist()
        self.store.prefill(layer.store_layer, slots, keys_bshd, values_bshd, lengths=lengths,
                           positions=positions.contiguous(), q_last=q_last, keys_post_rope=True)
        layer.prefilled = True
        layer.prompt_len = length

    def _extend(self, layer: ShadowKVLayer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """New tokens on a prefilled layer: one `decode` for one token, else one `extend` for all of them (a continued
        conversation, a draft to verify): causal exact attention among them, the store's selection per block of
        `extend_block` tokens for the compressed context. Returns [B, T, Hq, D]."""
        batch, _, tokens, _ = query.shape
        slots = self._slots_for(batch)
        positions = None if position_ids is None else _positions(position_ids, batch, tokens, query.device)
        # The store takes any strides, so the tokens go in as views of transformers' [B, H, T, D] tensors.
        if tokens == 1:
            out = self.store.decode(layer.store_layer, slots, query[:, :, 0, :], keys[:, :, 0, :], values[:, :, 0, :],
                                    positions=None if positions is None else positions[:, 0])
            return out[:, None]
        return self.store.extend(layer.store_layer, slots, query.transpose(1, 2), keys.transpose(1, 2),
                                 values.transpose(1, 2), positions=None if positions is None else positions.contiguous(),
                                 k_post_rope=True)

    # --- checks made by model.generate (of a model switched by `enable`) before the prompt goes in ------------------
    def _check_generate(self, model, args: tuple, kwargs: dict) -> None:
        """Rejects, before any forward (the prefill of a long prompt is the expensive part), what would fail or go
        wrong later: contrastive search (NotImplementedError), assisted decoding by early exit (it drafts with the model's own layers) and assisted
        decoding on a cache that already holds a conversation (transformers feeds the cached tokens again);
        more sequences than the store's free slots or a batch other than the cache's (ValueError); a prompt plus `max_new_tokens` beyond the
        store's `max_seq_len` (ValueError); and a cache that holds tokens of another prompt, reused without `reset()`
        (ValueError: transformers would feed only the tokens past the cache's length, silently wrong)."""
        ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            ids = None
        embeds = kwargs.get("inputs_embeds")
        shape_from = ids if ids is not None else embeds
        config = args[1] if len(args) > 1 else kwargs.get("generation_config")
        if config is None:
            config = getattr(model, "generation_config", None)

        def setting(name, default=None):
            value = kwargs[name] if name in kwargs else getattr(config, name, None)
            return default if value is None else value

        if setting("assistant_early_exit") is not None:
            raise NotImplementedError("ShadowKVCache: assisted decoding by early exit (assistant_early_exit) runs the "
                                      "model's own first layers as the draft model and is not supported; pass a "
                                      "separate assistant_model")
        if setting("penalty_alpha") is not None and float(setting("penalty_alpha")) > 0 and int(setting("top_k", 1)) > 1:
            raise NotImplementedError("ShadowKVCache: contrastive search (penalty_alpha) is not supported; use greedy "
                                      "decoding, sampling, beam search or assisted generation")
        self._expand = 1
        if not isinstance(shape_from, torch.Tensor) or shape_from.dim() < 2:
            return  # no prompt tensor to measure (e.g. only encoder inputs): the store checks at prefill
        batch, width = int(shape_from.shape[0]), int(shape_from.shape[1])
        # transformers repeats each prompt max(num_beams, num_return_sequences) times before the first forward.
        per_prompt = max(int(setting("num_beams", 1)), int(setting("num_return_sequences", 1)))
        rows = batch * per_prompt
        config_of_store = self.store.config
        if self.slots is None:
            free = int(config_of_store["max_batch"]) - len(self.store.active_slots())
            if rows > free:
                raise ValueError(f"ShadowKVCache: generate needs {rows} sequences (batch {batch} x "
                                 f"{per_prompt} per prompt: num_beams, num_return_sequences) but the store has {free} "
                                 f"free slots (max_batch={config_of_store['max_batch']}); build the cache with a "
                                 "larger max_batch")
            self._expand = per_prompt
        elif rows != len(self.slots):
            raise ValueError(f"ShadowKVCache holds {len(self.slots)} sequences but generate has {rows}; call "
                             "cache.reset() before a new batch")

        held = max((layer.seq_len for layer in self.store_layers), default=0)
        if held > 0 and (kwargs.get("assistant_model") is not None or setting("prompt_lookup_num_tokens") is not None):
            # transformers (5.25) runs the first verification of assisted decoding over the whole input, cached columns
            # included: its own DynamicCache then holds the conversation twice (209 tokens become 368).
            raise NotImplementedError(
                f"ShadowKVCache: assisted generation on a cache that already holds {held} tokens (a continued "
                "conversation): transformers feeds the whole conversation again in its first verification step (its "
                "own DynamicCache stores it twice); generate this turn without the assistant, or start from an empty "
                "cache")
        if held > 0 and ids is not None:
            recorded = self._tokens
            if recorded is not None and (width <= held or recorded.shape[0] != batch or recorded.shape[1] < held
                                         or not torch.equal(ids[:, :held].detach().cpu(), recorded[:, :held])):
                raise ValueError(
                    f"ShadowKVCache: the cache holds {held} tokens of an earlier generate call, and the new input_ids "
                    "do not continue them (a continued conversation passes the previous call's sequences followed "
                    "by the new tokens); call cache.reset() before generating for a new prompt")

        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch and held == 0:
            prompt = int(mask.to(torch.int64).sum(dim=1).max())  # left padding does not enter the store
        else:
            prompt = width  # a continued conversation: every new column enters the store
        new_tokens = setting("max_new_tokens")
        if new_tokens is None:
            new_tokens = max(0, int(setting("max_length", 20)) - width)
        new_tokens = int(new_tokens)
        if held > 0:  # tokens already in the store (its longest sequence) + every input column past the cache's
            before = max(int(self.store.sequence_info(self.store_layers[0].store_layer, slot)["total_len"])
                         for slot in self.slots)
            entering = width - held
        else:
            before, entering = 0, prompt
        need = before + entering + new_tokens - 1  # the last generated token is never fed back
        capacity = int(config_of_store["max_seq_len"])
        if new_tokens > 0 and need > capacity:
            held_text = f"{before} tokens held + " if before else ""
            raise ValueError(
                f"ShadowKVCache: generate would put up to {need} tokens into a sequence ({held_text}{entering} of the "
                f"input + max_new_tokens {new_tokens} - 1: the last token is not fed back) but the store takes "
                f"max_seq_len={capacity}; make the cache with a larger max_seq_len or ask for fewer new tokens")

    def __repr__(self) -> str:
        return f"ShadowKVCache(store={self.store!r}, slots={self.slots}, layers={self.layers})"


def _positions(position_ids: Optional[torch.Tensor], batch: int, length: int, device) -> torch.Tensor:
    """int64 [B, T] positions (transformers may pass [1, T] for a whole batch, or nothing)."""
    if position_ids is None:
        return torch.arange(length, device=device, dtype=torch.int64)[None].expand(batch, -1)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[-1] != length:
        raise ValueError(f"ShadowKVCache: position_ids of shape {list(position_ids.shape)} for {length} tokens "
                         "(3-D / multimodal RoPE positions are not supported)")
    return position_ids.to(dtype=torch.int64).expand(batch, -1)


def _visible_tokens(attention_mask: Optional[torch.Tensor], batch: int, length: int) -> Optional[torch.Tensor]:
    """Which prompt columns the last prompt token attends to ([B, S] bool), or None for all of them.

    With a causal mask that is every token that is not padding; the sdpa mask is None when nothing is padded."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != length:
        raise ValueError(f"ShadowKVCache: unexpected prefill mask of shape {list(attention_mask.shape)} for a "
                         f"{length}-token prompt (mask function must be the sdpa mask)")
    row = attention_mask[:, 0, -1, :]
    if row.dtype != torch.bool:  # additive float mask: 0 where visible, a very negative number elsewhere
        row = row > torch.finfo(row.dtype).min / 2
    row = row.expand(batch, -1)
    if bool(row.all()):
        return None
    return row


# ---------------------------------------------------------------------------------------------------------------------
# the attention function
# ---------------------------------------------------------------------------------------------------------------------

def shadowkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                               scaling: Optional[float] = None, **kwargs: Any):
    """`AttentionInterface` function: store layers of a `ShadowKVCache` go through the store, the rest through sdpa.

    query [B, Hq, q_len, D] post-RoPE; key/value [B, Hkv, T, D] as returned by the cache. Returns
    ([B, q_len, Hq, D], None)."""
    pending = _take_pending(getattr(module, "layer_idx", None))
    if pending is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer, cache = pending.layer, pending.layer.owner
    if key.shape != pending.keys.shape:
        raise RuntimeError(f"layer {layer.layer_idx}: the attention got keys {list(key.shape)} but the cache "
                           f"stored {list(pending.keys.shape)}")
    cache._check_module(module, scaling, kwargs)
    position_ids = kwargs.get("position_ids")
    if pending.phase == "extend":
        return cache._extend(layer, query, key, value, position_ids), None
    length = key.shape[2]
    prompt = cache._prompt_columns
    if prompt is None or prompt >= length:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
        cache._prefill(layer, query, key, value, attention_mask, position_ids)
        return out, None
    # The first forward holds the prompt and more (assisted generation's first draft): the prompt is prefilled as
    # usual (its own causal sdpa), the columns after it are extended, exactly as later drafts are.
    if position_ids is not None and position_ids.dim() != 2:
        position_ids = _positions(position_ids, query.shape[0], length, query.device)
    head_mask = None if attention_mask is None else attention_mask[..., :prompt, :prompt]
    head_kwargs = dict(kwargs)
    if position_ids is not None:
        head_kwargs["position_ids"] = position_ids[:, :prompt]
    out, _ = sdpa_attention_forward(module, query[:, :, :prompt], key[:, :, :prompt], value[:, :, :prompt], head_mask,
                                    dropout=dropout, scaling=scaling, **head_kwargs)
    cache._prefill(layer, query[:, :, :prompt], key[:, :, :prompt], value[:, :, :prompt], head_mask,
                   None if position_ids is None else position_ids[:, :prompt])
    tail = cache._extend(layer, query[:, :, prompt:], key[:, :, prompt:], value[:, :, prompt:],
                         None if position_ids is None else position_ids[:, prompt:])
    return torch.cat([out, tail.to(out.dtype)], dim=1), None


# ---------------------------------------------------------------------------------------------------------------------
# building a cache from a model
# ---------------------------------------------------------------------------------------------------------------------

def _text_config(model):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _layer_types(text_config) -> tuple[list, list]:
    """(layer types, per-layer kwargs of transformers' cache layer classes), as DynamicCache(config=...) builds them."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        types, kwargs = get_layer_types_and_kwargs(text_config)
        if isinstance(kwargs, dict):  # transformers < 5.2x: one kwargs dict shared by all layers
            kwargs = [dict(kwargs) for _ in types]
        return list(types), list(kwargs)
    except ImportError:  # older 5.x: layer_types, else everything full attention unless a sliding window is set
        n = text_config.num_hidden_layers
        types = getattr(text_config, "layer_types", None)
        if types is None:
            window = getattr(text_config, "sliding_window", None)
            types = ["sliding_attention" if window is not None else "full_attention"] * n
        kwargs = [{"sliding_window": text_config.sliding_window} if t == "sliding_attention" else {} for t in types]
        return list(types), kwargs


def _rotary_module(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    candidates = [getattr(decoder, "rotary_emb", None)] + list(model.modules())
    for module in candidates:
        if module is None:
            continue
        if isinstance(getattr(module, "full_attention_inv_freq", None), torch.Tensor):
            return module
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "attention_scaling"):
            return module
    raise ValueError("shadowkv_core.hf: found no rotary embedding (inv_freq) in the model; only RoPE models work")


def _rotary(model):
    """(inv_freq, attention_scaling, rope_type) of the rotary embedding the full-attention layers use."""
    module = _rotary_module(model)
    if isinstance(getattr(module, "full_attention_inv_freq", None), torch.Tensor):  # per layer type (Gemma-3)
        rope_type = getattr(module, "rope_type", {})
        rope_type = rope_type.get("full_attention") if isinstance(rope_type, dict) else rope_type
        return module.full_attention_inv_freq, float(module.full_attention_attention_scaling), rope_type
    return module.inv_freq, float(module.attention_scaling), getattr(module, "rope_type", None)


def _attention_scale(model, layer_types: list) -> float:
    scales = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and isinstance(getattr(module, "scaling", None), float) and hasattr(module, "head_dim"):
            if idx < len(layer_types) and layer_types[idx] == "full_attention":
                scales[idx] = module.scaling
    if not scales:
        raise ValueError("shadowkv_core.hf: found no attention module with a `scaling` attribute")
    values = set(scales.values())
    if len(values) > 1:
        raise ValueError(f"shadowkv_core.hf: full-attention layers use different scales {sorted(values)}")
    return values.pop()


def _model_device(model) -> str:
    device = next(model.parameters()).device
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def _plan_layers(model, max_seq_len: int) -> tuple[list, list]:
    """Layer types for the cache: "full_attention" layers go to the store. A "sliding_attention" layer whose window
    is at least max_seq_len is full attention in effect (e.g. Mistral-7B-v0.1, window 4096) and goes to the store
    too, when all layers share one rotary embedding."""
    types, kwargs = _layer_types(_text_config(model))
    types, kwargs = list(types), [dict(k) for k in kwargs]
    shared_rotary = not isinstance(getattr(_rotary_module(model), "full_attention_inv_freq", None), torch.Tensor)
    for i, kind in enumerate(types):
        window = kwargs[i].get("sliding_window")
        if kind == "sliding_attention" and shared_rotary and window is not None and window >= max_seq_len:
            types[i], kwargs[i] = "full_attention", {}
    return types, kwargs


def _default_max_seq_len(model) -> int:
    return min(int(getattr(_text_config(model), "max_position_embeddings", 131072) or 131072), 131072)


def store_kwargs_for(model, max_seq_len: Optional[int] = None) -> dict:
    """The model-derived KVStore keyword arguments: layer count, heads, head_dim, RoPE tables, softmax scale,
    max_seq_len, dtype and device. Raises ValueError / NotImplementedError for models the adapter does not handle."""
    config = _text_config(model)
    if max_seq_len is None:
        max_seq_len = _default_max_seq_len(model)
    layer_types, _ = _plan_layers(model, max_seq_len)
    if "full_attention" not in layer_types:
        raise ValueError(f"shadowkv_core.hf: the model has no full-attention layer for the store (layer types "
                         f"{sorted(set(layer_types))}; a sliding window >= max_seq_len = {max_seq_len} counts as full)")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("shadowkv_core.hf: bidirectional attention is not supported")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise NotImplementedError("shadowkv_core.hf: attention logit soft-capping is not supported")
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    inv_freq, attention_scaling, rope_type = _rotary(model)
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise NotImplementedError(f"shadowkv_core.hf: rope_type {rope_type!r} changes its frequencies with the "
                                  "sequence length; the store's RoPE tables are fixed")
    rotary_dim = 2 * inv_freq.numel()
    if rotary_dim > head_dim:
        raise ValueError(f"shadowkv_core.hf: {inv_freq.numel()} RoPE frequencies for head_dim {head_dim}")
    dtype = next(model.parameters()).dtype
    return dict(
        num_layers=sum(t == "full_attention" for t in layer_types),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        inv_freq=inv_freq.detach().float().cpu(),
        rotary_dim=rotary_dim,
        rope_style="half",
        attention_scaling=attention_scaling,
        softmax_scale=_attention_scale(model, layer_types),
        dtype=str(dtype).split(".")[-1],
        device=_model_device(model),
    )


def make_cache(model, *, budget: int = 2048, rank: Optional[int] = None, max_batch: int = 1,
               max_seq_len: Optional[int] = None, chunk_size: int = 8, outlier_chunks: int = 48,
               local_chunks: int = 4, generation_window: int = 256, factorization: str = "gram",
               dtype: Any = None, device: Any = None, value_store: str = "host", sink_chunks: int = 1,
               value_dtype: Any = None, check_finite: str = "auto", group_score: str = "mean",
               chunk_score: str = "landmark", extend_block: int = 32,
               store: Optional[KVStore] = None) -> ShadowKVCache:
    """A `ShadowKVCache` for `model`, with a new KVStore built from the model's config (or the given `store`).

    budget: selected tokens per KV head per decode step (a multiple of chunk_size). rank: rank of the key
    factorisation (default min(160, num_kv_heads * head_dim)). max_batch: sequences per generate call.
    max_seq_len: prompt (with its left padding excluded) + generated tokens per sequence (default: the model's
    max_position_embeddings, at most 131072). dtype/device: the store's storage precision and device (default: the
    model's). extend_block: tokens of one forward (a chat turn, a draft to verify) that share one selection of the
    compressed context (1: exactly one decode step per token). The other arguments are KVStore's. The model must run with attn_implementation="shadowkv" (`enable`)."""
    register()
    if store is None:
        kwargs = store_kwargs_for(model, max_seq_len)
        if rank is None:
            rank = min(160, kwargs["num_kv_heads"] * kwargs["head_dim"])
        if dtype is not None:
            kwargs["dtype"] = dtype
        if device is not None:
            kwargs["device"] = str(device)
        store = KVStore(max_batch=max_batch, rank=rank, chunk_size=chunk_size, budget=budget,
                        outlier_chunks=outlier_chunks, sink_chunks=sink_chunks, local_chunks=local_chunks,
                        generation_window=generation_window, factorization=factorization,
                        value_store=value_store, value_dtype=value_dtype, check_finite=check_finite,
                        group_score=group_score, chunk_score=chunk_score, extend_block=extend_block, **kwargs)
    layer_types, layer_kwargs = _plan_layers(model, int(store.config["max_seq_len"]))
    return ShadowKVCache(store, layer_types, layer_kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# switching a model on and off
# ---------------------------------------------------------------------------------------------------------------------

_PREVIOUS_ATTENTION = "_shadowkv_previous_attn_implementation"


def enable(model, **kwargs) -> ShadowKVCache:
    """Registers the "shadowkv" attention, switches `model` to it, and returns `make_cache(model, **kwargs)`.

    Layers that are not in a ShadowKVCache (or a forward without one) run plain sdpa, so the switched model still
    works with transformers' own caches. `model.generate` gets checks made before the prompt goes in when it is
    given a ShadowKVCache (contrastive search, batch and length beyond the store, a cache holding another
    conversation: see `_check_generate`), and with num_beams or num_return_sequences > 1 the store prefills each prompt
    once and forks it. `disable(model)` undoes both; `enabled(model, ...)` is the context-manager form."""
    register()
    cache = make_cache(model, **kwargs)
    current = getattr(model.config, "_attn_implementation", None)
    if current != ATTENTION_NAME:
        setattr(model, _PREVIOUS_ATTENTION, current)
    model.set_attn_implementation(ATTENTION_NAME)
    if not _has_checked_generate(model):
        # A bound method in the instance's dict (not a closure): copy.deepcopy(model) rebinds it to the copy.
        model.generate = types.MethodType(_checked_generate, model)
    return cache


def disable(model, attn_implementation: Optional[str] = None) -> None:
    """Switches `model` back to the attention it had before `enable` (or to `attn_implementation`; "sdpa" when
    unknown) and removes the checks `enable` added to `model.generate`. Caches made for it stay usable only by a
    model switched to "shadowkv" again; `cache.release()` frees their store slots."""
    previous = model.__dict__.pop(_PREVIOUS_ATTENTION, None)
    if _has_checked_generate(model):
        del model.generate
    target = attn_implementation or previous or "sdpa"
    if getattr(model.config, "_attn_implementation", None) != target:
        model.set_attn_implementation(target)


@contextlib.contextmanager
def enabled(model, **kwargs):
    """`with shadowkv_core.hf.enabled(model, budget=..., rank=...) as cache:` -- `enable(model, **kwargs)` on entry;
    on exit the cache's store slots are released and the model's attention is restored (`disable`), unless the model
    was already switched to "shadowkv" on entry (then it stays so)."""
    was_enabled = getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME
    cache = enable(model, **kwargs)
    try:
        yield cache
    finally:
        cache.release()
        if not was_enabled:
            disable(model)


def _has_checked_generate(model) -> bool:
    method = model.__dict__.get("generate")
    return isinstance(method, types.MethodType) and method.__func__ is _checked_generate


def _checked_generate(self, *args, **kwargs):
    """`model.generate` of a model switched by `enable`: with a ShadowKVCache, checks the call before any forward
    (`ShadowKVCache._check_generate`) and records the sequences it returns (to recognise a continued conversation)."""
    cache = None
    for name in ("cache", "past_key_values"):
        if isinstance(kwargs.get(name), ShadowKVCache):
            cache = kwargs[name]
    if cache is None:
        return type(self).generate(self, *args, **kwargs)
    cache._check_generate(self, args, kwargs)
    cache._tokens = None
    if max((layer.seq_len for layer in cache.store_layers), default=0) == 0:
        ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids", kwargs.get("inputs_embeds")))
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            cache._prompt_columns = int(ids.shape[1])
    try:
        out = type(self).generate(self, *args, **kwargs)
    finally:
        cache._prompt_columns = None
        cache._expand = 1
    sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if isinstance(sequences, torch.Tensor):
        cache._tokens = sequences.detach().to("cpu", copy=True)
    return out


register()
