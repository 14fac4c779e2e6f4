"""shadowkv_core: long-context decoding with keys as a low-rank factorisation, values offloaded, and exact attention
over the few chunks that matter (ShadowKV). See README.md and docs/semantics.md.

    from shadowkv_core import KVStore
    store = KVStore(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, max_batch=4, max_seq_len=65536)
    slots = store.add_sequences(2)
    store.prefill(layer, slots, keys_pre_rope, values)      # [B, S, Hkv, D] each
    out = store.decode(layer, slots, q, k_new, v_new)       # [B, Hq, D] -> [B, Hq, D]
"""

from ._store import KVStore, build_info

__all__ = ["KVStore", "build_info"]
__version__ = "0.1.0"
