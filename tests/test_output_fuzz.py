"""Model-output fuzz: whatever a policy writes, the env parser, answer extraction and the format check return
a value (never raise) and stay linear in the text length (adversarial megabyte strings included).

A seeded generator (no extra dependency) builds 10,000 strings: random unicode, random soups of the grammar's
tags and their fragments, nested and unclosed tags, only-closing tags, hundreds of searches, and a few
megabyte-long texts. The same seed gives the same strings, so a failure is reproducible from its index.

``parse_action`` takes any ``str``, also text no tokenizer decode gives (a reward plug-in's or a file's): a second
seeded set sprinkles lone UTF-16 surrogates into nested, unclosed and interleaved tags and long texts, and the
parser, under several tokenizers and query budgets, returns a well-formed action for each.
"""

import random

import pytest

from bridge_pl.models import load_tokenizer
from bridge_pl.rewards import exact_match, extract_answer, is_valid_format, normalize_answer
from bridge_pl.rollout import EnvConfig, SearchEnv
from bridge_pl.rollout.env import Action

TAGS = ("think", "search", "answer", "information")
PIECES = [f"<{t}>" for t in TAGS] + [f"</{t}>" for t in TAGS] + [
    "<", ">", "</", "/>", "<<search>>", "<search", "search>", "< search >", "<SEARCH>", "<answer/>", "\n", " ",
    "Paris", "the", "Doc 1(Title: \"x\")", "\u200b", "\ufffd", "é", "日本", "🙂", "\\", "$", "(?:", ".*", "\x00",
]
N_STRINGS = 10_000


def _random_unicode(rng: random.Random, n: int) -> str:
    points = []
    for _ in range(n):
        cp = rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0xD800), rng.randrange(0xE000, 0x110000)))
        points.append(chr(cp))
    return "".join(points)


def _soup(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) if rng.random() < 0.7 else _random_unicode(rng, rng.randrange(1, 6))
                   for _ in range(n))


def _nested(rng: random.Random, depth: int) -> str:
    if depth == 0:
        return _random_unicode(rng, rng.randrange(0, 8))
    tag = rng.choice(TAGS)
    close = f"</{tag}>" if rng.random() < 0.6 else ""
    return f"<{tag}>" + "".join(_nested(rng, depth - 1) for _ in range(rng.randrange(1, 3))) + close


SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff", "\ud83d", "\ude00")  # highs, lows, an emoji's halves
N_NASTY = 3_000


def _with_surrogates(rng: random.Random, n: int) -> str:
    """``n`` grammar pieces, about a third of them lone surrogates (one at least)."""
    parts = [rng.choice(SURROGATES) if rng.random() < 0.3 else rng.choice(PIECES) for _ in range(n - 1)]
    parts.insert(rng.randrange(n), rng.choice(SURROGATES))
    return "".join(parts)


def _interleaved(rng: random.Random) -> str:
    """Tags inside tags, opened and closed out of order, with surrogates between them."""
    tags = [rng.choice(TAGS) for _ in range(rng.randrange(2, 8))]
    opened = "".join(f"<{t}>{rng.choice(SURROGATES)}" for t in tags)
    rng.shuffle(tags)
    return opened + "".join(f"q{rng.choice(SURROGATES)}</{t}>" for t in tags[: rng.randrange(0, len(tags) + 1)])


def nasty_strings(seed: int = 1, n: int = N_NASTY) -> list[str]:
    """Strings with lone surrogates in every position of the grammar, and a few long ones."""
    rng = random.Random(seed)
    makers = [
        lambda: _with_surrogates(rng, rng.randrange(1, 60)),
        lambda: _interleaved(rng),
        lambda: f"<search>{_nested(rng, rng.randrange(1, 5))}{rng.choice(SURROGATES)}</search>",
        lambda: f"<search>{rng.choice(SURROGATES) * rng.randrange(1, 300)} q</search>",
        lambda: f"<answer>{_with_surrogates(rng, 5)}</answer>" + rng.choice(SURROGATES),
        lambda: "<information>" + rng.choice(SURROGATES) + "<search>x</search>" * rng.randrange(0, 3),
    ]
    out = [rng.choice(makers)() for _ in range(n - 3)]
    out += ["<search>" + "\ud800" * 200_000 + "</search>", "<search>" + "<search>\udc00" * 50_000 + "q</search>",
            "<answer>" + "\udfffa" * 100_000]
    return out


