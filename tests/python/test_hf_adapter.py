"""The transformers adapter (``shadowkv_core.hf``) on tiny random-weight models of each supported family.

No downloads: every model is built from a config (hidden 128, 2-4 layers, vocab 256, float32, seeded), with weights
drawn larger than transformers' default init (std 0.1 instead of 0.02) so that attention is far from uniform and the
store's selection matters.

* Full budget (covers every token), full rank (num_kv_heads * head_dim), float32 storage: the logits of every
  generation step equal the model's own (sdpa, DynamicCache) within atol 1e-4 (observed ~1e-6), and greedy
  generation of 64 tokens is token-identical. The generation window is small, so generated chunks are folded into the
  compressed store during the run.
* Small budget (2 chunks, rank 8): generation runs to the end, the store's decode is really used (its statistics),
  and the logits move away from the model's (the test is sensitive to what the store does).
* A left-padded batch of prompts of different lengths equals each prompt run alone through the adapter (small and
  full budget; logits atol 1e-4, tokens identical), and with the full budget equals the model alone.
"""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'transformers>=5.17,<6')")

from packaging.version import Version  # noqa: E402  (a dependency of transformers)

if Version(transformers.__version__) < Version("5.17"):
    pytest.skip(f"shadowkv_core.hf needs transformers>=5.17, found {transformers.__version__}", allow_module_level=True)

import shadowkv_core.hf as skv  # noqa: E402

# The model keyword of the cache: `cache` in newer 5.x (5.24: `past_key_values` is a deprecated alias), 5.17:
# `past_key_values`.
_FORWARD_PARAMETERS = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
CACHE_KW = "cache" if "cache" in _FORWARD_PARAMETERS else "past_key_values"

VOCAB, NEW_TOKENS, ATOL = 256, 64, 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=64,
              max_position_embeddings=2048, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2))


def _llama_yarn():  # scaled RoPE: inv_freq differs from theta^(-2i/d) and attention_scaling != 1
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512}
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=1, rope_parameters=rope))


def _mistral():  # sliding_window (4096) >= max_seq_len: full attention in effect, the store takes every layer
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, sliding_window=4096))


def _qwen2():  # biases on q/k/v, MHA
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, num_hidden_layers=2, num_key_value_heads=4))


def _qwen3():  # q/k RMSNorm before RoPE
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, num_hidden_layers=2, num_key_value_heads=2))


def _gemma3():  # sliding (window 16, local RoPE) and full (global RoPE) layers, MQA, query_pre_attn_scalar scaling
    config = transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=1, sliding_window=16, query_pre_attn_scalar=96,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=False)  # tied, the scaled embedding dominates and greedy repeats one token
    return transformers.Gemma3ForCausalLM(config)


FAMILIES = {"llama": _llama, "llama-yarn": _llama_yarn, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
            "gemma3": _gemma3}


def build(family: str, device: str = "cpu"):
    torch.manual_seed(1234 + list(FAMILIES).index(family))
    model = FAMILIES[family]().eval()
    model.set_attn_implementation("sdpa")
    return model.to(device)


@pytest.fixture
def model_device(device):
    """The conftest's device (SHADOWKV_TEST_DEVICES), skipped when the store has no backend for it."""
    import shadowkv_core

    if device.startswith("cuda") and not shadowkv_core.build_info().get("cuda_backend", False):
        pytest.skip("this shadowkv_core build has no CUDA backend")
    return device


def prompt(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g)


def left_pad(prompts: list) -> tuple:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = p
        mask[b, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def generate(model, ids, mask=None, cache=None, new_tokens=NEW_TOKENS):
    """(sequences [B, new_tokens], logits [new_tokens, B, vocab]) of greedy generation, on the CPU."""
    if mask is None:
        mask = torch.ones_like(ids)
    ids, mask = ids.to(model.device), mask.to(model.device)
    kwargs = {} if cache is None else {CACHE_KW: cache}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).cpu()


def full_budget_cache(model, max_batch=1):
    """Budget = max_seq_len (covers everything), full rank, float32 storage; a small window so chunks fold."""
    kw = skv.store_kwargs_for(model, max_seq_len=512)
    return skv.enable(model, budget=512, rank=kw["num_kv_heads"] * kw["head_dim"], max_seq_len=512,
                      max_batch=max_batch, outlier_chunks=2, local_chunks=2, generation_window=16, dtype="float32")


