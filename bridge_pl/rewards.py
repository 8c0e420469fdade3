"""Answer extraction, SQuAD answer normalisation, EM / F1 / sub-EM scores, the format check, and rewards.

Scores follow the official SQuAD v1.1 evaluation script (``normalize_answer``, exact match, token F1 with
a Counter intersection), with one deliberate deviation: **a comparison in which either side normalises to
the empty string scores 0**. A blank prediction is never correct, and a gold such as ``"the"`` (which
normalises to ``""``) can never be matched. Official SQuAD EM would score ``""`` against ``"the"`` as 1,
and sub-EM would score every prediction 1 against such a gold; official F1 already scores both 0.
Accents and non-ASCII punctuation (curly quotes, dashes) are kept, exactly as in SQuAD.

Every score takes ``golds``, a non-empty list of gold answers, and returns the maximum over them.
"""

from __future__ import annotations

import functools
import re
import string
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower-case, drop ASCII punctuation, drop whole words a/an/the, squash spaces.

    The order matters: ``"A.I."`` -> ``"ai"`` (punctuation goes before articles are looked for).
    """
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def _checked_golds(golds: Sequence[str]) -> Sequence[str]:
    if isinstance(golds, str):
        raise TypeError(f"golds must be a list of answer strings, got the single string {golds!r}")
    if len(golds) == 0:
        raise ValueError("golds is empty: every question needs at least one gold answer")
    for gold in golds:
        if not isinstance(gold, str):
            raise TypeError(f"golds must hold strings, got {type(gold).__name__}: {gold!r}")
    return golds


def _best_score(prediction: str | None, golds: Sequence[str], score: Callable[[str, str], float]) -> float:
    """Max of ``score(normalised prediction, normalised gold)`` over golds; 0 when either side is empty."""
    golds = _checked_golds(golds)
    if prediction is None:
        return 0.0
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a string or None, got {type(prediction).__name__}")
    pred = normalize_answer(prediction)
    if not pred:
        return 0.0
    return max((score(pred, gold) for gold in map(normalize_answer, golds) if gold), default=0.0)


def _token_f1(pred: str, gold: str) -> float:
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold, else 0.0 (None -> 0.0)."""
    return _best_score(prediction, golds, lambda pred, gold: float(pred == gold))


