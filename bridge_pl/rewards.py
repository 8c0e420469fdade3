"""Answer extraction, SQuAD answer normalisation, EM / F1 / sub-EM scores, the format check, and rewards.

Scores follow the official SQuAD v1.1 evaluation script (``normalize_answer``, exact match, token F1 with
a Counter intersection), with one deliberate deviation: **a comparison in which either side normalises to
the empty string scores 0**. A blank prediction is never correct, and a gold such as ``"the"`` (which
normalises to ``""``) can never be matched. Official SQuAD EM would score ``""`` against ``"the"`` as 1,
and sub-EM would score every prediction 1 against such a gold; official F1 already scores both 0.
Accents and non-ASCII punctuation (curly quotes, dashes) are kept, exactly as in SQuAD.

Whether an answer occurs in a text is decided in one place, :func:`contains_answer` (whole normalised tokens, so
gold ``"art"`` is not in ``"start"``); sub-EM is that test as a score, and the miss report and the landscape probe's
answer teacher use it on passages. (FlashRAG's sub-EM "acc" tests a character substring instead.)

Every score takes ``golds``, a non-empty list of gold answers, and returns the maximum over them.
"""

from __future__ import annotations

import functools
import json
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


def _is_token_run(text: str, gold: str) -> float:
    """1.0 if the normalised ``gold`` is a contiguous run of whole tokens of the normalised ``text``, else 0.0.

    Normalised strings are single-space-separated tokens, so padding both with a space makes a substring test
    token-aligned."""
    return float(f" {gold} " in f" {text} ")


def contains_answer(text: str | None, golds: Sequence[str]) -> bool:
    """Whether some gold answer occurs in ``text`` as whole words: after :func:`normalize_answer` of both sides, the
    gold's tokens are a contiguous run of the text's tokens.

    Gold ``"art"`` is not in ``"start"``; ``"New York"`` is in ``"I love New York City!"``; ``"the Beatles"`` is in
    ``"a song by Beatles."`` (articles and punctuation are normalised away). A gold that normalises to ``""``
    (``"the"``) occurs nowhere, and None or a text that normalises to ``""`` holds no answer. ``golds`` is checked as
    by every score here (a non-empty list of strings).
    """
    return _best_score(text, golds, _is_token_run) == 1.0


