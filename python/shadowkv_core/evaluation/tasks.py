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
* ``fwe`` (frequent-words extraction, RULER's): the context is nothing but words drawn from a Zipf distribution
  (exponent 2) over a seeded vocabulary of 2000 made-up 6-letter words whose most frequent "word" is the noise
  "...."; asked for the 3 most frequent words (the ranks after the noise). Word counts are floor(W * k^-2 / H) for
  rank k (H normalises over the vocabulary), the remainder to W one each to the rarest ranks, in a seeded order; the
  number of words W is what meets the length (no haystack).
* ``qa`` (question answering over a long document; RULER's qa reads SQuAD/HotpotQA, here the facts are generated):
  the context is paragraphs of 3 facts each about a made-up town ("The mayor of Belora is Tikamu."), every name and
  number distinct; the target town's paragraph goes at the paragraph boundary nearest the depth, the distractor
  paragraphs about other towns (the same attributes, other values) fill the length; asked one attribute of the
  target town.
* ``multiturn``: 8 needles with different keys at depths (i + 0.5) / 8; 8 questions, one per turn, each about a
  different needle, in a shuffled order, in one conversation (the model's own answers stay in the conversation).

Score of an answer (RULER's string_match_all, on whole words): the fraction of the expected strings that occur in
the generated text as whole words (case-insensitive; a longer number containing the expected digits does not
count); 0 or 1 for a single expected string.

Lengths are prompt tokens of the first turn in the model's tokenizer (template, instruction, context and the first
question included; the haystack, fwe's words or qa's distractor paragraphs fill the rest). Depth is the needle's
position as a fraction of the context (0 = its first sentence, 1 = after its last sentence); needles go at sentence
boundaries, the one nearest the depth (qa's paragraph at the paragraph boundary nearest it).
Every sample is a pure function of (task, length, depth, index, seed), so full attention, every store budget and
every later run see the same prompts.

Documents (`make_document`, the harness's `--questions-per-document Q`): one haystack carrying the needles of Q
questions, prefilled once and asked each question on its own copy. For niah, multikey, multivalue, multiquery and qa
(`DOCUMENT_TASKS`): question i's needles are those of one sample of the task (multikey: its needle and 3 distractor
keys; multivalue: 4 numbers of its key; multiquery: 4 keys; qa: its town's paragraph among the distractor
paragraphs), with its own keys, numbers and names (none twice in a document); the depth tasks put question i's needle
(qa: its paragraph) at depth i / (Q - 1) (`spread_depths`), the rest at random depths as a sample does. So the other
questions' needles are more distractors. The prompt of question i is `PromptFormat.document` (template head,
instruction, context) then `PromptFormat.question` (the question and the answer prefix); the two texts together are
`PromptFormat.first`'s, and the tokens are those of the document then those of the question (`question_prompt`), the
document's shared by every question. The length is question 0's prompt tokens. vt and fwe (one chain, one word count
per context) and multiturn (already a conversation) stay one question per sample.
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
    "DOCUMENT_TASKS",
    "MULTITURN_TURNS",
    "TASKS",
    "Document",
    "PromptFormat",
    "Sample",
    "Turn",
    "make_document",
    "make_sample",
    "question_prompt",
    "score",
    "spread_depths",
]

TASKS = ("niah", "multikey", "multivalue", "multiquery", "vt", "fwe", "qa", "multiturn")
DEPTH_TASKS = ("niah", "multikey", "qa")      # tasks whose needle position is the `depth` parameter
DOCUMENT_TASKS = ("niah", "multikey", "multivalue", "multiquery", "qa")   # tasks with many questions per document
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
    depth: Optional[float]            # requested needle depth (niah, multikey, qa), else None
    index: int
    instruction: str
    context: str
    turns: List[Turn]
    # {"text", "depth"}: each needle and its requested depth (qa: the target paragraph; fwe: the 3 answer words,
    # depth None, with "count", their occurrences)
    needles: List[dict] = field(default_factory=list)


@dataclass
class Document:
    """One context asked `len(questions)` questions, each on its own copy of the prefilled document."""
    task: str
    length: int                       # requested prompt tokens of question 0 (document + question)
    index: int
    instruction: str
    context: str
    questions: List[Turn]
    depths: List[Optional[float]]     # per question: its needle's requested depth (niah, multikey, qa), else None
    needles: List[List[dict]]         # per question: its needles {"text", "depth"} (targets and distractors)


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

    def document(self, instruction: str, context: str) -> str:
        """The shared head of `first`'s text: everything before the question (`document(i, c) + question(t)` is
        `first(i, c, t)`)."""
        if self.chat:
            return f"{self.head}{instruction}\n\n{context}"
        return f"{instruction}\n\n{context}"

    def question(self, turn: Turn) -> str:
        """The rest of `first`'s text after `document`: the question and the answer prefix."""
        if self.chat:
            return f"\n\n{turn.question}{self.to_assistant}{turn.answer_prefix}"
        return f"\n\nQuestion: {turn.question}\nAnswer: {turn.answer_prefix}"

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


# ---------------------------------------------------------------------------------------------------------------------
# fwe: frequent-words extraction
# ---------------------------------------------------------------------------------------------------------------------

FWE_VOCAB = 2000        # distinct words, the noise included
FWE_ALPHA = 2.0         # Zipf exponent (RULER's)
FWE_NOISE = "...."      # the most frequent "word", which the question says to ignore
FWE_ANSWERS = 3

_FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words.")
_FWE_QUESTION = ("Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
                 "appeared words in the above coded text?")
_FWE_PREFIX = "According to the coded text above, the three most frequently appeared words are:"


def _fwe_vocab(rng: random.Random) -> List[str]:
    """FWE_VOCAB words by rank: the noise, then distinct made-up lowercase 6-letter words."""
    words: List[str] = []
    seen = set()
    while len(words) < FWE_VOCAB - 1:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return [FWE_NOISE] + words


def _fwe_counts(total: int) -> List[int]:
    """Occurrences of each rank among `total` words: floor(total * k^-alpha / H), the remainder one each to the
    rarest ranks (each fraction is below 1, so the remainder is below the vocabulary's size)."""
    weights = [k ** -FWE_ALPHA for k in range(1, FWE_VOCAB + 1)]
    norm = sum(weights)
    counts = [int(total * w / norm) for w in weights]
    for k in range(total - sum(counts)):
        counts[FWE_VOCAB - 1 - k] += 1
    return counts


def _fwe_text(vocab: Sequence[str], counts: Sequence[int], order_seed: int) -> str:
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    random.Random(order_seed).shuffle(words)
    return " ".join(words)


def _fwe_sample(length: int, fmt: PromptFormat, index: int, rng: random.Random) -> Sample:
    vocab = _fwe_vocab(rng)
    order_seed = rng.getrandbits(64)
    answers = vocab[1:1 + FWE_ANSWERS]
    turn = Turn(question=_FWE_QUESTION, answer_prefix=_FWE_PREFIX, expected=list(answers))

    def tokens(total: int) -> int:
        context = _fwe_text(vocab, _fwe_counts(total), order_seed)
        return len(fmt.encode_first(fmt.first(_FWE_INSTRUCTION, context, turn)))

    overhead = tokens(0)
    if length - overhead < 16:
        raise ValueError(f"length {length} is too short for task 'fwe' (its prompt without words has {overhead} "
                         "tokens)")
    # Secant steps on the word count, then word by word to the largest count that does not pass the length.
    total, got = max(1, (length - overhead) // 2), None
    for _ in range(12):
        got = tokens(total)
        if got == length:
            break
        per_word = max(0.5, (got - overhead) / total)
        step = int(round((length - got) / per_word))
        if step == 0:
            break
        total = max(1, total + step)
    for _ in range(64):
        if got <= length or total == 1:
            break
        total -= 1
        got = tokens(total)
    for _ in range(64):
        if tokens(total + 1) > length:
            break
        total += 1
    counts = _fwe_counts(total)
    if min(counts[1:1 + FWE_ANSWERS]) <= max(counts[1 + FWE_ANSWERS:]):
        raise ValueError(f"length {length} is too short for task 'fwe': its {total} words do not make "
                         f"{FWE_ANSWERS} words more frequent than every other")
    context = _fwe_text(vocab, counts, order_seed)
    return Sample(task="fwe", length=length, depth=None, index=index, instruction=_FWE_INSTRUCTION, context=context,
                  turns=[turn], needles=[{"text": w, "depth": None, "count": c}
                                         for w, c in zip(answers, counts[1:1 + FWE_ANSWERS])])


# ---------------------------------------------------------------------------------------------------------------------
# qa: one fact paragraph among distractor paragraphs of the same form
# ---------------------------------------------------------------------------------------------------------------------

QA_FACTS = 3            # facts per paragraph
_QA_ATTRIBUTES = (("mayor", "name"), ("river", "name"), ("twin town", "name"), ("oldest inn", "name"),
                  ("population", "number"), ("postal code", "number"))
_QA_INSTRUCTION = ("The following paragraphs describe many towns. Answer the question about one of them based on the "
                   "given paragraphs. Only give me the answer and do not output any other words.")
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


class _Unique:
    """Made-up names and 5-digit numbers, none twice in one sample."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set()

    def _draw(self, make) -> str:
        while True:
            value = make()
            if value not in self.used:
                self.used.add(value)
                return value

    def name(self) -> str:
        syllables = self.rng.randint(2, 3)
        return self._draw(lambda: "".join(self.rng.choice(_CONSONANTS) + self.rng.choice(_VOWELS)
                                          for _ in range(syllables)).capitalize())

    def number(self) -> str:
        return self._draw(lambda: str(self.rng.randint(10000, 99999)))


def _qa_distractors(fmt, unique, rng, filler: int):
    """Distractor paragraphs of at least `filler` + 64 tokens: their text, each token's first character, and the
    paragraph boundaries (characters) where a target paragraph may go."""
    paragraphs, have = [], 0
    while have < filler + 64:
        paragraphs.append(_qa_paragraph(unique.name(), unique, rng)[0])
        have += len(fmt.encode_next("\n\n" + paragraphs[-1]))
    text = "\n\n".join(paragraphs)
    enc = fmt.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in enc.offset_mapping]
    bounds = [0] + [m.end() for m in re.finditer(r"\n\n", text)]
    return text, starts, bounds


def _qa_paragraph(town: str, unique: _Unique, rng: random.Random, must: Optional[int] = None) -> tuple:
    """(paragraph text, [(attribute, value)]) of QA_FACTS facts about `town` (attribute index `must` among them)."""
    picks = rng.sample([i for i in range(len(_QA_ATTRIBUTES)) if i != must], QA_FACTS - (must is not None))
    if must is not None:
        picks.insert(rng.randrange(QA_FACTS), must)
    facts = [(_QA_ATTRIBUTES[i][0], getattr(unique, _QA_ATTRIBUTES[i][1])()) for i in picks]
    return " ".join(f"The {attribute} of {town} is {value}." for attribute, value in facts), facts


def _qa_sample(length: int, fmt: PromptFormat, depth: float, index: int, rng: random.Random) -> Sample:
    unique = _Unique(rng)
    town = unique.name()
    asked = rng.randrange(len(_QA_ATTRIBUTES))
    golden, facts = _qa_paragraph(town, unique, rng, must=asked)
    attribute = _QA_ATTRIBUTES[asked][0]
    value = dict(facts)[attribute]
    turn = Turn(question=f"What is the {attribute} of {town}?", answer_prefix=f"The {attribute} of {town} is",
                expected=[value])
    overhead = len(fmt.encode_first(fmt.first(_QA_INSTRUCTION, "", turn)))
    overhead += len(fmt.encode_next("\n\n" + golden))
    filler = length - overhead
    if filler < 16:
        raise ValueError(f"length {length} is too short for task 'qa' (its prompt without distractors has "
                         f"{overhead} tokens)")
    text, starts, bounds = _qa_distractors(fmt, unique, rng, filler)

    def cut(tokens: int) -> str:
        """The distractors cut after `tokens` tokens (mid-sentence, as the haystack windows are) with the target
        paragraph at the paragraph boundary nearest the depth (in tokens)."""
        head = text[:starts[tokens]]
        token = min(tokens - 1, max(0, int(round(depth * tokens))))
        char = len(head) if depth >= 1.0 else starts[token]
        at = min([b for b in bounds if b <= len(head)] + [len(head)], key=lambda b: abs(b - char))
        return "\n\n".join(p for p in (head[:at].rstrip(), golden, head[at:].lstrip()) if p)

    # The golden paragraph's tokens where it lands can differ from its own by one or two: measure, correct.
    tokens = filler
    for _ in range(3):
        context = cut(tokens)
        miss = len(fmt.encode_first(fmt.first(_QA_INSTRUCTION, context, turn))) - length
        if miss == 0 or not 16 <= tokens - miss < len(starts):
            break
        tokens -= miss
    return Sample(task="qa", length=length, depth=depth, index=index, instruction=_QA_INSTRUCTION, context=context,
                  turns=[turn], needles=[{"text": golden, "depth": depth}])


def make_sample(task: str, length: int, fmt: PromptFormat, haystack: Haystack, *, depth: Optional[float] = None,
                index: int = 0, seed: int = 0) -> Sample:
    """One sample of `task` whose first-turn prompt has about `length` tokens in `fmt`'s tokenizer."""
    if task in DEPTH_TASKS:
        if depth is None or not 0.0 <= depth <= 1.0:
            raise ValueError(f"task {task!r} needs a depth in [0, 1], got {depth}")
    else:
        depth = None
    rng = _rng(task, length, depth, index, seed)
    if task == "fwe":
        return _fwe_sample(length, fmt, index, rng)
    if task == "qa":
        return _qa_sample(length, fmt, depth, index, rng)
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


# ---------------------------------------------------------------------------------------------------------------------
# documents: many questions on one prefilled context
# ---------------------------------------------------------------------------------------------------------------------

def spread_depths(questions: int) -> List[float]:
    """Depths of a document's questions' needles (depth tasks): i / (Q - 1) for i < Q, rounded to 4 decimals (0.5
    for one question)."""
    if questions < 1:
        raise ValueError(f"a document needs at least one question, got {questions}")
    if questions == 1:
        return [0.5]
    return [round(i / (questions - 1), 4) for i in range(questions)]


def question_prompt(fmt: PromptFormat, document: Document, question: int) -> tuple:
    """(document tokens, question tokens) of `document`'s question `question`: the first are every question's, the
    prompt is both in order."""
    head = fmt.encode_first(fmt.document(document.instruction, document.context))
    return head, fmt.encode_next(fmt.question(document.questions[question]))


def _plan_document(task: str, depths: Sequence[float], rng: random.Random) -> tuple:
    """(instruction, [(depth, needle)], [Turn], [[needle indices] per question]) of one document."""
    count = len(depths)
    needles: List[tuple] = []
    turns: List[Turn] = []
    owned: List[List[int]] = []

    def add(question_needles) -> None:
        owned.append(list(range(len(needles), len(needles) + len(question_needles))))
        needles.extend(question_needles)

    if task == "niah":
        keys, values = _keys(rng, count), _numbers(rng, count)
        for i in range(count):
            add([(depths[i], _needle(keys[i], values[i]))])
            turns.append(_single_turn(keys[i], values[i]))
    elif task == "multikey":
        keys, values = _keys(rng, 4 * count), _numbers(rng, 4 * count)
        for i in range(count):
            others = range(count + 3 * i, count + 3 * i + 3)
            add([(depths[i], _needle(keys[i], values[i]))] + [(rng.random(), _needle(keys[j], values[j]))
                                                              for j in others])
            turns.append(_single_turn(keys[i], values[i]))
    elif task == "multivalue":
        keys, values = _keys(rng, count), _numbers(rng, 4 * count)
        for i in range(count):
            mine = values[4 * i:4 * i + 4]
            add([(rng.random(), _needle(keys[i], v)) for v in mine])
            turns.append(Turn(question=f"What are all the special magic numbers for {keys[i]} mentioned in the "
                                       "provided text?",
                              answer_prefix=f"The special magic numbers for {keys[i]} mentioned in the provided text "
                                            "are", expected=mine))
    elif task == "multiquery":
        keys, values = _keys(rng, 4 * count), _numbers(rng, 4 * count)
        for i in range(count):
            mine_keys, mine = keys[4 * i:4 * i + 4], values[4 * i:4 * i + 4]
            add([(rng.random(), _needle(k, v)) for k, v in zip(mine_keys, mine)])
            turns.append(Turn(question=f"What are all the special magic numbers for {_join_keys(mine_keys)} "
                                       "mentioned in the provided text?",
                              answer_prefix=f"The special magic numbers for {_join_keys(mine_keys)} mentioned in the "
                                            "provided text are", expected=mine))
    else:
        raise ValueError(f"task {task!r} has one question per sample; documents: {', '.join(DOCUMENT_TASKS)}")
    return _NIAH_INSTRUCTION, needles, turns, owned


def _document_tokens(fmt: PromptFormat, instruction: str, context: str, turn: Turn) -> int:
    return (len(fmt.encode_first(fmt.document(instruction, context)))
            + len(fmt.encode_next(fmt.question(turn))))


def _qa_document(length: int, fmt: PromptFormat, depths: Sequence[float], index: int,
                 rng: random.Random) -> Document:
    """qa with one target town per question, each paragraph at the paragraph boundary nearest its depth."""
    unique = _Unique(rng)
    towns = [unique.name() for _ in depths]
    goldens, turns = [], []
    for town in towns:
        asked = rng.randrange(len(_QA_ATTRIBUTES))
        golden, facts = _qa_paragraph(town, unique, rng, must=asked)
        attribute = _QA_ATTRIBUTES[asked][0]
        goldens.append(golden)
        turns.append(Turn(question=f"What is the {attribute} of {town}?",
                          answer_prefix=f"The {attribute} of {town} is", expected=[dict(facts)[attribute]]))
    overhead = _document_tokens(fmt, _QA_INSTRUCTION, "", turns[0])
    overhead += sum(len(fmt.encode_next("\n\n" + g)) for g in goldens)
    filler = length - overhead
    if filler < 16:
        raise ValueError(f"length {length} is too short for a qa document of {len(depths)} questions (its prompt "
                         f"without distractors has {overhead} tokens)")
    text, starts, bounds = _qa_distractors(fmt, unique, rng, filler)

    def cut(tokens: int) -> str:
        """The distractors cut after `tokens` tokens, each target paragraph at the paragraph boundary nearest its
        depth (in tokens); paragraphs at one boundary keep the questions' order."""
        head = text[:starts[tokens]]
        places = []
        for order, (depth, golden) in enumerate(zip(depths, goldens)):
            token = min(tokens - 1, max(0, int(round(depth * tokens))))
            char = len(head) if depth >= 1.0 else starts[token]
            at = min([b for b in bounds if b <= len(head)] + [len(head)], key=lambda b: abs(b - char))
            places.append((at, order, golden))
        pieces, previous = [], 0
        for at, _, golden in sorted(places):
            pieces += [head[previous:at].strip(), golden]
            previous = at
        pieces.append(head[previous:].strip())
        return "\n\n".join(p for p in pieces if p)

    tokens = filler
    for _ in range(3):
        context = cut(tokens)
        miss = _document_tokens(fmt, _QA_INSTRUCTION, context, turns[0]) - length
        if miss == 0 or not 16 <= tokens - miss < len(starts):
            break
        tokens -= miss
    return Document(task="qa", length=length, index=index, instruction=_QA_INSTRUCTION, context=context,
                    questions=turns, depths=list(depths),
                    needles=[[{"text": g, "depth": d}] for d, g in zip(depths, goldens)])


def make_document(task: str, length: int, fmt: PromptFormat, haystack: Haystack, *, questions: int,
                  index: int = 0, seed: int = 0) -> Document:
    """One document of `task` (DOCUMENT_TASKS) carrying the needles of `questions` questions, whose question 0's
    prompt (`question_prompt`) has about `length` tokens in `fmt`'s tokenizer. A pure function of (task, length,
    questions, index, seed)."""
    if task not in DOCUMENT_TASKS:
        raise ValueError(f"task {task!r} has one question per sample; documents: {', '.join(DOCUMENT_TASKS)}")
    depths = spread_depths(questions)
    rng = _rng("document", task, length, questions, index, seed)
    if task == "qa":
        return _qa_document(length, fmt, depths, index, rng)
    instruction, needles, turns, owned = _plan_document(task, depths, rng)
    overhead = _document_tokens(fmt, instruction, "", turns[0])
    overhead += sum(len(fmt.encode_next(" " + text)) for _, text in needles)
    filler = length - overhead
    if filler < 16:
        raise ValueError(f"length {length} is too short for a {task!r} document of {questions} questions (its "
                         f"prompt without haystack has {overhead} tokens)")
    text, starts = haystack.window(filler, rng)
    context = _insert(text, starts, needles)
    return Document(task=task, length=length, index=index, instruction=instruction, context=context,
                    questions=turns, depths=[depths[i] if task in DEPTH_TASKS else None for i in range(questions)],
                    needles=[[{"text": needles[j][1], "depth": needles[j][0]} for j in mine] for mine in owned])
