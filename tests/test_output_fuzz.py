"""Model-output fuzz: whatever a policy writes, the env parser, answer extraction and the format check return
a value (never raise) and stay linear in the text length (adversarial megabyte strings included).

A seeded generator (no extra dependency) builds 10,000 strings: random unicode, random soups of the grammar's
tags and their fragments, nested and unclosed tags, only-closing tags, hundreds of searches, and a few
megabyte-long texts. The same seed gives the same strings, so a failure is reproducible from its index.
"""

import random

import pytest

from bridge_pl.models import load_tokenizer
from bridge_pl.rewards import exact_match, extract_answer, is_valid_format, normalize_answer
from bridge_pl.rollout import EnvConfig, SearchEnv

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