def small_budget_cache(model, max_batch=1, extend_block=32):
    return skv.enable(model, budget=16, rank=8, max_seq_len=512, max_batch=max_batch, outlier_chunks=2,
                      local_chunks=2, generation_window=16, dtype="float32", extend_block=extend_block)


def full_layer_count(model) -> int:
    return skv.store_kwargs_for(model, max_seq_len=512)["num_layers"]


def describe(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max |diff| = {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_budget_equals_model(family, model_device):
    model = build(family, model_device)
    ids = prompt(150, seed=7)[None]
    ref_tokens, ref_logits = generate(model, ids)

    cache = full_budget_cache(model)
    tokens, logits = generate(model, ids, cache=cache)

    assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0), f"{family}: {describe(logits, ref_logits)}"
    assert torch.equal(tokens, ref_tokens), f"{family}: greedy tokens differ"
    stats = cache.store.stats()
    # every generated token but the last is fed back through every store layer's decode
    assert stats["decode_steps"] == (NEW_TOKENS - 1) * full_layer_count(model), stats
    assert stats["folds"] > 0, stats
    # layers that are not full attention keep transformers' own cache
    for layer, kind in zip(cache.layers, getattr(model.config, "layer_types", None) or []):
        assert isinstance(layer, skv.ShadowKVLayer) == (kind == "full_attention" or family == "mistral")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_small_budget_generates(family, model_device):
    model = build(family, model_device)
    ids = prompt(200, seed=11)[None]
    _, ref_logits = generate(model, ids)

    cache = small_budget_cache(model)
    tokens, logits = generate(model, ids, cache=cache)

    assert tokens.shape == (1, NEW_TOKENS)
    assert torch.isfinite(logits).all()
    stats = cache.store.stats()
    assert stats["decode_steps"] == (NEW_TOKENS - 1) * full_layer_count(model), stats
    assert stats["misses"] > 0 and stats["folds"] > 0, stats
    # the store's sparse decode is really what the model used
    assert (logits - ref_logits).abs().max().item() > 1e-3, f"{family}: small budget changed nothing"


@pytest.mark.parametrize("budget", ["full", "small"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ragged_batch_equals_alone(family, budget, model_device):
    model = build(family, model_device)
    prompts = [prompt(n, seed=20 + n) for n in (131, 96, 57)]
    ids, mask = left_pad(prompts)
    make = full_budget_cache if budget == "full" else small_budget_cache
    new_tokens = 24

    cache = make(model, max_batch=len(prompts))
    tokens, logits = generate(model, ids, mask, cache=cache, new_tokens=new_tokens)
    for b, p in enumerate(prompts):
        alone_tokens, alone_logits = generate(model, p[None], cache=make(model), new_tokens=new_tokens)
        assert torch.allclose(logits[:, b], alone_logits[:, 0], atol=ATOL, rtol=0), \
            f"{family} row {b}: {describe(logits[:, b], alone_logits[:, 0])}"
        assert torch.equal(tokens[b], alone_tokens[0]), f"{family} row {b}: tokens differ from the prompt alone"
        if budget == "full":
            model.set_attn_implementation("sdpa")
            ref_tokens, ref_logits = generate(model, p[None], new_tokens=new_tokens)
            assert torch.allclose(logits[:, b], ref_logits[:, 0], atol=ATOL, rtol=0), \
                f"{family} row {b}: {describe(logits[:, b], ref_logits[:, 0])}"
            assert torch.equal(tokens[b], ref_tokens[0])
    # the store holds each prompt without its padding
    for b, p in enumerate(prompts):
        info = cache.store.sequence_info(0, cache.slots[b])
        assert info["prompt_len"] == len(p), info


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_continued_conversation_equals_model(family):
    """Later generate calls on the same cache (turns of 45 and 5 new tokens: the first spans two extend blocks) equal
    transformers' own cache at full budget and rank."""
    model = build(family)
    turns = [prompt(100, seed=3)[None], prompt(45, seed=4)[None], prompt(5, seed=5)[None]]
    runs = []
    for cache in (transformers.DynamicCache(config=model.config), full_budget_cache(model)):
        ids, logits = None, []
        with torch.no_grad():
            for turn in turns:
                ids = turn if ids is None else torch.cat([ids, turn], dim=1)
                out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, **{CACHE_KW: cache})
                ids = out.sequences
                logits.append(torch.stack(out.logits))
        runs.append((ids, torch.cat(logits)))
    (ref_ids, ref_logits), (ids, logits) = runs
    assert torch.equal(ids, ref_ids), f"{family}: tokens differ"
    assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0), f"{family}: {describe(logits, ref_logits)}"


def _count_calls(store, name: str) -> list:
    """Wraps store.<name> (an instance attribute shadowing the method) to record each call's token count."""
    calls, original = [], getattr(store, name)

    def wrapped(layer, slots, q, *args, **kwargs):
        calls.append(q.shape[1] if q.dim() == 4 else 1)
        return original(layer, slots, q, *args, **kwargs)

    setattr(store, name, wrapped)
    return calls


def test_continued_conversation_is_one_extend_per_layer():
    """A new turn's tokens go through one KVStore.extend call per store layer (one selection per extend_block
    tokens), not a decode per token; the generated tokens after it are decode steps."""
    model = build("llama")
    cache = small_budget_cache(model)
    layers = full_layer_count(model)
    with torch.no_grad():
        out = model.generate(prompt(150, seed=3)[None], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             **{CACHE_KW: cache})
        extends, decodes = _count_calls(cache.store, "extend"), _count_calls(cache.store, "decode")
        before = cache.store.stats()
        model.generate(torch.cat([out, prompt(40, seed=4)[None]], dim=1), max_new_tokens=6, min_new_tokens=6,
                       do_sample=False, **{CACHE_KW: cache})
    after = cache.store.stats()
    # the turn: its 40 tokens + the previous call's last token (never fed back), in one call per layer
    assert extends == [41] * layers, extends
    assert len(decodes) == 5 * layers
    assert after["selections"] - before["selections"] == (2 + 5) * layers  # ceil(41 / 32) blocks, then 5 decodes
    assert cache.store.sequence_info(0, cache.slots[0])["total_len"] == 150 + 7 + 41 + 5


def test_continued_conversation_extend_block_1_is_token_by_token_decode():
    """With extend_block = 1 a turn through `extend` is the same turn through one `decode` per token, bit for bit
    (the same forwards, the store's extend replaced by a decode loop in the second cache); fed as one forward per
    token the logits agree within rounding of the model's other layers (their matrix shapes differ) and the greedy
    tokens are the same."""
    model = build("llama")
    caches = [small_budget_cache(model, extend_block=1) for _ in range(3)]
    store = caches[1].store
    decode = store.decode

    def decode_loop(layer, slots, q, k, v, lengths=None, positions=None, k_post_rope=True, out=None):
        assert lengths is None and out is None and k_post_rope
        return torch.stack([decode(layer, slots, q[:, t], k[:, t], v[:, t],
                                   positions=None if positions is None else positions[:, t])
                            for t in range(q.shape[1])], dim=1)

    store.extend = decode_loop
    first = prompt(150, seed=3)[None]
    turns = [prompt(37, seed=4)[None], prompt(9, seed=5)[None]]
    with torch.no_grad():
        ids = [model.generate(first, max_new_tokens=6, min_new_tokens=6, do_sample=False, **{CACHE_KW: c})
               for c in caches]
        assert all(torch.equal(i, ids[0]) for i in ids)
        for n, turn in enumerate(turns):
            new = torch.cat([ids[0][:, -1:], turn], dim=1)  # the last generated token was not fed back
            a = model(new, **{CACHE_KW: caches[0]}).logits
            b = model(new, **{CACHE_KW: caches[1]}).logits
            c = torch.cat([model(new[:, t:t + 1], **{CACHE_KW: caches[2]}).logits for t in range(new.shape[1])], dim=1)
            assert torch.equal(a, b), f"turn {n}: {describe(a, b)}"
            assert torch.allclose(a, c, atol=ATOL, rtol=0), f"turn {n}: {describe(a, c)}"
            assert torch.equal(a.argmax(-1), c.argmax(-1))
            for layer in range(full_layer_count(model)):
                assert (caches[0].store.selected_chunks(layer, caches[0].slots[0])
                        == store.selected_chunks(layer, caches[1].slots[0]))
            ids = [torch.cat([ids[0], turn, a[:, -1:].argmax(-1)], dim=1)] * 3
    lengths = {c.store.sequence_info(0, c.slots[0])["total_len"] for c in caches}
    assert lengths == {150 + 6 + 1 + 37 + 9}, lengths


def test_crop_semantics_and_errors():
    """`crop` as transformers' Cache.crop: negative removes that many, positive keeps that many (no-op when the cache
    holds no more), 0 nothing; never into the prompt (ValueError, nothing changes); the cache then continues exactly
    as one that never saw the removed tokens."""
    model = build("llama")
    cache, ref = small_budget_cache(model, extend_block=4), small_budget_cache(model, extend_block=4)
    ids, extra = prompt(60, seed=21)[None], prompt(12, seed=22)[None]

    def held(c):
        lengths = {layer.seq_len for layer in c.store_layers}
        totals = {c.store.sequence_info(layer, c.slots[0])["total_len"] for layer in range(full_layer_count(model))}
        assert len(lengths) == 1 and lengths == totals, (lengths, totals)
        return lengths.pop()

    with torch.no_grad():
        for c in (cache, ref):
            model(ids, **{CACHE_KW: c})
            model(extra[:, :6], **{CACHE_KW: c})
        model(extra[:, 6:], **{CACHE_KW: cache})  # 6 more tokens only `cache` sees
        assert held(cache) == 72 and cache.get_seq_length() == 72
        cache.crop(0)
        cache.crop(1000)
        assert held(cache) == 72
        cache.crop(-4)
        assert held(cache) == 68
        cache.crop(66)
        assert held(cache) == 66 == held(ref)
        # the next tokens: exactly those of the cache that never saw the removed ones
        nxt = prompt(5, seed=23)[None]
        a, b = model(nxt, **{CACHE_KW: cache}).logits, model(nxt, **{CACHE_KW: ref}).logits
        assert torch.equal(a, b), describe(a, b)
        for layer in range(full_layer_count(model)):
            assert cache.store.selected_chunks(layer, cache.slots[0]) == ref.store.selected_chunks(layer, ref.slots[0])

        with pytest.raises(ValueError, match="prompt"):
            cache.crop(59)
        with pytest.raises(ValueError, match="prompt"):
            cache.crop(-(71 - 60 + 1))
        assert held(cache) == 71
        with pytest.raises(NotImplementedError, match="whole cache"):
            cache.store_layers[0].crop(-1)
        with pytest.raises(TypeError):
            cache.crop(1.5)
        cache.crop(60)  # down to the prompt is allowed
        assert held(cache) == 60
        cache.crop(-0)
        assert held(cache) == 60

    empty = small_budget_cache(model)
    empty.crop(-3)  # nothing stored yet: nothing to remove
    assert empty.get_seq_length() == 0


def noisy(model, std=0.005):
    """The model with seeded noise on its weights: a draft model that agrees with it on most tokens, not all."""
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


ASSISTED = {  # family, budget, extend_block: settings at which assisted generation equals greedy exactly
    "llama-full": ("llama", "full", 32),
    "llama-small-block1": ("llama", "small", 1),
    "gemma3-small-block1": ("gemma3", "small", 1),
}


@pytest.mark.parametrize("case", list(ASSISTED))
@pytest.mark.parametrize("drafter", ["assistant_model", "prompt_lookup"])
def test_assisted_generation_equals_greedy(case, drafter):
    """`generate(..., assistant_model=...)` (and prompt lookup) verifies each draft with one extend and crops the
    rejected tokens: with extend_block = 1, or a budget covering everything at full rank, its tokens are exactly
    those of plain greedy decoding with the store."""
    family, budget, block = ASSISTED[case]
    model = build(family)
    make = (lambda: full_budget_cache(model)) if budget == "full" else (
        lambda: small_budget_cache(model, extend_block=block))
    ids = prompt(120, seed=31)[None]
    new_tokens = 40
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                **{CACHE_KW: make()})
        if drafter == "assistant_model":  # the weights with noise, transformers' cache: its drafts are often accepted
            assistant = noisy(build(family))
            # always 5 tokens a draft (no confidence cut-off: the tiny models' distributions are flat)
            assistant.generation_config.assistant_confidence_threshold = 0.0
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.num_assistant_tokens = 5
            kwargs = {"assistant_model": assistant, "num_assistant_tokens": 5}
        else:  # n-gram lookup in a repetitive prompt
            ids = torch.cat([ids[:, :60], ids[:, :60]], dim=1)
            greedy = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    **{CACHE_KW: make()})
            kwargs = {"prompt_lookup_num_tokens": 4}
        cache = make()
        crops = []
        crop = cache.crop
        cache.crop = lambda n: (crops.append(int(n)), crop(n))[1]
        assisted = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  **kwargs, **{CACHE_KW: cache})
    assert torch.equal(assisted, greedy), f"{case}/{drafter}: {(assisted != greedy).sum().item()} tokens differ"
    assert any(n < 0 for n in crops), f"no draft token was rejected: crop untested {crops}"
    if drafter == "assistant_model":  # one crop per verification forward: fewer forwards than tokens
        # some drafts partly accepted: the crop removes a part of a verified block
        assert any(-5 < n < 0 for n in crops) and len(crops) < new_tokens, crops
    assert cache.store.sequence_info(0, cache.slots[0])["total_len"] == assisted.shape[1] - 1
    assert cache.get_seq_length() == assisted.shape[1] - 1


