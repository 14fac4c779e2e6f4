"""Task generators and scoring of the accuracy harness (`shadowkv_core.evaluation.accuracy`); no dataset downloads.

RULER-style synthetic retrieval tasks over a natural haystack (by default the licence texts of
/usr/share/common-licenses, see `shadowkv_core.evaluation.haystack`):

* ``niah``: one needle ("One of the special magic numbers for <key> is: <7 digits>.") at a given depth of a
  context of a given length; asked for its number.
* ``multikey``: the needle at the given depth plus 3 distractor needles with other keys at random depths.
* ``multivalue``: 4 needles with the same key and different numbers; asked for all of them.
* ``multiquery``: 4 needles with different keys; one question asks for all 4 numbers.
* ``vt`` (variable tracking): a chain "VAR A = 12345." "VAR B = VAR A." ... (1 + 4 hops) spread over the context;
  asked for every variable holding 12345.
* ``multiturn``: 8 needles with different keys at depths (i + 0.5) / 8; 8 questions, one per turn, each about a
  different needle, in a shuffled order, in one conversation (the model's own answers stay in the conversation).

Score of an answer (RULER's string_match_all, on whole words): the fraction of the expected strings that occur in
the generated text as whole words (case-insensitive; a longer number containing the expected digits does not
count); 0 or 1 for a single expected string.

Lengths are prompt tokens of the first turn in the model's tokenizer (template, instruction, context and the first
question included; the haystack is cut to fill the rest). Depth is the needle's position as a fraction of the context
(0 = its first sentence, 1 = after its last sentence); needles go at sentence boundaries, the one nearest the depth.
Every sample is a pure function of (task, length, depth, index, seed), so full attention, every store budget and
every later run see the same prompts.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from .haystack import Haystack

__all__ = [
    "DEPTH_TASKS",
    "MULTITURN_TURNS",
    "TASKS",
    "PromptFormat",
    "Sample",
    "Turn",
    "make_sample",
    "score",
]

TASKS = ("niah", "multikey", "multivalue", "multiquery", "vt", "multiturn")
DEPTH_TASKS = ("niah", "multikey")            # tasks whose needle position is the `depth` parameter
MULTITURN_TURNS = 8

_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "nimble", "odd", "pale", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid", "wary", "young",
    "zesty", "bitter", "crisp", "daring", "early", "faint", "grumpy", "hungry", "loyal", "modest", "noisy", "proud",
    "rustic", "shiny", "tender", "wicked")
_NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "rabbit", "saddle", "tunnel", "umbrella", "violin",
    "walrus", "yacht", "zebra", "beacon", "cactus", "donkey", "ember", "forest", "glacier", "hammer", "igloo",
    "jungle", "koala", "ladder", "mirror", "nutmeg", "otter", "pigeon")


@dataclass
class Turn:
    """One question: its text, the start of the answer given to the model, and the strings the answer must hold."""
    question: str
    answer_prefix: str
    expected: List[str]


@dataclass
class Sample:
    task: str
    length: int                       # requested first-turn prompt tokens
    depth: Optional[float]            # requested needle depth (niah, multikey), else None
    index: int
    instruction: str
    context: str
    turns: List[Turn]
    needles: List[dict] = field(default_factory=list)   # {"text", "depth"}: each needle and its requested depth


def score(output: str, expected: Sequence[str]) -> float:
    """Fraction of `expected` strings found in `output` as whole words (case-insensitive): "2489079" is not found
    in "24890793"."""
    if not expected:
        raise ValueError("score: nothing expected")
    found = sum(1.0 for e in expected
                if re.search(rf"(?<![0-9A-Za-z]){re.escape(e)}(?![0-9A-Za-z])", output, flags=re.IGNORECASE))
    return found / len(expected)


# ---------------------------------------------------------------------------------------------------------------------
# prompt format
# ---------------------------------------------------------------------------------------------------------------------

class PromptFormat:
    """How a conversation becomes text for `tokenizer`.

    With a chat template (instruction-tuned models): the user message is the instruction, the context and the
    question; the assistant message starts with the answer prefix. The pieces between messages come from rendering
    the template once with markers, so any template works. Without one (base models): "instruction\\n\\ncontext\\n\\n
    Question: q\\nAnswer: prefix", later turns "\\nQuestion: q\\nAnswer: prefix", and an answer ends at a newline.
    """

    _U1, _A1, _U2 = "\x01USER_ONE\x01", "\x01ASSISTANT_ONE\x01", "\x01USER_TWO\x01"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.stop_at_newline = not self.chat
        if self.chat:
            messages = [{"role": "user", "content": self._U1}, {"role": "assistant", "content": self._A1},
                        {"role": "user", "content": self._U2}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            u1, a1, u2 = (text.index(m) for m in (self._U1, self._A1, self._U2))
            self.head = text[:u1]                                  # system prompt, user header
            self.to_assistant = text[u1 + len(self._U1):a1]        # end of user turn, assistant header
            self.to_user = text[a1 + len(self._A1):u2]             # end of assistant turn, user header
            self.generation_prompt = text[u2 + len(self._U2):]
        bos = getattr(tokenizer, "bos_token", None)
        # A template that writes the BOS token itself must not get a second one from the tokenizer.
        self._add_special = not (self.chat and bos and self.head.startswith(bos))

    def first(self, instruction: str, context: str, turn: Turn) -> str:
        if self.chat:
            user = f"{instruction}\n\n{context}\n\n{turn.question}"
            return f"{self.head}{user}{self.to_assistant}{turn.answer_prefix}"
        return f"{instruction}\n\n{context}\n\nQuestion: {turn.question}\nAnswer: {turn.answer_prefix}"

    def next(self, turn: Turn) -> str:
        """Text that follows the previous answer (whose end-of-turn token, if any, was not fed)."""
        if self.chat:
            return f"{self.to_user}{turn.question}{self.generation_prompt}{turn.answer_prefix}"
        return f"\nQuestion: {turn.question}\nAnswer: {turn.answer_prefix}"

    def encode_first(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=self._add_special).input_ids)

    def encode_next(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


# ---------------------------------------------------------------------------------------------------------------------
# needles into a haystack window
# ---------------------------------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n\n")


def _boundaries(text: str) -> List[int]:
    return sorted({0, len(text)} | {m.end() for m in _SENTENCE_END.finditer(text)})


def _insert(text: str, token_starts: List[int], needles: List[tuple]) -> str:
    """Inserts each (depth, needle text) at the sentence boundary nearest its depth (in tokens)."""
    bounds = _boundaries(text)
    placed = []
    for order, (depth, needle) in enumerate(needles):
        token = min(len(token_starts) - 1, max(0, int(round(depth * len(token_starts)))))
        char = len(text) if depth >= 1.0 else token_starts[token]
        i = bisect.bisect_left(bounds, char)
        best = min((b for b in bounds[max(0, i - 1):i + 1]), key=lambda b: abs(b - char))
        placed.append((best, order, needle))
    # From the end, so earlier offsets stay valid; needles at one boundary keep their order.
    placed.sort(key=lambda p: (p[0], p[1]), reverse=True)
    for at, _, needle in placed:
        left, right = text[:at].rstrip(" "), text[at:].lstrip(" ")
        sep_left = "" if not left or left.endswith("\n") else " "
        sep_right = "" if not right or right.startswith("\n") else " "
        text = f"{left}{sep_left}{needle}{sep_right}{right}"
    return text


# ---------------------------------------------------------------------------------------------------------------------
# samples
# ---------------------------------------------------------------------------------------------------------------------

_NIAH_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                     "I will quiz you about the numbers afterwards.")
_VT_INSTRUCTION = ("Memorize and track the chain of variable assignments hidden in the following text. "
                   "I will ask you about the variables afterwards.")


def _rng(*parts) -> random.Random:
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _keys(rng: random.Random, count: int) -> List[str]:
    keys: List[str] = []
    while len(keys) < count:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _numbers(rng: random.Random, count: int, digits: int = 7) -> List[str]:
    out: List[str] = []
    while len(out) < count:
        n = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        if n not in out:
            out.append(n)
    return out


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _single_turn(key: str, value: str) -> Turn:
    return Turn(question=f"What is the special magic number for {key} mentioned in the provided text?",
                answer_prefix=f"The special magic number for {key} mentioned in the provided text is",
                expected=[value])


def _join_keys(keys: Sequence[str]) -> str:
    return ", ".join(keys[:-1]) + f" and {keys[-1]}" if len(keys) > 1 else keys[0]


def _plan(task: str, depth: Optional[float], rng: random.Random) -> tuple:
    """(instruction, [(depth, needle)], [Turn]) of one sample."""
    if task == "niah":
        (key,), (value,) = _keys(rng, 1), _numbers(rng, 1)
        return _NIAH_INSTRUCTION, [(depth, _needle(key, value))], [_single_turn(key, value)]
    if task == "multikey":
        keys, values = _keys(rng, 4), _numbers(rng, 4)
        needles = [(depth, _needle(keys[0], values[0]))]
        needles += [(rng.random(), _needle(k, v)) for k, v in zip(keys[1:], values[1:])]
        return _NIAH_INSTRUCTION, needles, [_single_turn(keys[0], values[0])]
    if task == "multivalue":
        (key,), values = _keys(rng, 1), _numbers(rng, 4)
        needles = [(rng.random(), _needle(key, v)) for v in values]
        turn = Turn(question=f"What are all the special magic numbers for {key} mentioned in the provided text?",
                    answer_prefix=f"The special magic numbers for {key} mentioned in the provided text are",
                    expected=values)
        return _NIAH_INSTRUCTION, needles, [turn]
    if task == "multiquery":
        keys, values = _keys(rng, 4), _numbers(rng, 4)
        needles = [(rng.random(), _needle(k, v)) for k, v in zip(keys, values)]
        turn = Turn(question=f"What are all the special magic numbers for {_join_keys(keys)} mentioned in the "
                             "provided text?",
                    answer_prefix=f"The special magic numbers for {_join_keys(keys)} mentioned in the provided text "
                                  "are", expected=values)
        return _NIAH_INSTRUCTION, needles, [turn]
    if task == "vt":
        names: List[str] = []
        while len(names) < 5:
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if name not in names:
                names.append(name)
        (value,) = _numbers(rng, 1, digits=5)
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        needles = [((i + 0.5) / len(chain), text) for i, text in enumerate(chain)]
        turn = Turn(question=f"Find all variables that are assigned the value {value} in the text above.",
                    answer_prefix=f"According to the chain of variable assignments in the text above, {len(names)} "
                                  f"variables are assigned the value {value}, they are:", expected=names)
        return _VT_INSTRUCTION, needles, [turn]
    if task == "multiturn":
        keys, values = _keys(rng, MULTITURN_TURNS), _numbers(rng, MULTITURN_TURNS)
        needles = [((i + 0.5) / MULTITURN_TURNS, _needle(k, v)) for i, (k, v) in enumerate(zip(keys, values))]
        order = list(range(MULTITURN_TURNS))
        rng.shuffle(order)
        return _NIAH_INSTRUCTION, needles, [_single_turn(keys[i], values[i]) for i in order]
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def make_sample(task: str, length: int, fmt: PromptFormat, haystack: Haystack, *, depth: Optional[float] = None,
                index: int = 0, seed: int = 0) -> Sample:
    """One sample of `task` whose first-turn prompt has about `length` tokens in `fmt`'s tokenizer."""
    if task in DEPTH_TASKS:
        if depth is None or not 0.0 <= depth <= 1.0:
            raise ValueError(f"task {task!r} needs a depth in [0, 1], got {depth}")
    else:
        depth = None
    rng = _rng(task, length, depth, index, seed)
    instruction, needles, turns = _plan(task, depth, rng)
    overhead = len(fmt.encode_first(fmt.first(instruction, "", turns[0])))
    overhead += sum(len(fmt.encode_next(" " + text)) for _, text in needles)
    filler = length - overhead
    if filler < 16:
        raise ValueError(f"length {length} is too short for task {task!r} (its prompt without haystack has "
                         f"{overhead} tokens)")
    text, starts = haystack.window(filler, rng)
    context = _insert(text, starts, needles)
    return Sample(task=task, length=length, depth=depth, index=index, instruction=instruction, context=context,
                  turns=turns, needles=[{"text": t, "depth": d} for d, t in needles])
