"""KVStore: the Python face of shadowkv::kv_store. It converts arguments and allocates outputs; the native store
validates everything and does all the work. Tensors cross by DLPack without copies (torch, numpy, or any
framework with __dlpack__)."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

from . import _core

_DTYPE_NAMES = {"float32", "fp32", "float", "float16", "fp16", "half", "bfloat16", "bf16"}


def build_info() -> dict:
    """What this build contains: version, whether CUDA was compiled, backends, visible CUDA devices, BLAS."""
    return _core.build_info()


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"
    return text.split(".")[-1]


def _slot_list(slots: Union[int, Iterable[int]]) -> list:
    if isinstance(slots, int):
        return [slots]
    return [int(s) for s in slots]


def _plain(name: str, tensor: Any) -> Any:
    """Returns a DLPack-exportable view of `tensor` (torch: detached), or raises ValueError naming the problem."""
    if tensor is None:
        return None
    device = getattr(tensor, "device", None)
    device_type = getattr(device, "type", None)
    if device_type is not None and device_type not in ("cpu", "cuda"):
        raise ValueError(f"{name} lives on device '{device}', expected cpu or cuda")
    if hasattr(tensor, "detach"):
        tensor = tensor.detach()
    if not hasattr(tensor, "__dlpack__") and not hasattr(tensor, "__array_interface__"):
        raise ValueError(f"{name} must be a tensor or array (DLPack), got {type(tensor).__name__}")
    return tensor


def _stream_of(tensor: Any) -> Optional[int]:
    """The current CUDA stream (an integer handle; 0 is the legacy default stream) of a torch CUDA tensor's device,
    so that the store's work is ordered after the caller's; None for other tensors."""
    device = getattr(tensor, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream)


def _empty_like(reference: Any, shape: Sequence[int]) -> Any:
    """A new uninitialised array of `shape` with the dtype and device of `reference` (torch or numpy)."""
    if hasattr(reference, "new_empty"):
        return reference.new_empty(tuple(shape))
    import numpy as np

    if isinstance(reference, np.ndarray):
        return np.empty(tuple(shape), dtype=reference.dtype)
    raise ValueError(f"cannot allocate an output like {type(reference).__name__}; pass torch tensors or numpy arrays")


class KVStore:
    """A ShadowKV key/value store for all layers of a model and up to `max_batch` sequences.

    Keys are kept as a per-sequence low-rank factorisation, values in a (host) value store, and each decode step
    attends exactly over outliers, the local window, the selected chunks and the generated tokens.
    Every call validates its arguments first; a rejected call raises ValueError (MemoryError when memory runs out)
    and leaves the store as it was.

    Args:
        num_layers, num_q_heads, num_kv_heads, head_dim: the model's attention shapes (any GQA ratio, MHA, MQA).
        max_batch: sequence slots. max_seq_len: tokens per sequence (prompt + generated).
        rope_theta | inv_freq: RoPE frequencies (inv_freq wins; e.g. a model's scaled `inv_freq`).
        rotary_dim: rotated dims per head (default head_dim). rope_style: "half" (rotate_half) or "interleaved".
        attention_scaling: multiplies cos/sin (transformers' attention_scaling).
        softmax_scale: scale of q·k (default 1/sqrt(head_dim)); also used for landmark scores.
        rank: rank of the key factorisation. chunk_size: tokens per chunk.
        budget: selected tokens per KV head per step (a multiple of chunk_size).
        outlier_chunks, local_chunks: chunks kept exact. generation_window: exact generated tokens kept before the
            oldest chunk is folded into the compressed store (a multiple of chunk_size).
        factorization: "gram" (eigenvectors of KᵀK, default) or "svd".
        dtype: storage precision of keys/values ("bfloat16", "float16", "float32" or a torch dtype).
        device: "cpu" or "cuda:N".
        value_store: where each sequence's values live: "host" (pinned host memory on GPUs; the default),
            "device" (GPU memory: no PCIe traffic), or "auto" (GPU memory while `device_value_budget` lasts, then
            host; decided per sequence when it joins, never split). `sequence_info(...)["values_on"]` tells where.
        value_dtype: format of the value store: None (the store's dtype) or "float8_e4m3" ("fp8"): e4m3 codes with
            one float32 scale per (chunk, KV head) — half of bf16's bytes in memory and over PCIe; values are
            dequantized to `dtype` when fetched. `value_store="host_fp8"` is short for value_store="host",
            value_dtype="float8_e4m3". Exact tokens (outliers, local window, generated) keep `dtype`.
        device_value_budget: bytes of device memory the values of "auto" sequences may take together. Default:
            on CUDA, the device memory free after the store's own reservations less a margin (5%, at least 2 GiB),
            measured when the store is built — pass a budget when the model still needs memory after that; on the
            CPU, no limit.
    """

    def __init__(
        self,
        num_layers: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_batch: int = 1,
        max_seq_len: int = 4096,
        *,
        rope_theta: float = 10000.0,
        inv_freq: Optional[Any] = None,
        rotary_dim: Optional[int] = None,
        rope_style: str = "half",
        attention_scaling: float = 1.0,
        softmax_scale: Optional[float] = None,
        rank: int = 160,
        chunk_size: int = 8,
        budget: int = 2048,
        outlier_chunks: int = 48,
        local_chunks: int = 4,
        generation_window: int = 256,
        factorization: str = "gram",
        dtype: Any = "bfloat16",
        device: Any = "cpu",
        value_store: str = "host",
        device_value_budget: Optional[int] = None,
        value_dtype: Optional[Any] = None,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if budget < chunk_size or budget % chunk_size != 0:
            raise ValueError(
                f"budget must be a positive multiple of chunk_size ({chunk_size}) tokens, got {budget}"
            )
        dtype_name = _dtype_name(dtype)
        if dtype_name not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
        cfg = _core.Config()
        cfg.num_layers = num_layers
        cfg.num_q_heads = num_q_heads
        cfg.num_kv_heads = num_kv_heads
        cfg.head_dim = head_dim
        cfg.max_batch = max_batch
        cfg.max_seq_len = max_seq_len
        cfg.rope_theta = float(rope_theta)
        if inv_freq is not None:
            values = inv_freq.tolist() if hasattr(inv_freq, "tolist") else list(inv_freq)
            cfg.inv_freq = [float(v) for v in values]
        cfg.rotary_dim = 0 if rotary_dim is None else rotary_dim
        cfg.rope_style = rope_style
        cfg.attention_scaling = float(attention_scaling)
        cfg.softmax_scale = 0.0 if softmax_scale is None else float(softmax_scale)
        cfg.rank = rank
        cfg.chunk_size = chunk_size
        cfg.budget_chunks = budget // chunk_size
        cfg.outlier_chunks = outlier_chunks
        cfg.local_chunks = local_chunks
        cfg.generation_window = generation_window
        cfg.factorization = factorization
        cfg.dtype = dtype_name
        if value_store in ("host_fp8", "device_fp8", "auto_fp8"):
            if value_dtype is not None and _dtype_name(value_dtype) not in ("float8_e4m3", "float8_e4m3fn", "fp8"):
                raise ValueError(f"value_store={value_store!r} stores fp8 values; value_dtype={value_dtype!r} contradicts it")
            value_store, value_dtype = value_store[: -len("_fp8")], "float8_e4m3"
        cfg.value_store = value_store
        if value_dtype is not None and _dtype_name(value_dtype) != dtype_name:
            cfg.value_format = _dtype_name(value_dtype)
        if device_value_budget is not None:
            if isinstance(device_value_budget, bool) or int(device_value_budget) != device_value_budget:
                raise ValueError(f"device_value_budget must be a whole number of bytes, got {device_value_budget!r}")
            if device_value_budget < 0:
                raise ValueError(f"device_value_budget must be >= 0 bytes, got {device_value_budget}")
            cfg.device_value_budget = int(device_value_budget)
        self._config = cfg
        self._store = _core.Store(cfg, str(device))

    # --- sequences -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self._store.device

    @property
    def config(self) -> dict:
        """The store's configuration as a dict."""
        names = [n for n in dir(self._config) if not n.startswith("_") and n != "validate"]
        return {n: getattr(self._config, n) for n in names}

    def add_sequences(self, count: int = 1) -> list:
        """Takes `count` free slots and returns their ids (ValueError when fewer are free). Each new sequence's
        value store is reserved here, where `value_store` says (MemoryError, naming the bytes, when it fits nowhere;
        then no slot is taken)."""
        return self._store.add_sequences(count)

    @property
    def device_value_budget(self) -> int:
        """Device bytes the values of value_store="auto" sequences may take (the given budget or the default)."""
        return self._store.device_value_budget

    @property
    def value_bytes_per_sequence(self) -> int:
        """Bytes one sequence's value store reserves (all layers, at max_seq_len), on the device or the host."""
        return self._store.value_bytes_per_sequence

    def release(self, slots: Union[int, Iterable[int]]) -> None:
        """Frees the slots' memory; their ids can be reused by add_sequences."""
        self._store.release(_slot_list(slots))

    def active_slots(self) -> list:
        return self._store.active_slots()

    # --- per layer -------------------------------------------------------------------------------------------------
    def prefill(
        self,
        layer: int,
        slots: Union[int, Iterable[int]],
        keys: Any,
        values: Any,
        lengths: Optional[Any] = None,
        positions: Optional[Any] = None,
        q_last: Optional[Any] = None,
        keys_post_rope: bool = False,
    ) -> None:
        """Stores one layer of the prompts of `slots`.

        keys, values: [B, S, Hkv, D] (any strides; e.g. transformers' [B, Hkv, S, D] tensor `.transpose(1, 2)`).
        Keys are pre-RoPE unless keys_post_rope=True (the store then removes RoPE itself).
        lengths: tokens per row for right-padded batches (default S). positions: int [B, S] (default 0..S-1).
        q_last: post-RoPE queries [B, Hq, D] or [B, Tq, Hq, D] of the prompt's end, to warm the selection.
        """
        if lengths is None:
            length_list = []
        elif hasattr(lengths, "tolist"):
            length_list = [int(v) for v in lengths.tolist()]
        else:
            length_list = [int(v) for v in lengths]
        self._store.prefill(
            layer,
            _slot_list(slots),
            _plain("keys", keys),
            _plain("values", values),
            length_list,
            _plain("positions", positions),
            _plain("q_last", q_last),
            bool(keys_post_rope),
            _stream_of(keys),
        )

    def decode(
        self,
        layer: int,
        slots: Union[int, Iterable[int]],
        q: Any,
        k_new: Any,
        v_new: Any,
        positions: Optional[Any] = None,
        k_new_post_rope: bool = True,
        out: Optional[Any] = None,
    ) -> Any:
        """One decode step of one layer: stores the new token (k_new, v_new [B, Hkv, D]) and returns the
        attention output [B, Hq, D] of the post-RoPE query q [B, Hq, D], in q's dtype and on q's device.
        positions: int [B] (default: each sequence's last position + 1). out: optional preallocated output."""
        q = _plain("q", q)
        if out is None:
            shape = tuple(getattr(q, "shape", ()))
            if len(shape) != 3:
                raise ValueError(f"q must have shape [B, Hq, D], got {list(shape)}")
            out = _empty_like(q, shape)
        self._store.decode(
            layer,
            _slot_list(slots),
            q,
            _plain("k_new", k_new),
            _plain("v_new", v_new),
            _plain("out", out),
            _plain("positions", positions),
            bool(k_new_post_rope),
            _stream_of(q),
        )
        return out

    def account_replayed_steps(self, layer: int, slots: Union[int, Iterable[int]], steps: int) -> None:
        """Tells the store that a CUDA graph captured around `decode(layer, slots, ...)` was replayed `steps` times
        (each replay advances the device state by one step). Capture after one eager decode with the same slots;
        tensors, shapes and slots are fixed for the graph."""
        self._store.account_replayed_steps(layer, _slot_list(slots), int(steps))

    # --- inspection ------------------------------------------------------------------------------------------------
    def selected_chunks(self, layer: int, slot: int) -> list:
        """Chunk ids of the last selection of (layer, slot), one ascending list per KV head."""
        return self._store.selected_chunks(layer, slot)

    def outlier_chunks(self, layer: int, slot: int) -> list:
        """Outlier chunk ids of (layer, slot), one ascending list per KV head."""
        return self._store.outlier_chunks(layer, slot)

    def sequence_info(self, layer: int, slot: int) -> dict:
        """prompt_len, total_len, context_chunks, outlier_chunks, local_len, generated_exact_len, last_position,
        values_on ("device" or "host": where the sequence's value store is)."""
        return self._store.sequence_info(layer, slot)

    def memory_report(self) -> dict:
        """Bytes held by kind (see docs/semantics.md) with their total and what a plain KV cache would take."""
        return self._store.memory_report()

    def stats(self) -> dict:
        """decode_steps, selections, hits, misses, hit_rate, chunks_rebuilt, bytes_fetched, folds."""
        return self._store.stats()

    def reset_stats(self) -> None:
        self._store.reset_stats()

    def __repr__(self) -> str:
        c = self._config
        return (
            f"KVStore(layers={c.num_layers}, heads={c.num_q_heads}/{c.num_kv_heads}, head_dim={c.head_dim}, "
            f"rank={c.rank}, budget={c.budget_chunks * c.chunk_size}, device='{self.device}', dtype={c.dtype})"
        )
