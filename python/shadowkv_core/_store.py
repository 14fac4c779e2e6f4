"""KVStore: the Python face of shadowkv::kv_store. It converts arguments and allocates outputs; the native store
validates everything and does all the work. Tensors cross by DLPack without copies (torch, numpy, or any
framework with __dlpack__)."""

from __future__ import annotations

import atexit
import operator
import os
import sys
import warnings
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

from . import _core

_DTYPE_NAMES = {"float32", "fp32", "float", "float16", "fp16", "half", "bfloat16", "bf16"}

# Ranges of the native integer arguments: C int (layers, slots, shapes, counts) and int64 (token counts).
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


# --- argument conversion (docs/errors.md): exact types, no silent coercion ------------------------------------------
def _is_numpy_bool(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _is_bool(value: Any) -> bool:
    """True for Python and numpy bools and for boolean tensors/arrays (which also convert to integers)."""
    return isinstance(value, bool) or _is_numpy_bool(value) or "bool" in str(getattr(value, "dtype", ""))


def _integer(name: str, value: Any, bounds: tuple = _INT32) -> int:
    """`value` as an int: a Python int or anything with __index__ (numpy/torch integers), never a bool, str, float or
    None (TypeError); ValueError outside `bounds` (the native argument's C type)."""
    if _is_bool(value):
        raise TypeError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    low, high = bounds
    if not low <= result <= high:
        kind = "a C int" if bounds == _INT32 else "an int64"
        raise ValueError(f"{name} = {result} is out of range: it must fit {kind} [{low}, {high}]")
    return result


def _real(name: str, value: Any) -> float:
    """`value` as a float: an int or float (or numpy scalar), never a bool, str or None (TypeError)."""
    if _is_bool(value) or isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}") from None


def _flag(name: str, value: Any) -> bool:
    """`value` as a bool: only True or False (or a numpy bool) — a string such as "False" is a TypeError."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    return value


def _integer_list(name: str, values: Any, bounds: tuple = _INT32) -> list:
    """A sequence (list, tuple, 1-d tensor/array) of integers as a list of ints; a str is a TypeError."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of integers, got {type(values).__name__} {values!r}")
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of integers, got {type(values).__name__} {values!r}") from None
    return [_integer(f"{name}[{i}]", v, bounds) for i, v in enumerate(items)]


def _inv_freq(values: Any) -> list:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"inv_freq must be a sequence of numbers, got {type(values).__name__} {values!r}")
    items = values.tolist() if hasattr(values, "tolist") else values
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"inv_freq must be a sequence of numbers, got {type(values).__name__} {values!r}") from None
    if not items:
        raise ValueError("inv_freq is empty: pass rotary_dim/2 inverse frequencies, or None to use rope_theta")
    return [_real(f"inv_freq[{i}]", v) for i, v in enumerate(items)]