def test_assisted_generation_rejections():
    model = build("llama")
    cache = small_budget_cache(model)
    ids = prompt(40, seed=32)[None]
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="early exit"):
            model.generate(ids, max_new_tokens=4, assistant_early_exit=1, **{CACHE_KW: cache})
        assert cache.slots is None
        out = model.generate(ids, max_new_tokens=4, do_sample=False, **{CACHE_KW: cache})
        total = cache.store.sequence_info(0, cache.slots[0])["total_len"]
        with pytest.raises(NotImplementedError, match="already holds"):
            model.generate(torch.cat([out, prompt(5, seed=33)[None]], dim=1), max_new_tokens=4,
                           assistant_model=build("llama"), **{CACHE_KW: cache})
        assert cache.store.sequence_info(0, cache.slots[0])["total_len"] == total


def test_cache_reset_reuses_slots():
    model = build("qwen3")
    cache = full_budget_cache(model)
    ids = prompt(64, seed=5)[None]
    first, _ = generate(model, ids, cache=cache, new_tokens=8)
    cache.reset()
    assert cache.slots is None and cache.store.active_slots() == []
    again, _ = generate(model, ids, cache=cache, new_tokens=8)
    assert torch.equal(first, again)


def test_without_shadowkv_attention_is_an_error():
    model = build("llama")
    cache = skv.make_cache(model, budget=64, rank=16, max_seq_len=512, outlier_chunks=2, local_chunks=2)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="attn_implementation='shadowkv'"):
        generate(model, prompt(40, seed=6)[None], cache=cache, new_tokens=2)


