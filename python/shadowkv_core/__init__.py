"""shadowkv_core: long-context decoding with keys as a low-rank factorisation, values offloaded, and exact attention
over the few chunks that matter (ShadowKV). See README.md and docs/semantics.md.

    from shadowkv_core import KVStore
    store = KVStore(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, max_batch=4, max_seq_len=65536)
    slots = store.add_sequences(2)
    store.prefill(layer, slots, keys, values)               # [B, S, Hkv, D] each, keys post-RoPE
    out = store.decode(layer, slots, q, k_new, v_new)       # [B, Hq, D] -> [B, Hq, D], q and k_new post-RoPE
"""

import importlib.util as _importlib_util

# torch, where it is installed, is imported before the extension. Both link CUDA libraries of the same sonames
# (libcublas.so.13, libcublasLt.so.13, libcusolver.so.12); torch loads its own copies by path, so a process that had
# loaded the CUDA toolkit's copies first, through this extension, ends up with two cuBLAS libraries mapped, and
# importing torch after shadowkv_core crashed (SIGSEGV) on the H200 (bench/probes/import_order.py). Imported after
# torch, the extension binds to torch's copies. Without torch (C++-only users, numpy callers) nothing changes.
if _importlib_util.find_spec("torch") is not None:
    import torch as _torch  # noqa: F401

from ._store import KVStore, MemoryFootprintWarning, ParkedSequence, build_info

__all__ = ["KVStore", "MemoryFootprintWarning", "ParkedSequence", "build_info"]
__version__ = "0.1.0"