def sub_exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 if some gold answer occurs in the prediction as whole words (:func:`contains_answer`), else 0.0.

    Token-aligned, unlike FlashRAG's character-substring "acc": gold ``"art"`` does not match ``"start"``.
    """
    return _best_score(prediction, golds, _is_token_run)


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


# ---- multiple choice: which option an answer names (docs/medical.md, "Reading the answer") ----------------------

# A lead-in before the letter: "Answer:", "The answer is", "The correct option is", "Final answer -", "Choice".
_LEAD_IN = re.compile(
    r"(?:(?:so|thus|therefore|hence)\s*,?\s+)?(?:(?:the|my)\s+)?(?:(?:correct|final|best|right)\s+)?"
    r"(?:answer|option|choice)\b(?:\s+(?:is|would\s+be))?\s*(?:[:=]|[-–—](?=\s))?\s*",
    re.IGNORECASE,
)
_BRACKETED = re.compile(r"[(\[{]\s*([A-Za-z])\s*[)\]}](.*)", re.DOTALL)  # (B) [B] {B}, then the rest
_LETTER = re.compile(r"([A-Za-z])(.*)", re.DOTALL)  # a letter, then what follows it
_DELIMITER = re.compile(r"[.):;,/\]}]|\s*[-–—:](?:\s|$)")  # what may follow a letter: "B." "B)" "B -"
_OTHER_LETTER = re.compile(  # the start of a rest that gives a second letter: "or B", "and (C)", "B" after "A,"
    r"(?:(?:or|and|nor|&)\s+)?(?:[(\[{]\s*([A-Za-z])\s*[)\]}]|([A-Za-z])(?:\s*$|[.):;,/]))"
    r"|(?:or|and|nor|&)\s+([A-Za-z])(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_EDGES = " \t\r\n'\"_"  # stripped from both ends of an answer (quotes, markdown underscores)
_REST_EDGES = _EDGES + ".):;,-–—/"  # also stripped from the start of the text after a letter


def _unwrapped(answer: str) -> str:
    """``answer`` without markdown emphasis (``*``, backticks) and surrounding quotes or spaces; a JSON object with
    a string ``answer_choice`` (the format MIRAGE's prompts ask for) gives that field's value."""
    text = answer.replace("*", "").replace("`", "").strip(_EDGES)
    if text.startswith("{"):
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            return text
        if isinstance(record, dict) and isinstance(record.get("answer_choice"), str):
            return _unwrapped(record["answer_choice"])
    return text


def _without_lead_in(text: str) -> tuple[str, bool]:
    """``(text after a leading lead-in, whether there was one)``: ``"The answer is (B)."`` -> ``("(B).", True)``."""
    match = _LEAD_IN.match(text)
    return (text, False) if match is None else (text[match.end():], True)


def option_key(text: str) -> str:
    """The form in which an answer and an option text are compared: lower case, ASCII punctuation dropped, spaces
    squashed. Articles are kept: ``"A virus"`` and ``"virus"`` are different options."""
    return " ".join(text.lower().translate(_PUNCTUATION).split())


def option_by_text(text: str, options: dict[str, str]) -> str | None:
    """The letter of the one option whose text is ``text`` (compared by :func:`option_key`), or None."""
    key = option_key(text)
    letters = [letter for letter, option in options.items() if key and option_key(option) == key]
    return letters[0] if len(letters) == 1 else None


def letter_form(text: str, lead_in: bool, options: dict[str, str]) -> tuple[str, str] | None:
    """``(letter, rest)`` when ``text`` starts with a letter form, else None; ``letter`` is upper case, ``rest``
    what follows it (delimiters and spaces stripped).

    Letter forms: a letter alone (``B``, ``b``), bracketed (``(B)``, ``[B]``, ``{B}``) or before a delimiter
    (``B.``, ``B)``, ``B:``, ``B,``, ``B/``, ``B -``). A letter, a space and more words is a letter form only after
    a lead-in (upper case: ``The answer is B because ...``) or when the words are its own option's text
    (``C Beta cell``); otherwise it is read as text (``A virus``, ``I think so``).
    """
    if match := _BRACKETED.match(text):
        letter, after, spaced = match[1], match[2], False
    elif match := _LETTER.match(text):
        letter, after = match[1], match[2]
        spaced = not (after.strip() == "" or _DELIMITER.match(after))
        if spaced and not after[:1].isspace():
            return None  # "AB", "B12", "B-cell": a word, not a letter
    else:
        return None
    rest = after.strip(_EDGES if spaced else _REST_EDGES)
    own = options.get(letter.upper())
    if spaced and not (lead_in and letter.isupper()) and (own is None or option_key(rest) != option_key(own)):
        return None
    return letter.upper(), rest


def rest_agrees(letter: str, rest: str, options: dict[str, str]) -> bool:
    """Whether the text ``rest`` after a letter leaves the answer unambiguous: it is empty, the letter's own option
    text or an explanation; not another option's text (``A. London`` where London is B), not a second letter
    (``A or B``, ``A, B``, ``A/B``) and not, read with the letter, another option's text (``B. cereus`` where option
    C is "B. cereus")."""
    if not rest or option_key(rest) == option_key(options[letter]):
        return True
    if option_by_text(rest, options) not in (None, letter):
        return False
    if option_by_text(f"{letter} {rest}", options) not in (None, letter):
        return False
    second = _OTHER_LETTER.match(rest)
    return second is None or next(g for g in second.groups() if g).upper() == letter


def choice_letter(answer: str | None, options: dict[str, str]) -> str | None:
    """The option letter an answer names, or None: the reading rule of docs/medical.md ("Reading the answer").

    A letter form (:func:`letter_form`, after an optional lead-in such as ``Answer:`` or ``The answer is``) of a
    letter among ``options`` is that letter, whatever the option texts are, or None when text after it names another
    option (:func:`rest_agrees`). Otherwise the answer is matched against the option texts (:func:`option_by_text`),
    whole and after its lead-in, so a letter no option has names none unless the answer is an option's whole text
    (``E. coli``). Anything else (``not A``, ``A or B``, ``E`` of A-D, a text no option has) gives None. Markdown
    emphasis, quotes, case and a MIRAGE-style ``{"answer_choice": "B"}`` are accepted. ``options`` maps upper-case
    letters to texts.
    """
    if answer is None:
        return None
    text = _unwrapped(answer)
    remainder, lead_in = _without_lead_in(text)
    form = letter_form(remainder, lead_in, options)
    if form is not None and form[0] in options:
        letter, rest = form
        return letter if rest_agrees(letter, rest, options) else None
    # no letter form, or a letter no option has: only an option's whole text names one ("E. coli", "O")
    return option_by_text(text, options) or (option_by_text(remainder, options) if lead_in else None)


def choice_scores(letter: str | None, golds: Sequence[str]) -> dict[str, float]:
    """``{em, f1, sub_em}`` of a multiple-choice answer already read as ``letter`` (None: no option named): each is
    1.0 when it is the gold letter ``golds == [letter]``, else 0.0."""
    correct = float(letter is not None and letter == _checked_golds(golds)[0])
    return {"em": correct, "f1": correct, "sub_em": correct}


def answer_scores(prediction: str | None, golds: Sequence[str], options: dict[str, str] | None = None
                  ) -> dict[str, float]:
    """``{em, f1, sub_em}`` of one free-text prediction. With ``options`` (a multiple-choice question whose ``golds``
    is ``[letter]``) the prediction is read by :func:`choice_letter` first, for a caller that holds only the text;
    rollouts carry the letter their reward read (``RolloutBatch.choices``): score those with :func:`choice_scores`."""
    if options:
        return choice_scores(choice_letter(prediction, options), golds)
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
    """Sub-EM of the extracted answer: 1 if a gold occurs in it as whole words (:func:`contains_answer`), else 0."""

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