def fuzz_strings(seed: int = 0, n: int = N_STRINGS) -> list[str]:
    rng = random.Random(seed)
    makers = [
        lambda: _random_unicode(rng, rng.randrange(0, 200)),
        lambda: _soup(rng, rng.randrange(0, 60)),
        lambda: _nested(rng, rng.randrange(1, 6)),
        lambda: "".join(f"</{rng.choice(TAGS)}>" for _ in range(rng.randrange(1, 30))),
        lambda: "<think> ok </think>" + "<search> q </search>" * rng.randrange(1, 400),
        lambda: "<answer>" * rng.randrange(1, 300) + "x" + "</answer>" * rng.randrange(0, 3),
    ]
    out = [rng.choice(makers)() for _ in range(n - 4)]
    # megabyte-long adversarial texts: the patterns that make backtracking regexes blow up
    out += ["<answer>" + "a" * 1_000_000, "<answer>" * 200_000, "<search> " + "x " * 500_000,
            "<information>" + "<search>" * 100_000]
    return out


@pytest.fixture(scope="module")
def env():
    return SearchEnv(EnvConfig(max_query_tokens=16), load_tokenizer("tiny-llama"))


def test_fuzz_strings_are_seeded_and_cover_the_adversarial_kinds():
    strings = fuzz_strings()
    assert len(strings) == N_STRINGS and strings[:50] == fuzz_strings()[:50]
    assert max(map(len, strings)) >= 1_000_000 and any(s.count("<search>") >= 100 for s in strings)


def test_parser_and_answer_extraction_never_raise_on_model_output(env):
    kinds = {"search": 0, "answer": 0, "invalid": 0}
    for i, text in enumerate(fuzz_strings()):
        try:
            action = env.parse_action(text)
            answer = extract_answer(text)
            valid = is_valid_format(text)
            em = exact_match(answer, ["Paris"]) if answer is not None else 0.0
            normalize_answer(text[:10_000])
        except Exception as error:  # pragma: no cover - the message is the point
            pytest.fail(f"fuzz string #{i} ({text[:80]!r}...) raised {type(error).__name__}: {error}")
        kinds[action.kind] += 1
        assert action.kind != "search" or action.content.strip()
        assert answer is None or isinstance(answer, str)
        assert isinstance(valid, bool) and em in (0.0, 1.0)
    assert all(kinds.values()), kinds  # the generator reaches every kind of action


@pytest.mark.parametrize(("tokenizer", "query_tokens"), [("tiny-llama", 16), ("tiny-llama", 1), ("tiny-bert", 3)])
def test_parse_action_returns_a_well_formed_action_for_any_str(tokenizer, query_tokens):
    env = SearchEnv(EnvConfig(max_query_tokens=query_tokens), load_tokenizer(tokenizer))
    strings = nasty_strings()
    assert sum(any(ch in text for ch in SURROGATES) for text in strings) == len(strings)
    kinds = {"search": 0, "answer": 0, "invalid": 0}
    for i, text in enumerate(strings):
        try:
            action = env.parse_action(text)
        except Exception as error:  # pragma: no cover - the message is the point
            pytest.fail(f"nasty string #{i} ({text[:80]!r}...) raised {type(error).__name__}: {error}")
        kinds[action.kind] += 1
        action.content.encode("utf-8")  # what reaches the retriever, the reward and the logs is valid text
        assert (action.kind == "invalid") == (action.content == "")
        assert action.kind == "invalid" or action.content.strip()
    assert kinds["search"] and kinds["answer"] and kinds["invalid"], kinds


def test_a_lone_surrogate_reads_as_the_replacement_character(env):
    assert env.parse_action("<search>who \ud800wrote\udfff it</search>") == Action("search", "who \ufffdwrote\ufffd it")
    assert env.parse_action("<answer>\udc00 Paris</answer>") == Action("answer", "\ufffd Paris")