def sub_exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 if some normalised gold is a character substring of the normalised prediction (FlashRAG "acc").

    Substrings are not token-aligned: gold ``"art"`` matches prediction ``"start"``.
    """
    return _best_score(prediction, golds, lambda pred, gold: float(gold in pred))


def f1_score(prediction: str | None, golds: Sequence[str]) -> float:
    """SQuAD token F1 in [0, 1] (bag-of-tokens overlap of the normalised strings), max over golds."""
    return _best_score(prediction, golds, _token_f1)


@functools.lru_cache(maxsize=16)
def _answer_pattern(open_tag: str, close_tag: str) -> re.Pattern[str]:
    if not open_tag or not close_tag or open_tag == close_tag:
        raise ValueError(
            f"answer tags must be non-empty and distinct, got open_tag={open_tag!r}, close_tag={close_tag!r}"
        )
    opening = re.escape(open_tag)
    # The content may not contain another opening tag, so "<a>x <a>y</a>" yields "y".
    return re.compile(f"{opening}((?:(?!{opening}).)*?){re.escape(close_tag)}", re.DOTALL)


def extract_answer(
    text: str, skip_first: bool = False, *, open_tag: str = "<answer>", close_tag: str = "</answer>"
) -> str | None:
    """The stripped content of the last complete ``<answer>…</answer>`` in ``text``, or None if there is none.

    A complete answer is an opening tag followed by a closing tag with no other opening tag in between:
    an unclosed trailing ``<answer>`` is ignored, and a nested opening tag restarts the answer.
    ``skip_first=True`` (Search-R1 mode, for text that still holds the prompt's example answer) ignores the
    first complete answer, so a text with only one gives None. An empty answer gives ``""``, not None.
    """
    matches = _answer_pattern(open_tag, close_tag).findall(text)
    if len(matches) < (2 if skip_first else 1):
        return None
    return matches[-1].strip()


@functools.lru_cache(maxsize=16)
def _tag_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"tag names must be non-empty and distinct, got {names}")
    return re.compile(f"<(/?)({'|'.join(map(re.escape, names))})>")


def is_valid_format(
    text: str,
    *,
    think_tag: str = "think",
    search_tag: str = "search",
    information_tag: str = "information",
    answer_tag: str = "answer",
) -> bool:
    """Whether a response (generated turns plus the injected information, without the prompt) is well formed.

    Rules:
    - the text is a sequence of blocks ``<think>…</think>``, ``<search>…</search>``,
      ``<information>…</information>`` and ``<answer>…</answer>``, separated only by whitespace;
    - every search block is immediately followed by an information block, and an information block
      appears only there;
    - it ends with exactly one answer block: nothing but whitespace may follow it, and a response that
      never answers is invalid;
    - think, search and answer contents contain none of the four tags (no nesting, no stray close tags);
      information content is retrieved text and is not inspected;
    - search and answer contents are not blank; think content may be.
    Tag names (without brackets) are configurable to match the environment's.
    """
    tags = _tag_pattern((think_tag, search_tag, information_tag, answer_tag))
    pos = 0
    awaiting_information = False
    while True:
        match = tags.search(text, pos)
        if text[pos : match.start() if match else len(text)].strip():
            return False  # text outside any block
        if match is None or match.group(1):
            return False  # no answer at all, or a closing tag without its opening tag
        name = match.group(2)
        end = text.find(f"</{name}>", match.end())
        if end == -1:
            return False
        content = text[match.end() : end]
        if name != information_tag and tags.search(content):
            return False
        if awaiting_information != (name == information_tag):
            return False
        if name in (search_tag, answer_tag) and not content.strip():
            return False
        pos = end + len(name) + 3
        if name == answer_tag:
            return not text[pos:].strip()
        awaiting_information = name == search_tag


# An optional lead-in ("the answer is", "option", "answer:"), the letter (optionally bracketed), then an optional
# separator and the rest (e.g. the option's text).
_CHOICE = re.compile(
    r"(?:(?:the\s+)?(?:correct\s+|final\s+|best\s+)?(?:answer|option|choice)(?:\s+is)?\s*[:\-]?\s*)?"
    r"(?P<open>[(\[{])?(?P<letter>[A-Za-z])(?P<close>[)\]}])?(?:(?P<sep>\s*[.:)\-]|\s)\s*(?P<rest>.*))?",
    re.IGNORECASE | re.DOTALL,
)
_DECORATION = " \t\n*_`'\"."


def choice_letter(answer: str | None, options: dict[str, str]) -> str | None:
    """The option letter an answer names, or None: a multiple-choice answer mapped to a letter of ``options``.

    Accepted: the exact text of one option (compared after SQuAD normalisation, so case, punctuation and
    articles do not matter); or the letter (any case: ``C``, ``c``, ``C.``, ``(C)``, ``[C]``, ``C)``, ``**C**``),
    after an optional lead-in (``Answer: C``, ``The answer is (C)``, ``Option C``), followed by nothing, by its
    option's text (``C. Paris``, ``C Paris``) or, after a bracket or punctuation, by anything but another
    option's text (``C) because ...``). A bare letter, a space and other words (``A virus``) is read as text,
    not as a letter. A letter that is not among the options gives None.
    """
    if answer is None:
        return None
    text = answer.strip(_DECORATION)
    by_text = {normalize_answer(v): k for k, v in options.items()}
    if (key := normalize_answer(text)) and key in by_text:
        return by_text[key]
    match = _CHOICE.fullmatch(text)
    if match is None:
        return None
    letter = match["letter"].upper()
    if letter not in options:
        return None
    rest = normalize_answer(match["rest"] or "")
    if rest and by_text.get(rest, letter) != letter:
        return None  # "B. <option A's text>": the two disagree
    bare = not (match["open"] or match["close"] or (match["sep"] or "").strip())
    if rest and bare and by_text.get(rest) != letter:
        return None  # "A virus": an article and a word, not option A (a letter then a space needs its own text)
    return letter


def choice_score(answer: str | None, gold_letter: str, options: dict[str, str]) -> float:
    """1.0 if the answer names the gold option (see :func:`choice_letter`), else 0.0."""
    return float(choice_letter(answer, options) == gold_letter)


def answer_scores(prediction: str | None, golds: Sequence[str], options: dict[str, str] | None = None
                  ) -> dict[str, float]:
    """``{em, f1, sub_em}`` of one prediction. On a multiple-choice question (``options`` given; ``golds`` is
    ``[letter]``) all three are :func:`choice_score`: SQuAD normalisation would erase the letter "A"."""
    if options:
        correct = choice_score(prediction, _checked_golds(golds)[0], options)
        return {"em": correct, "f1": correct, "sub_em": correct}
    return {"em": exact_match(prediction, golds), "f1": f1_score(prediction, golds),
            "sub_em": sub_exact_match(prediction, golds)}


class RewardFunction(ABC):
    """A scalar reward for one rollout: ``reward(response, golds) -> float``. Subclasses are stateless.

    ``response`` is the rollout text the answer is extracted from; ``golds`` the question's gold answers.
    Chosen in YAML by ``class_path``; ``name`` labels the reward in logs.
    """

    name: str = "reward"

    @abstractmethod
    def __call__(self, response: str, golds: list[str]) -> float:
        """The reward for ``response`` given the gold answers."""


class _AnswerScoreReward(RewardFunction):
    """Reward = ``score(extract_answer(response), golds)``; a response without an answer gets 0."""

    score: Callable[[str | None, Sequence[str]], float]

    def __init__(self, skip_first: bool = False) -> None:
        self.skip_first = skip_first

    def __call__(self, response: str, golds: list[str]) -> float:
        return self.score(extract_answer(response, self.skip_first), golds)


class F1Reward(_AnswerScoreReward):
    """Token F1 of the extracted answer, in [0, 1]."""

    name = "f1"
    score = staticmethod(f1_score)


class SubEMReward(_AnswerScoreReward):
    """Sub-EM of the extracted answer: 1 if a gold is contained in it, else 0."""

    name = "sub_em"
    score = staticmethod(sub_exact_match)


class ExactMatchReward(_AnswerScoreReward):
    """Exact match of the extracted answer (the BRIDGE / Search-R1 outcome reward), optionally format-shaped.

    With ``format_bonus = b > 0`` (Search-R1's structure-format shaping, with its final-format and
    retrieval bonuses set to 0), ``is_valid_format`` decides the reward together with EM:

    ==============  ============  ==============
    answer          valid format  invalid format
    ==============  ============  ==============
    correct         1             1 - b
    wrong / none    b             0
    ==============  ============  ==============

    ``b`` must lie in [0, 0.5) so that every correct answer outranks every wrong one. The format check needs
    the response alone, so shaping cannot be combined with ``skip_first`` (text that includes the prompt).
    """

    score = staticmethod(exact_match)

    def __init__(self, format_bonus: float = 0.0, skip_first: bool = False) -> None:
        super().__init__(skip_first)
        if not 0.0 <= format_bonus < 0.5:
            raise ValueError(f"ExactMatchReward: format_bonus must be in [0, 0.5), got {format_bonus}")
        if format_bonus > 0 and skip_first:
            raise ValueError(
                "ExactMatchReward: format_bonus > 0 checks the format of the response alone, "
                "but skip_first=True means the text includes the prompt; use one or the other"
            )
        self.format_bonus = format_bonus
        self.name = "em_format" if format_bonus > 0 else "em"

    def __call__(self, response: str, golds: list[str]) -> float:
        em = super().__call__(response, golds)
        if self.format_bonus == 0.0:
            return em
        valid = is_valid_format(response)
        if em:
            return 1.0 if valid else 1.0 - self.format_bonus
        return self.format_bonus if valid else 0.0
