"""The tooling's one haystack: natural English filler every Debian/Ubuntu machine has, and its two cuts.

* `haystack_text()`: the licence texts under /usr/share/common-licenses (~250 KB, about 55K tokens), each file once.
* `Haystack(tokenizer, text)`: the text tokenised once; `window(n, rng)` cuts n tokens starting at a random paragraph
  (the needle tasks insert their needles into such a window, `shadowkv_core.evaluation.tasks`).
* `haystack_ids(tokenizer, n)`: an n-token prompt, the text from its beginning then `PROMPT_SUFFIX` (the fidelity
  capture's prompt).
"""

from __future__ import annotations

import bisect
import random
import re
from pathlib import Path

__all__ = ["LICENSES_DIR", "PROMPT_SUFFIX", "Haystack", "haystack_ids", "haystack_text"]

LICENSES_DIR = "/usr/share/common-licenses"
PROMPT_SUFFIX = "\n\nIn one paragraph, the text above says that"


def haystack_text(directory: str = LICENSES_DIR, min_chars: int = 0) -> str:
    """Natural English filler: the licence texts under /usr/share/common-licenses (every Debian/Ubuntu machine has
    them; ~250 KB, about 55K tokens), each file once (symlinks such as GPL -> GPL-3 skipped), in name order,
    whitespace-normalised into paragraphs. Repeated until it has at least `min_chars` characters."""
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"no haystack: {directory} is missing (Debian/Ubuntu's base-files provides it); "
                                "pass the text yourself")
    seen, parts = set(), []
    for path in sorted(folder.iterdir()):
        real = path.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        text = real.read_text(encoding="utf-8", errors="replace")
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
        parts.append("\n\n".join(p for p in paragraphs if p))
    text = "\n\n".join(parts)
    if not text:
        raise FileNotFoundError(f"no haystack: {directory} holds no text files")
    while len(text) < min_chars:
        text = text + "\n\n" + text
    return text


class Haystack:
    """The filler text, tokenised once; cuts windows of a given token count at paragraph starts."""

    def __init__(self, tokenizer, text: str, min_tokens: int = 0) -> None:
        if not text.strip():
            raise ValueError("Haystack: empty text")
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if min_tokens and len(enc.input_ids) < min_tokens + 64:
            repeats = (min_tokens + 64) // max(1, len(enc.input_ids)) + 1
            text = "\n\n".join([text] * repeats)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        self.text = text
        self.starts = [start for start, _ in enc.offset_mapping] + [len(text)]
        self.num_tokens = len(enc.input_ids)
        paragraph_chars = [0] + [m.end() for m in re.finditer(r"\n\n", text)]
        self.paragraph_tokens = sorted({bisect.bisect_left(self.starts, c) for c in paragraph_chars})

    def window(self, num_tokens: int, rng: random.Random) -> tuple:
        """(text, token char starts relative to it) of `num_tokens` tokens beginning at a random paragraph."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"Haystack: {num_tokens} tokens asked, the text has {self.num_tokens}")
        fits = [t for t in self.paragraph_tokens if t + num_tokens <= self.num_tokens] or [0]
        first = rng.choice(fits)
        begin, end = self.starts[first], self.starts[first + num_tokens]
        text = self.text[begin:end]
        return text, [s - begin for s in self.starts[first:first + num_tokens]]


def haystack_ids(tokenizer, tokens: int, suffix: str = PROMPT_SUFFIX, directory: str = LICENSES_DIR):
    """[1, tokens] prompt ids (a torch tensor): the haystack text from its beginning (repeated if too short; the
    tokenizer's special tokens such as BOS first), cut so that the `suffix` tokens end it exactly at `tokens`."""
    import torch

    text = haystack_text(directory)
    tail = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    ids = tokenizer(text)["input_ids"]
    body = tokens - len(tail)
    if body <= 0:
        raise ValueError(f"{tokens} tokens is too short for the prompt suffix ({len(tail)} tokens)")
    if len(ids) < body:
        more = tokenizer("\n\n" + text, add_special_tokens=False)["input_ids"]
        while len(ids) < body:
            ids = ids + more
    return torch.tensor([ids[:body] + list(tail)], dtype=torch.long)