def test_shadowkv_attention_without_store_cache_is_sdpa():
    """A model switched to "shadowkv" still runs with transformers' own cache (every layer is plain sdpa)."""
    model = build("gemma3")
    ids = prompt(80, seed=8)[None]
    ref_tokens, ref_logits = generate(model, ids, new_tokens=8)
    model.set_attn_implementation(skv.ATTENTION_NAME)
    tokens, logits = generate(model, ids, new_tokens=8)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-6, rtol=0), describe(logits, ref_logits)


def test_rejects_models_it_cannot_serve():
    model = build("mistral")  # window 4096 < max_seq_len: sliding-window attention, nothing for the store
    with pytest.raises(ValueError, match="no full-attention layer"):
        skv.make_cache(model, max_seq_len=8192)


def test_enabled_context_restores_the_model():
    """`with skv.enabled(model, ...) as cache:` switches the attention and the generate checks on, and off on exit;
    the cache's slots are released on exit. `disable` restores the attention the model had (here eager)."""
    model = build("llama")
    model.set_attn_implementation("eager")
    ids = prompt(40, seed=11)[None]
    ref, _ = generate(model, ids, new_tokens=4)
    with skv.enabled(model, budget=512, rank=128, max_seq_len=512, outlier_chunks=2, local_chunks=2,
                     dtype="float32") as cache:
        assert model.config._attn_implementation == skv.ATTENTION_NAME
        tokens, _ = generate(model, ids, cache=cache, new_tokens=4)
        assert cache.slots is not None
    assert torch.equal(tokens, ref)
    assert model.config._attn_implementation == "eager"
    assert "generate" not in model.__dict__ and cache.slots is None and cache.store.active_slots() == []
    again, _ = generate(model, ids, new_tokens=4)  # transformers' own cache, eager attention
    assert torch.equal(again, ref)

    cache = skv.enable(model, budget=64, rank=16, max_seq_len=512, outlier_chunks=2, local_chunks=2)
    skv.disable(model)
    assert model.config._attn_implementation == "eager" and "generate" not in model.__dict__
    with skv.enabled(model, budget=64, rank=16, max_seq_len=512, outlier_chunks=2, local_chunks=2):
        with pytest.raises(RuntimeError, match="boom"):  # an exception inside still restores
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"