def _path(value: Any) -> bytes:
    """A file path (str, bytes or os.PathLike) as the filesystem's bytes; anything else is a TypeError."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(f"path must be a str or os.PathLike, got {type(value).__name__} {value!r}") from None
    return os.fsencode(path)


def build_info() -> dict:
    """What this build contains: version, whether CUDA was compiled, backends, visible CUDA devices, BLAS, and the
    CUDA architectures the kernels were compiled for (CMake's syntax, e.g. ``["90a-real", "90-virtual"]``)."""
    return _core.build_info()


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"
    return text.split(".")[-1]


def _slot_list(slots: Union[int, Iterable[int]]) -> list:
    """One slot id or a sequence of them (list, tuple, range, 1-d integer tensor/array) as a list of C ints."""
    if type(slots) in (list, tuple) and all(type(s) is int for s in slots):
        # The common case, checked without a call per slot (a decode step's fixed cost; see _exported).
        if slots and not (_INT32[0] <= min(slots) and max(slots) <= _INT32[1]):
            return _integer_list("slots", slots)  # raises, naming the slot out of range
        return list(slots)
    if _is_bool(slots) and getattr(slots, "ndim", 0) == 0:
        raise TypeError(f"slots must be a slot id or a sequence of slot ids, got a bool ({slots!r})")
    if hasattr(slots, "__index__") and getattr(slots, "ndim", 0) == 0:
        return [_integer("slots", slots)]
    if not isinstance(slots, (str, bytes)) and not hasattr(slots, "__iter__") and not hasattr(slots, "tolist"):
        raise TypeError(f"slots must be a slot id or a sequence of slot ids, got {type(slots).__name__} {slots!r}")
    return _integer_list("slots", slots)


def _torch_tensor_type() -> Any:
    """torch.Tensor when torch is imported (a tensor of it can only exist then), else None: no import of torch here."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


def _plain(name: str, tensor: Any) -> Any:
    """Returns a DLPack-exportable view of `tensor` (torch: detached), or raises ValueError naming the problem."""
    if tensor is None:
        return None
    if type(tensor) is _torch_tensor_type():
        # A plain torch tensor (not a subclass such as Parameter): the same checks from its cheap attributes.
        if not (tensor.is_cpu or tensor.is_cuda):
            raise ValueError(f"{name} lives on device '{tensor.device}', expected cpu or cuda")
        return tensor.detach() if tensor.requires_grad else tensor
    device = getattr(tensor, "device", None)
    device_type = getattr(device, "type", None)
    if device_type is not None and device_type not in ("cpu", "cuda"):
        raise ValueError(f"{name} lives on device '{device}', expected cpu or cuda")
    if hasattr(tensor, "detach"):
        tensor = tensor.detach()
    if not hasattr(tensor, "__dlpack__") and not hasattr(tensor, "__array_interface__"):
        raise ValueError(f"{name} must be a tensor or array (DLPack), got {type(tensor).__name__}")
    return tensor


def _required(name: str, tensor: Any) -> Any:
    """As _plain for an argument that must be given (None is a ValueError naming it, like any non-tensor)."""
    if tensor is None:
        raise ValueError(f"{name} must be a tensor or array (DLPack), got None")
    return _plain(name, tensor)


_to_dlpack = None  # torch.utils.dlpack.to_dlpack, once a torch tensor has been passed


def _exported(tensor: Any) -> Any:
    """What the native call imports fastest of a tensor that _plain returned: for a plain torch tensor its DLPack
    capsule from torch.utils.dlpack.to_dlpack (~0.5 µs; nanobind's own call of Tensor.__dlpack__ takes ~8 µs, about
    40 µs a decode step for its five tensors), else the tensor itself. The same memory, shape, strides, dtype and
    device either way, and no stream synchronisation either way (Tensor.__dlpack__ as nanobind calls it does none:
    the store orders its work after the caller's current stream itself). A tensor that to_dlpack refuses goes the
    general way, with that way's errors."""
    global _to_dlpack
    if tensor is None or type(tensor) is not _torch_tensor_type():
        return tensor
    if _to_dlpack is None:
        from torch.utils.dlpack import to_dlpack

        _to_dlpack = to_dlpack
    try:
        return _to_dlpack(tensor)
    except Exception:  # noqa: BLE001 - e.g. a sparse tensor: the general path reports it
        return tensor


_raw_streams: dict = {}  # device index -> torch._C._cuda_getCurrentRawStream once it agreed with the public call, or None


def _stream_of(tensor: Any) -> Optional[int]:
    """The current CUDA stream (an integer handle; 0 is the legacy default stream) of a torch CUDA tensor's device,
    so that the store's work is ordered after the caller's; None for other tensors.

    torch.cuda.current_stream(device) builds a Stream object each call (a few µs of a decode call's fixed cost). For a
    plain torch tensor the handle comes from torch._C._cuda_getCurrentRawStream (what torch's compiler uses), after its
    first answer on the device has been checked against the public call; where it is missing or disagrees, the public
    call answers every time."""
    if type(tensor) is _torch_tensor_type():
        if not tensor.is_cuda:
            return None
        index = tensor.get_device()
        raw = _raw_streams.get(index, False)
        if raw:
            return int(raw(index))
        if raw is False:
            import torch

            public = int(torch.cuda.current_stream(index).cuda_stream)
            candidate = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            try:
                agrees = candidate is not None and int(candidate(index)) == public
            except Exception:  # noqa: BLE001 - a changed private API: keep the public call
                agrees = False
            _raw_streams[index] = candidate if agrees else None
            return public
    device = getattr(tensor, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream)


def _new_like(reference: Any, shape: Sequence[int], zeros: bool = False) -> Any:
    """A new array of `shape` with the dtype and device of `reference` (torch or numpy): uninitialised, or zero."""
    if hasattr(reference, "new_empty"):
        return reference.new_zeros(tuple(shape)) if zeros else reference.new_empty(tuple(shape))
    import numpy as np

    if isinstance(reference, np.ndarray):
        return (np.zeros if zeros else np.empty)(tuple(shape), dtype=reference.dtype)
    raise ValueError(f"cannot allocate an output like {type(reference).__name__}; pass torch tensors or numpy arrays")


def _output_for(q: Any, out: Optional[Any], shape_text: str, zeros: bool = False) -> Any:
    """`out` when given, else a new array shaped like q ([B, Hq, D] for decode, [B, T, Hq, D] for extend)."""
    if out is not None:
        return out
    shape = tuple(getattr(q, "shape", ()))
    if len(shape) != shape_text.count(",") + 1:
        raise ValueError(f"q must have shape {shape_text}, got {list(shape)}")
    return _new_like(q, shape, zeros=zeros)


class ParkedSequence:
    """A sequence parked out of a KVStore by `KVStore.park`: its whole state (every layer) in host memory, its slot
    free for other sequences. `KVStore.resume` puts it back, bit for bit, into the store that parked it (once; the
    object is empty afterwards); dropping it frees its memory (docs/semantics.md, "Fork, park and save").

    tokens: the sequence's tokens (prompt + generated, as in layer 0; 0 once resumed). host_bytes: the host memory it
    holds (0 once resumed). parked_from: the slot it had when it was parked."""

    __slots__ = ("_parked", "__weakref__")

    def __init__(self, native: Any) -> None:
        if not isinstance(native, _core.ParkedSequence):
            raise TypeError("ParkedSequence objects are made by KVStore.park")
        self._parked = native
        _live_parked.add(self)

    @property
    def tokens(self) -> int:
        return self._parked.tokens

    @property
    def host_bytes(self) -> int:
        return self._parked.host_bytes

    @property
    def parked_from(self) -> int:
        return self._parked.parked_from

    def __repr__(self) -> str:
        if self._parked.empty:
            return f"ParkedSequence(resumed, parked_from={self.parked_from})"
        return (f"ParkedSequence(tokens={self.tokens}, host_bytes={self.host_bytes}, "
                f"parked_from={self.parked_from})")


class MemoryFootprintWarning(ResourceWarning):
    """Warned once when a KVStore is built whose configuration holds more bytes per token than full attention (a plain
    KV cache of the same tokens in the same dtype) would. The rule: the bytes one (sequence, layer) holds right after
    a prefill of `max_seq_len` tokens (low-rank factors, landmarks or centroids, outliers, the local window, the value
    store and the selection cache: `KVStore.layer_memory_after_prefill(max_seq_len)`, equal to what `memory_report()`
    then shows) against `max_seq_len * 2 * num_kv_heads * head_dim * dtype bytes`. It happens with small models and
    short contexts (e.g. SmolLM2's 3 KV heads of 64 at 4K tokens with the defaults: the selection cache of `budget`
    tokens and rank 160 cost more than the keys they replace). Shown by default (unless -W options are given); silence
    it with ``warnings.filterwarnings("ignore", category=shadowkv_core.MemoryFootprintWarning)``."""


# Warnings of this class are shown by default (ResourceWarning itself is ignored by Python's default filters), unless
# the interpreter was given -W options, which then decide.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=MemoryFootprintWarning)


def _footprint_message(store: "KVStore", report: dict) -> str:
    c = store._config
    full = report["full_attention_equivalent"]
    parts = ", ".join(f"{kind} {report[kind]}" for kind in (
        "low_rank_factors", "landmarks", "outliers", "exact_tokens", "value_store", "selection_cache"))
    return (
        f"this KVStore holds {report['total'] / full:.2f}x the bytes of full attention: one (sequence, layer) at "
        f"max_seq_len={c.max_seq_len} tokens takes {report['total']} bytes ({parts}) against {full} bytes as a plain KV "
        f"cache ({report['total'] / c.max_seq_len:.1f} against {full / c.max_seq_len:.1f} bytes per token) with "
        f"num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, rank={c.rank}, budget={c.budget}, "
        f"cache_tokens={c.cache_tokens}, outlier_chunks={c.outlier_chunks}, dtype={c.dtype}. Lower rank, budget or "
        f"cache_tokens: the store saves memory on long contexts (MemoryFootprintWarning, docs/api.md)")


# Live stores and parked sequences, so that their native objects are freed at interpreter exit (see _close_at_exit).
_live_stores: "weakref.WeakSet" = weakref.WeakSet()
_live_parked: "weakref.WeakSet" = weakref.WeakSet()


class _Closed:
    """Stands in for a store's native objects after interpreter exit began: any use says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("this KVStore was closed at interpreter exit (its memory is freed)")


@atexit.register
def _close_at_exit() -> None:
    """Frees the native store and configuration of every KVStore still alive when the interpreter exits (atexit runs
    before modules are torn down). Python does not promise to destroy every object at exit — one held by a daemon
    thread, for instance — and nanobind would then report its instances as leaked ("nanobind: leaked 2 instances");
    freeing them here also runs the store's destructor while the CUDA runtime is still loaded."""
    for store in list(_live_stores):
        store._store = store._config = _Closed()
    for parked in list(_live_parked):  # likewise the parked sequences' native objects (ParkedSequence)
        parked._parked = _Closed()


class KVStore:
    """A ShadowKV key/value store for all layers of a model and up to `max_batch` sequences.

    Keys are kept as a per-sequence low-rank factorisation, values in a (host) value store, and each decode step
    attends exactly over outliers, the local window, the selected chunks and the generated tokens.
    Every call validates its arguments first; a rejected call raises ValueError (TypeError for an argument of the wrong
    type, MemoryError when memory runs out) and leaves the store as it was (docs/errors.md). Threads may share a
    store: its calls are serialised (docs/semantics.md, "Threads").

    Args:
        num_layers, num_q_heads, num_kv_heads, head_dim: the model's attention shapes (any GQA ratio, MHA, MQA).
        max_batch: sequence slots. max_seq_len: tokens per sequence (prompt + generated).
        rope_theta | inv_freq: RoPE frequencies (inv_freq wins; e.g. a model's scaled `inv_freq`).
        rotary_dim: rotated dims per head (default head_dim). rope_style: "half" (rotate_half) or "interleaved".
        attention_scaling: multiplies cos/sin (transformers' attention_scaling).
        softmax_scale: scale of q·k (default 1/sqrt(head_dim)); also used for landmark scores.
        rank: rank of the key factorisation, 1 to num_kv_heads*head_dim; None (default) means
            min(160, num_kv_heads*head_dim). chunk_size: tokens per chunk.
        budget: selected tokens per KV head per step (a positive multiple of chunk_size; more than max_seq_len is
            clamped, docs/semantics.md "Capacity and errors").
        cache_tokens: capacity of the selection cache per (sequence, layer, KV head) in tokens: 0 (default) means
            `budget` (the cache holds the last selection only); a larger multiple of chunk_size keeps chunks selected
            earlier (least recently selected evicted first), so that more selections hit and fewer chunks are rebuilt
            and fetched (docs/semantics.md, Decode 6). Its bytes are `selection_cache` in memory_report(). Both
            backends, with the same slot rule.
        outlier_chunks, local_chunks: chunks kept exact. sink_chunks: how many of the outlier chunks are the prompt's
            first chunks, always (attention sinks), the rest chosen by the min-cosine rule. generation_window: exact generated tokens kept before the
            oldest chunk is folded into the compressed store (a multiple of chunk_size).
        extend_block: tokens of an `extend` call that share one selection (1: extend equals one decode per token).
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
        group_score: how a chunk's score combines the query heads of a KV head's group: "mean" (default) or "max" of
            their softmax probabilities (docs/semantics.md, Decode 4; docs/fidelity.md measures both).
        chunk_score: what a chunk's score of one query head is computed from: "landmark" (default: the mean of the
            chunk's keys, one row per chunk and KV head) or "two_centroids" (a 2-means of the chunk's keys, two fp8
            centroids and a count: log(w1·exp(s·q·c1) + w2·exp(s·q·c2)); docs/semantics.md, "Chunk scores").
            On CUDA its scoring kernel is not tuned yet: ~3.4 ms a layer at B=24, S=122880 against 0.32 ms for
            landmarks (docs/performance.md; session 8).
        factor_dtype: element type of the low-rank key factors A and B: None/"auto" (bfloat16 for bfloat16 and
            float16 stores, float32 for float32 stores), "bfloat16" (half the bytes of the largest per-sequence
            array; A and B are rounded once, docs/semantics.md "Low-rank factors") or "float32".
        decode_pipeline_parts: on CUDA, cut the decode batch into this many parts (2-8, never more than the batch) so
            that the PCIe fetch of one part overlaps the selection of the next, and attention runs part by part as
            the values arrive. 0 (default) lets the backend choose: 3 parts from 16 sequences when any of their values
            are in host memory, else one (measured at B=24: docs/performance.md).
        device_value_budget: bytes of device memory the values of "auto" sequences may take together. Default:
            on CUDA, the device memory free after the store's own reservations less a margin (5%, at least 2 GiB),
            measured when the store is built — pass a budget when the model still needs memory after that; on the
            CPU, no limit.
        check_finite: which inputs are checked for NaN/±Inf (ValueError, nothing changed; docs/semantics.md
            "Non-finite inputs"): "auto" (default: prefill inputs always; decode inputs on the CPU, not on CUDA, where
            the check waits for the GPU on every call), "prefill" (prefill inputs only) or "always" (decode inputs too;
            on CUDA one stream synchronisation per decode call). An unchecked NaN/Inf at decode is stored as given
            and makes that sequence's outputs non-finite; other sequences are not affected.

    Keys are post-RoPE in both prefill and decode by default (what transformers hands an attention function);
    `prefill(..., keys_post_rope=False)` and `decode(..., k_new_post_rope=False)` take pre-RoPE keys.

    Warns MemoryFootprintWarning once, when it is built, if the configuration holds more bytes per token than full
    attention would at max_seq_len (see that class).
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
        rank: Optional[int] = None,
        chunk_size: int = 8,
        budget: int = 2048,
        cache_tokens: int = 0,
        outlier_chunks: int = 48,
        sink_chunks: int = 1,
        local_chunks: int = 4,
        generation_window: int = 256,
        extend_block: int = 32,
        factorization: str = "gram",
        dtype: Any = "bfloat16",
        device: Any = "cpu",
        value_store: str = "host",
        device_value_budget: Optional[int] = None,
        value_dtype: Optional[Any] = None,
        factor_dtype: Optional[Any] = None,
        group_score: str = "mean",
        decode_pipeline_parts: int = 0,
        chunk_score: str = "landmark",
        check_finite: str = "auto",
    ) -> None:
        # Exact argument types first (docs/errors.md): integers within their C types, real numbers, strings.
        num_layers, num_q_heads = _integer("num_layers", num_layers), _integer("num_q_heads", num_q_heads)
        num_kv_heads, head_dim = _integer("num_kv_heads", num_kv_heads), _integer("head_dim", head_dim)
        max_batch, max_seq_len = _integer("max_batch", max_batch), _integer("max_seq_len", max_seq_len, _INT64)
        rope_theta, attention_scaling = _real("rope_theta", rope_theta), _real("attention_scaling", attention_scaling)
        inv_freq = None if inv_freq is None else _inv_freq(inv_freq)
        rotary_dim = None if rotary_dim is None else _integer("rotary_dim", rotary_dim)
        softmax_scale = None if softmax_scale is None else _real("softmax_scale", softmax_scale)
        if rank is None:
            rank = 0  # the native default: min(160, num_kv_heads*head_dim)
        else:
            rank = _integer("rank", rank)
            if rank == 0:  # 0 is the C++ config's spelling of the default; here the default is None
                raise ValueError(f"rank must be in [1, num_kv_heads*head_dim = {num_kv_heads * head_dim}] "
                                 f"(None: min(160, num_kv_heads*head_dim)), got 0")
        chunk_size = _integer("chunk_size", chunk_size)
        budget = _integer("budget", budget, _INT64)
        cache_tokens = _integer("cache_tokens", cache_tokens, _INT64)
        outlier_chunks = _integer("outlier_chunks", outlier_chunks)
        sink_chunks = _integer("sink_chunks", sink_chunks)
        local_chunks = _integer("local_chunks", local_chunks)
        generation_window = _integer("generation_window", generation_window)
        extend_block = _integer("extend_block", extend_block)
        rope_style, factorization = _text("rope_style", rope_style), _text("factorization", factorization)
        check_finite = _text("check_finite", check_finite)
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
        cfg.budget = budget
        cfg.cache_tokens = cache_tokens
        cfg.outlier_chunks = outlier_chunks
        cfg.sink_chunks = sink_chunks
        cfg.local_chunks = local_chunks
        cfg.generation_window = generation_window
        cfg.extend_block = extend_block
        cfg.factorization = factorization
        cfg.dtype = dtype_name
        value_store = _text("value_store", value_store)
        if value_store in ("host_fp8", "device_fp8", "auto_fp8"):
            if value_dtype is not None and _dtype_name(value_dtype) not in ("float8_e4m3", "float8_e4m3fn", "fp8"):
                raise ValueError(f"value_store={value_store!r} stores fp8 values; value_dtype={value_dtype!r} contradicts it")
            value_store, value_dtype = value_store[: -len("_fp8")], "float8_e4m3"
        cfg.value_store = value_store
        if value_dtype is not None and _dtype_name(value_dtype) != dtype_name:
            cfg.value_format = _dtype_name(value_dtype)
        if device_value_budget is not None:
            device_value_budget = _integer("device_value_budget", device_value_budget, _INT64)
            if device_value_budget < 0:
                raise ValueError(f"device_value_budget must be >= 0 bytes, got {device_value_budget}")
            cfg.device_value_budget = device_value_budget
        cfg.decode_pipeline_parts = _integer("decode_pipeline_parts", decode_pipeline_parts)
        cfg.group_score = _text("group_score", group_score)
        cfg.chunk_score = _text("chunk_score", chunk_score)
        if factor_dtype is not None:
            factor_name = _dtype_name(factor_dtype)
            factor_name = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}.get(factor_name, factor_name)
            if factor_name not in ("auto", "float32", "bfloat16"):
                raise ValueError(f"factor_dtype must be None, 'auto', 'float32' or 'bfloat16', got {factor_dtype!r}")
            cfg.factor_format = factor_name
        cfg.check_finite = check_finite
        self._store = _core.Store(cfg, str(device))
        if cfg.rank == 0:
            cfg.rank = self._store.config.rank  # the default, as resolved
        self._config = cfg
        _live_stores.add(self)
        report = self._store.layer_memory_after_prefill(self._config.max_seq_len)
        if report["total"] > report["full_attention_equivalent"]:
            warnings.warn(_footprint_message(self, report), MemoryFootprintWarning, stacklevel=2)

    # --- sequences -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return self._store.device

    @property
    def config(self) -> dict:
        """The store's configuration as a dict, as given (after argument conversion; a budget beyond max_seq_len is
        shown as given, not clamped), with a default rank (None) resolved to min(160, num_kv_heads*head_dim)."""
        names = [n for n in dir(self._config) if not n.startswith("_") and n != "validate"]
        return {n: getattr(self._config, n) for n in names}

    def add_sequences(self, count: int = 1) -> list:
        """Takes `count` free slots and returns their ids (ValueError when fewer are free). Each new sequence's
        value store is reserved here, where `value_store` says (MemoryError, naming the bytes, when it fits nowhere;
        then no slot is taken)."""
        return self._store.add_sequences(_integer("count", count))

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
        keys_post_rope: bool = True,
    ) -> None:
        """Stores one layer of the prompts of `slots`.

        keys, values: [B, S, Hkv, D] (any strides; e.g. transformers' [B, Hkv, S, D] tensor `.transpose(1, 2)`).
        Keys are post-RoPE (at `positions`), as decode's k_new and as transformers hands them to an attention
        function; the store removes RoPE for the factorisation. keys_post_rope=False: pre-RoPE keys.
        lengths: tokens per row for right-padded batches (default S). positions: int [B, S] (default 0..S-1).
        q_last: post-RoPE queries [B, Hq, D] or [B, Tq, Hq, D] of the prompt's end, to warm the selection.
        """
        length_list = [] if lengths is None else _integer_list("lengths", lengths, _INT64)
        self._store.prefill(
            _integer("layer", layer),
            _slot_list(slots),
            _required("keys", keys),
            _required("values", values),
            length_list,
            _plain("positions", positions),
            _plain("q_last", q_last),
            _flag("keys_post_rope", keys_post_rope),
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
        """One decode step of one layer: stores the new token (k_new, v_new [B, Hkv, D]; k_new post-RoPE unless
        k_new_post_rope=False) and returns the attention output [B, Hq, D] of the post-RoPE query q [B, Hq, D], in q's
        dtype and on q's device. positions: int [B] (default: each sequence's last position + 1). out: optional
        preallocated output [B, Hq, D] of distinct elements (any strides; an expand()ed tensor is a ValueError)."""
        layer, slot_list = _integer("layer", layer), _slot_list(slots)
        k_new_post_rope = _flag("k_new_post_rope", k_new_post_rope)
        q = _required("q", q)
        out = _output_for(q, out, "[B, Hq, D]")
        self._store.decode(
            layer,
            slot_list,
            _exported(q),
            _exported(_required("k_new", k_new)),
            _exported(_required("v_new", v_new)),
            _exported(_required("out", out)),
            _exported(_plain("positions", positions)),
            k_new_post_rope,
            _stream_of(q),
        )
        return out

    def extend(
        self,
        layer: int,
        slots: Union[int, Iterable[int]],
        q: Any,
        k: Any,
        v: Any,
        lengths: Optional[Any] = None,
        positions: Optional[Any] = None,
        k_post_rope: bool = True,
        out: Optional[Any] = None,
    ) -> Any:
        """Appends T >= 1 tokens per sequence to one layer at once (a chat turn, a draft to verify) and returns their
        attention outputs [B, T, Hq, D] in q's dtype and on q's device.

        q: post-RoPE queries [B, T, Hq, D]; k, v: [B, T, Hkv, D] (k post-RoPE unless k_post_rope=False).
        lengths: new tokens per row of a right-padded batch (default T); output rows past a length are zero (or, with
        `out`, left as they were). positions: int [B, T] (default: each sequence's last position + 1, + 2, ...).
        Each token attends exactly and causally to the new tokens before it and to the exact regions, and to the
        compressed context through one selection per block of `extend_block` tokens (docs/semantics.md, "Extend");
        T = 1 is decode.
        """
        layer, slot_list = _integer("layer", layer), _slot_list(slots)
        k_post_rope = _flag("k_post_rope", k_post_rope)
        length_list = [] if lengths is None else _integer_list("lengths", lengths, _INT64)
        q = _required("q", q)
        if len(getattr(q, "shape", ())) == 4 and q.shape[1] == 0:
            raise ValueError(f"extend needs at least one new token per sequence: q holds T = 0 tokens "
                             f"({list(q.shape)})")
        out = _output_for(q, out, "[B, T, Hq, D]", zeros=True)
        self._store.extend(
            layer,
            slot_list,
            _exported(q),
            _exported(_required("k", k)),
            _exported(_required("v", v)),
            _exported(_required("out", out)),
            length_list,
            _exported(_plain("positions", positions)),
            k_post_rope,
            _stream_of(q),
        )
        return out

    def truncate(self, slots: Union[int, Iterable[int]], tokens: Union[int, Iterable[int]]) -> None:
        """Removes the last `tokens` tokens appended after the prefill (by decode or extend) from every layer of each
        slot (one count for all, or one per slot); each sequence then decodes exactly as one that never saw them
        (docs/semantics.md, "Truncate"). Removing into the prompt raises ValueError and changes nothing."""
        slot_list = _slot_list(slots)
        if hasattr(tokens, "__index__") and getattr(tokens, "ndim", 0) == 0 and not _is_bool(tokens):
            counts = [_integer("tokens", tokens, _INT64)] * len(slot_list)
        else:
            counts = _integer_list("tokens", tokens, _INT64)
        self._store.truncate(slot_list, counts)

    def fork(self, slot: int, count: int = 1) -> list:
        """Takes `count` free slots (lowest ids first) and makes each a sequence equal to `slot` now, in every layer
        (prompt, generated tokens, positions, fold journal, selection cache), and returns their ids. The prompt's
        compressed state is shared by reference, not copied (memory_report()["shared"]); afterwards each sequence
        evolves on its own, and releasing any of them (the source included) leaves the others valid
        (docs/semantics.md, "Fork, park and save"). Every layer of `slot` must be prefilled (ValueError); too few free
        slots is a ValueError (capacity) and running out of memory a MemoryError, each changing nothing."""
        return self._store.fork(_integer("slot", slot), _integer("count", count))

    def park(self, slots: Union[int, Iterable[int]]) -> list:
        """Moves each sequence's whole state (every layer, which must all be prefilled) out of its slot into host
        memory and frees the slots for other sequences; returns one `ParkedSequence` per slot, in order. A decode on a
        freed slot raises ValueError naming it parked (until a sequence takes it). A member of a fork's family keeps
        sharing its prompt state (and rejoins the family when resumed). ValueError for a slot not live, given twice or
        not prefilled in every layer, or a backend that cannot park; MemoryError; either way nothing changes
        (docs/semantics.md, "Fork, park and save")."""
        return [ParkedSequence(p) for p in self._store.park(_slot_list(slots))]

    def resume(self, parked: Union[ParkedSequence, Iterable[ParkedSequence]]) -> list:
        """Puts parked sequences (one, or a sequence of them) back into free slots, lowest first, and returns their
        slots in order; each then continues bit for bit as if it had never been parked, and its object is empty.
        TypeError for anything but ParkedSequence objects; ValueError for none, one given twice, one resumed already
        or parked by another store, and (capacity) too few free slots; MemoryError where a value store that was in
        device memory has no room there; either way nothing changes."""
        if isinstance(parked, ParkedSequence):
            items = [parked]
        else:
            if isinstance(parked, (str, bytes)) or not hasattr(parked, "__iter__"):
                raise TypeError(f"parked must be a ParkedSequence or a sequence of them, got {type(parked).__name__}")
            items = list(parked)
        for i, item in enumerate(items):
            if not isinstance(item, ParkedSequence):
                raise TypeError(f"parked[{i}] must be a ParkedSequence (from KVStore.park), got {type(item).__name__}")
        return self._store.resume([item._parked for item in items])

    def save(self, slot: int, path: Any) -> None:
        """Writes the whole state of the live `slot` (every layer, which must all be prefilled) to the file `path`
        (str or os.PathLike): written to `path + ".tmp"` and renamed, so that a failed save leaves no partial file
        under `path`. Changes nothing in the store. OSError (FileNotFoundError, PermissionError, ...) when the file
        cannot be written; ValueError for a slot not live or not prefilled, or a backend that cannot save. The format:
        docs/api.md, "Saved sequences"."""
        self._store.save(_integer("slot", slot), _path(path))

    def load(self, path: Any) -> int:
        """Reads a file written by `save` (of a store with the same backend kind and configuration; max_batch and
        max_seq_len may differ) into the lowest free slot and returns it; the sequence continues bit for bit as the
        saved one would have, unshared (the file holds a forked sequence's shared prompt state too). Its value store is
        placed as `add_sequences` places a new one. Everything is checked before a slot is taken: OSError
        (FileNotFoundError, ...) when the file cannot be read; ValueError for a file that is not a saved sequence, of
        another format version, backend or configuration (naming the field), or truncated or corrupted (checksum), and
        (capacity) for a full store or more tokens than max_seq_len; MemoryError. Either way nothing changes."""
        return self._store.load(_path(path))

    def account_replayed_steps(self, layer: int, slots: Union[int, Iterable[int]], steps: int) -> None:
        """Tells the store that a CUDA graph captured around `decode(layer, slots, ...)` was replayed `steps` times
        (each replay advances the device state by one step). Capture after one eager decode with the same slots;
        tensors, shapes and slots are fixed for the graph. Backends that cannot replay (CPU) raise ValueError."""
        layer, steps = _integer("layer", layer), _integer("steps", steps, _INT64)
        self._store.account_replayed_steps(layer, _slot_list(slots), steps)

    # --- inspection ------------------------------------------------------------------------------------------------
    def selected_chunks(self, layer: int, slot: int) -> list:
        """Chunk ids of the last selection of (layer, slot), one ascending list per KV head."""
        return self._store.selected_chunks(_integer("layer", layer), _integer("slot", slot))

    def outlier_chunks(self, layer: int, slot: int) -> list:
        """Outlier chunk ids of (layer, slot), one ascending list per KV head."""
        return self._store.outlier_chunks(_integer("layer", layer), _integer("slot", slot))

    def attended_chunks(self, layer: int, slot: int) -> list:
        """Every context chunk of (layer, slot) the last step attended exactly, one ascending list per KV head: the
        outliers (the attention sinks among them) and the last selection."""
        return self._store.attended_chunks(_integer("layer", layer), _integer("slot", slot))

    def sequence_info(self, layer: int, slot: int) -> dict:
        """prompt_len, total_len, context_chunks, outlier_chunks, local_len, generated_exact_len, last_position,
        values_on ("device" or "host": where the sequence's value store is), shares_prompt_with (the other live slots
        that share this sequence's prompt state after a fork, ascending; empty when it shares nothing)."""
        return self._store.sequence_info(_integer("layer", layer), _integer("slot", slot))

    def memory_report(self) -> dict:
        """Bytes by kind (docs/semantics.md): low_rank_factors, landmarks, outliers, exact_tokens, value_store
        (= value_store_device + value_store_host), selection_cache, fold_journal (exact rows of folded generated chunks,
        kept for truncate), total (the seven kinds), full_attention_equivalent
        (a plain KV cache of the same tokens), device_reserved and host_reserved (CUDA reservations; 0 on the CPU),
        shared (bytes several live sequences share by reference after a fork: counted once in their kinds, and here)."""
        return self._store.memory_report()

    def layer_memory_after_prefill(self, prompt_tokens: int) -> dict:
        """What memory_report() shows for one (sequence, layer) right after a prefill of `prompt_tokens` tokens (1 to
        max_seq_len), from the configuration alone: the same keys. At max_seq_len, total against
        full_attention_equivalent is the store's footprint relative to full attention (MemoryFootprintWarning)."""
        return self._store.layer_memory_after_prefill(_integer("prompt_tokens", prompt_tokens, _INT64))

    def stats(self) -> dict:
        """decode_steps, selections, hits, misses, hit_rate, chunks_rebuilt, bytes_fetched, folds."""
        return self._store.stats()

    def reset_stats(self) -> None:
        self._store.reset_stats()

    def __repr__(self) -> str:
        c = self._config
        return (
            f"KVStore(layers={c.num_layers}, heads={c.num_q_heads}/{c.num_kv_heads}, head_dim={c.head_dim}, "
            f"rank={c.rank}, budget={c.budget}, device='{self.device}', dtype={c.dtype})"
        )