def test_generate_rejects_contrastive_search_and_too_many_beams_before_prefill():
    model = build("llama")
    cache = small_budget_cache(model, max_batch=2)
    with pytest.raises(NotImplementedError, match="contrastive search"), torch.no_grad():
        model.generate(prompt(40, seed=12)[None], max_new_tokens=4, penalty_alpha=0.6, top_k=4, **{CACHE_KW: cache})
    with pytest.raises(ValueError, match="needs 3 sequences"), torch.no_grad():
        model.generate(prompt(40, seed=12)[None], max_new_tokens=4, num_beams=3, **{CACHE_KW: cache})
    assert cache.slots is None and cache.store.active_slots() == [], "nothing may reach the store"


def _count_prefills(store) -> list:
    """Wraps store.prefill to record the number of slots of each call."""
    calls, original = [], store.prefill

    def wrapped(layer, slots, *args, **kwargs):
        calls.append(len(slots))
        return original(layer, slots, *args, **kwargs)

    store.prefill = wrapped
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_beam_search_equals_model(family):
    """Beam search (3 beams, 2 returned sequences) over a left-padded batch of two prompts equals transformers' own
    DynamicCache at full budget and rank: each prompt is prefilled once and forked into its beams, and each step's
    reorder_cache forks the beams kept several times and releases the dropped ones."""
    model = build(family)
    ids, mask = left_pad([prompt(90, seed=41), prompt(63, seed=42)])
    kwargs = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, num_beams=3, num_return_sequences=2,
                  do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
    cache = full_budget_cache(model, max_batch=6)
    prefills = _count_prefills(cache.store)
    forks, fork = [], cache.store.fork
    cache.store.fork = lambda slot, count=1: forks.append(count) or fork(slot, count)
    with torch.no_grad():
        out = model.generate(ids, **kwargs, **{CACHE_KW: cache})
    assert torch.equal(out.sequences, ref.sequences), f"{family}: beam search tokens differ"
    assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=0), \
        describe(out.sequences_scores, ref.sequences_scores)
    assert prefills == [2] * full_layer_count(model), "each prompt is prefilled once, then forked"
    assert forks[:2] == [2, 2] and len(forks) > 2, f"forks {forks}: the prompts' and then reorder_cache's"
    assert len(cache.slots) == 6 and sorted(cache.store.active_slots()) == sorted(cache.slots)
    for b in range(2):  # every beam holds its prompt without padding and its 19 fed-back tokens
        for slot in cache.slots[3 * b:3 * b + 3]:
            info = cache.store.sequence_info(0, slot)
            assert info["prompt_len"] == (90, 63)[b] and info["total_len"] == (90, 63)[b] + 19, info


def test_num_return_sequences_equals_model():
    """Sampling with num_return_sequences=3: one prefill and two forks per prompt; the same tokens and logits as
    transformers' own cache (same seed) at full budget and rank."""
    model = build("qwen3")
    ids = prompt(120, seed=43)[None]
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=True, top_k=0, num_return_sequences=3,
                  output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        torch.manual_seed(44)
        ref = model.generate(ids, **kwargs)
    cache = full_budget_cache(model, max_batch=3)
    prefills = _count_prefills(cache.store)
    with torch.no_grad():
        torch.manual_seed(44)
        out = model.generate(ids, **kwargs, **{CACHE_KW: cache})
    logits, ref_logits = torch.stack(out.logits), torch.stack(ref.logits)
    assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0), describe(logits, ref_logits)
    assert torch.equal(out.sequences, ref.sequences)
    assert len({tuple(row.tolist()) for row in out.sequences}) > 1, "the three samples should differ"
    assert prefills == [1] * full_layer_count(model)
    info = [cache.store.sequence_info(0, slot)["shares_prompt_with"] for slot in cache.slots]
    assert info[0] == sorted(cache.slots[1:]), info


def test_reorder_and_select_rows_fork_and_release():
    """Cache-level row operations: row i becomes row rows[i] (sequence_info follows), dropped rows free their slots,
    and a copy beyond the store's free slots is a ValueError that changes nothing."""
    model = build("llama")
    cache = small_budget_cache(model, max_batch=4)
    ids = torch.stack([prompt(60, seed=45), prompt(60, seed=46), prompt(60, seed=47)])
    generate(model, ids, cache=cache, new_tokens=5)
    old = list(cache.slots)
    infos = [cache.store.sequence_info(0, slot) for slot in old]
    last = [cache.store.sequence_info(0, slot)["last_position"] for slot in old]
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    # Row 1 was dropped first: its slot, the lowest free one, holds the fork of row 2.
    assert cache.slots == [old[2], old[1], old[0]] and cache.store.active_slots() == sorted(old)
    for slot, want in zip(cache.slots, (infos[2], infos[2], infos[0])):
        got = dict(cache.store.sequence_info(0, slot))
        assert {k: v for k, v in got.items() if k != "shares_prompt_with"} == \
               {k: v for k, v in want.items() if k != "shares_prompt_with"}
    assert cache.store.sequence_info(0, cache.slots[0])["shares_prompt_with"] == [cache.slots[1]]
    before = (list(cache.slots), cache.store.active_slots())
    with pytest.raises(ValueError, match="more store slots"):
        cache.batch_select_indices(torch.tensor([0, 0, 0, 0, 1]))
    assert (list(cache.slots), cache.store.active_slots()) == before
    cache.batch_select_indices(torch.tensor([1]))
    assert len(cache.slots) == 1 and cache.store.active_slots() == cache.slots
    cache.batch_repeat_interleave(2)
    assert len(cache.slots) == 2 and last[2] == cache.store.sequence_info(0, cache.slots[1])["last_position"]
    with pytest.raises(NotImplementedError, match="whole cache"):
        cache.store_layers[0].reorder_cache(torch.tensor([0, 0]))


def test_deepcopy_shares_the_document():
    """Eight questions about one prefilled document, each on copy.deepcopy of the document's cache (KVStore.fork: the
    document's compressed state is shared, not copied), equal transformers' own DynamicCache deep-copied the same way
    (tokens and logits, full budget and rank); memory_report counts the document once."""
    import copy

    model = build("llama")
    document = prompt(200, seed=48)[None]
    questions = [prompt(7 + i, seed=50 + i)[None] for i in range(8)]
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    runs = []
    for make in (lambda: transformers.DynamicCache(config=model.config), lambda: full_budget_cache(model, max_batch=9)):
        base = make()
        with torch.no_grad():
            model(input_ids=document, **{CACHE_KW: base})
        copies = [copy.deepcopy(base) for _ in questions]
        if isinstance(base, skv.ShadowKVCache):
            store = base.store
            report = store.memory_report()
            # Before any question: nine sequences, one document state.
            assert len(store.active_slots()) == 9
            doc_slot = base.slots[0]
            shares = store.sequence_info(0, doc_slot)["shares_prompt_with"]
            assert shares == sorted(c.slots[0] for c in copies)
            per_layer = store.layer_memory_after_prefill(200)
            layers = full_layer_count(model)
            prompt_bytes = layers * sum(per_layer[k] for k in ("low_rank_factors", "landmarks", "outliers",
                                                                "value_store"))
            assert report["shared"] == prompt_bytes
            for kind in ("low_rank_factors", "landmarks", "outliers", "value_store"):
                assert report[kind] == layers * per_layer[kind], kind  # once, not nine times
            for kind in ("exact_tokens", "selection_cache", "full_attention_equivalent"):
                assert report[kind] == 9 * layers * per_layer[kind], kind
            own = layers * (per_layer["exact_tokens"] + per_layer["selection_cache"])  # each sequence's own bytes
            assert report["total"] == prompt_bytes + 9 * own
            one_report = report
        outputs = []
        with torch.no_grad():
            for question, cache in zip(questions, copies):
                out = model.generate(torch.cat([document, question], dim=1), **kwargs, **{CACHE_KW: cache})
                outputs.append((out.sequences, torch.stack(out.logits)))
        if isinstance(base, skv.ShadowKVCache):
            assert store.memory_report()["shared"] == one_report["shared"]
            assert store.sequence_info(0, base.slots[0])["total_len"] == 200, "the document's cache is unchanged"
            for cache, question in zip(copies, questions):
                assert store.sequence_info(0, cache.slots[0])["total_len"] == 200 + question.shape[1] + 5
            for cache in copies:
                cache.release()
            assert store.active_slots() == base.slots
            assert store.memory_report()["shared"] == 0
        runs.append(outputs)
    for i, ((ref_ids, ref_logits), (ids, logits)) in enumerate(zip(*runs)):
        assert torch.equal(ids, ref_ids), f"question {i}: tokens differ"
        assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0), f"question {i}: {describe(logits, ref_logits)}"


def test_generate_rejects_lengths_and_batches_beyond_the_store():
    model = build("qwen3")
    cache = skv.enable(model, budget=16, rank=8, max_seq_len=64, max_batch=1, outlier_chunks=2, local_chunks=2,
                       generation_window=16, dtype="float32")
    ids = prompt(60, seed=13)[None]
    with pytest.raises(ValueError, match="max_seq_len=64"), torch.no_grad():
        model.generate(ids, max_new_tokens=6, do_sample=False, **{CACHE_KW: cache})  # 60 + 6 - 1 = 65 tokens
    assert cache.slots is None and cache.store.active_slots() == []
    with pytest.raises(ValueError, match="free slots"), torch.no_grad():
        model.generate(torch.cat([ids, ids]), max_new_tokens=2, do_sample=False, **{CACHE_KW: cache})
    # The exact fit: 60 + 5 - 1 = 64 tokens enter the store (the last generated token is not fed back).
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, **{CACHE_KW: cache})
    assert out.shape[1] == 65
    assert cache.store.sequence_info(0, cache.slots[0])["total_len"] == 64


def test_generate_rejects_a_reused_cache_with_a_new_prompt():
    model = build("llama")
    cache = full_budget_cache(model)
    first = prompt(50, seed=14)[None]
    with torch.no_grad():
        out = model.generate(first, max_new_tokens=4, do_sample=False, **{CACHE_KW: cache})
        with pytest.raises(ValueError, match=r"cache.reset\(\)"):
            model.generate(prompt(50, seed=15)[None], max_new_tokens=4, do_sample=False, **{CACHE_KW: cache})
        with pytest.raises(ValueError, match=r"cache.reset\(\)"):  # the same prompt again: not a continuation
            model.generate(first, max_new_tokens=4, do_sample=False, **{CACHE_KW: cache})
        # a continuation (the previous sequences + new tokens) is accepted
        model.generate(torch.cat([out, prompt(6, seed=16)[None]], dim=1), max_new_tokens=4, do_sample=False,
                       **{CACHE_KW: cache})
        cache.reset()
        fresh = model.generate(prompt(50, seed=15)[None], max_new_tokens=4, do_sample=False, **{CACHE_KW: cache})
    assert fresh.shape == (1, 54)


def test_chat_over_document_example_tiny():
    """examples/chat_over_document.py in its tiny-model mode: every turn after the first appends its tokens to the same
    cache (no second prefill), and the store ends holding the whole conversation."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "chat_over_document.py")
    spec = importlib.util.spec_from_file_location("chat_over_document", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.main(["--tiny", "--turns", "3", "--doc-tokens", "600"])
    assert [r["prefill"] for r in rows] == [True, False, False]
    assert rows[0]["appended"] == 600 and all(0 < r["appended"] < 64 for r in rows[1:])
    for previous, row in zip(rows, rows[1:]):
        assert row["cached"] == previous["cached"] + row["appended"] + row["generated"] - 1
    assert all(r["total_bytes"] > 0 and r["full_bytes"] > 0 and 0 <= r["hit_rate"] <= 1 for r in rows)
