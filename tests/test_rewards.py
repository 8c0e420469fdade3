"""Answer normalisation, EM / F1 / sub-EM, answer extraction, the format check and the reward classes."""

import pytest

from bridge_pl.rewards import (
    ExactMatchReward,
    F1Reward,
    RewardFunction,
    SubEMReward,
    contains_answer,
    exact_match,
    extract_answer,
    f1_score,
    is_valid_format,
    normalize_answer,
    sub_exact_match,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Beatles", "beatles"),
        ("An apple a day", "apple day"),
        ("Theory of Anarchy", "theory of anarchy"),  # articles only as whole words
        ("A.I.", "ai"),  # punctuation goes first, so "a" is no longer a word of its own
        ("  New \t York\n", "new york"),
        ("1,000.5", "10005"),
        ("ZÜRICH", "zürich"),  # lower-cased, accents kept
        ("“Imagine”", "“imagine”"),  # curly quotes are not ASCII punctuation
        ("the", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


# (prediction, golds, EM, F1, sub-EM); F1 values are computed by hand.
SCORE_TABLE = [
    ("The Beatles", ["beatles"], 1.0, 1.0, 1.0),
    ("Beatles!", ["the beatles"], 1.0, 1.0, 1.0),
    ("U.S.A.", ["USA"], 1.0, 1.0, 1.0),
    ("rock-n-roll", ["rock n roll"], 0.0, 0.0, 0.0),  # "rocknroll" vs three tokens
    ("Zürich", ["zurich"], 0.0, 0.0, 0.0),  # SQuAD does not strip accents
    ("ZÜRICH", ["zürich"], 1.0, 1.0, 1.0),
    ("“Imagine”", ["Imagine"], 0.0, 0.0, 0.0),  # curly quotes stay: the one token "“imagine”" is not "imagine"
    ('"Imagine"', ["Imagine"], 1.0, 1.0, 1.0),
    ("Barack Obama", ["Obama"], 0.0, 2 / 3, 1.0),  # P = 1/2, R = 1
    ("Obama", ["Barack Hussein Obama"], 0.0, 0.5, 0.0),  # P = 1, R = 1/3
    ("new york new york", ["New York City"], 0.0, 4 / 7, 0.0),  # overlap 2: P = 2/4, R = 2/3
    ("Paris", ["London", "Paris, France", "paris"], 1.0, 1.0, 1.0),  # max over golds
    ("Paris", ["London", "Paris, France"], 0.0, 2 / 3, 0.0),
    ("start", ["art"], 0.0, 0.0, 0.0),  # sub-EM is whole words (contains_answer), not a character substring
    ("1,000", ["1000"], 1.0, 1.0, 1.0),
    ("3.14", ["314"], 1.0, 1.0, 1.0),
    ("1 000", ["1000"], 0.0, 0.0, 0.0),
    ("2", ["two"], 0.0, 0.0, 0.0),
    ("  New   York\n", ["new york"], 1.0, 1.0, 1.0),
    ("", ["beatles"], 0.0, 0.0, 0.0),
    (None, ["beatles"], 0.0, 0.0, 0.0),
    # Documented deviation: empty normalised strings never match (official SQuAD EM would give 1 here).
    ("the", ["The"], 0.0, 0.0, 0.0),
    ("a", ["the", "A"], 0.0, 0.0, 0.0),
    ("beatles", ["the", "The Beatles"], 1.0, 1.0, 1.0),  # an empty gold is skipped, not fatal
]


@pytest.mark.parametrize(("prediction", "golds", "em", "f1", "sub_em"), SCORE_TABLE)
def test_scores_match_squad_definitions(prediction, golds, em, f1, sub_em):
    assert exact_match(prediction, golds) == em
    assert f1_score(prediction, golds) == pytest.approx(f1, abs=1e-12)
    assert sub_exact_match(prediction, golds) == sub_em


# (text, golds, contains): contains_answer, the one "is the answer in this text" test (sub-EM, the miss report's
# answer string, the landscape probe's answer teacher).
CONTAINS_TABLE = [
    ("start", ["art"], False),  # whole words: "art" is not in "start"
    ("the art of war", ["art"], True),
    ("I love New York City!", ["new york"], True),  # a multiword gold: a contiguous run of the text's tokens
    ("York, New", ["New York"], False),  # the same tokens out of order
    ("new jersey and york", ["New York"], False),  # not contiguous
    ("Beatles, The", ["the Beatles"], True),  # articles and punctuation normalised on both sides
    ("He was born in the U.S.A. in 1961", ["USA"], True),
    ("It is PARIS, France", ["paris"], True),
    ("Parisian food", ["Paris"], False),
    ("rock n roll", ["rock-n-roll"], False),  # "rocknroll" is one token
    ("Zürich", ["zurich"], False),  # accents are kept
    ("“Imagine” by Lennon", ["Imagine"], False),  # curly quotes are kept, so "“imagine”" is one token
    ("the end", ["The"], False),  # a gold that normalises to "" occurs nowhere
    ("the end", [""], False),  # nor does an empty gold
    ("the end", ["", "End"], True),  # an empty gold is skipped, not fatal
    ("", ["end"], False),
    ("the a an", ["end"], False),  # a text that normalises to ""
    (None, ["end"], False),
    ("Lyon or Paris", ["London", "Paris"], True),  # any gold
]


@pytest.mark.parametrize(("text", "golds", "contains"), CONTAINS_TABLE)
def test_contains_answer_by_whole_normalised_tokens(text, golds, contains):
    assert contains_answer(text, golds) is contains
    assert sub_exact_match(text, golds) == float(contains)  # sub-EM is the same test, as a score


@pytest.mark.parametrize("score", [exact_match, f1_score, sub_exact_match, contains_answer])
def test_scores_reject_bad_golds(score):
    with pytest.raises(TypeError, match="list of answer strings"):
        score("x", "x")
    with pytest.raises(ValueError, match="golds is empty"):
        score(None, [])
    with pytest.raises(TypeError, match="golds must hold strings"):
        score("x", [1])
    with pytest.raises(TypeError, match="prediction must be"):
        score(3, ["3"])


@pytest.mark.parametrize(
    ("text", "skip_first", "expected"),
    [
        ("<think>x</think><answer> Paris </answer>", False, "Paris"),
        ("<answer>London</answer> then <answer>Paris</answer>", False, "Paris"),  # last wins
        ("<answer>a\nb</answer>", False, "a\nb"),
        ("<answer>London</answer> <answer>Paris", False, "London"),  # unclosed tag ignored
        ("<answer>Paris", False, None),
        ("no tags at all", False, None),
        ("<answer></answer>", False, ""),
        ("<answer>x <answer>y</answer> z</answer>", False, "y"),  # a nested open tag restarts
        ("e.g. <answer> Beijing </answer>. Question: ...<answer>Paris</answer>", True, "Paris"),
        ("e.g. <answer> Beijing </answer>. Question: ...", True, None),
        ("a <answer>1</answer> b <answer>2</answer> c <answer>3</answer>", True, "3"),
    ],
)
def test_extract_answer(text, skip_first, expected):
    assert extract_answer(text, skip_first) == expected


def test_extract_answer_custom_tags():
    text = "<answer>no</answer><final>yes</final>"
    assert extract_answer(text, open_tag="<final>", close_tag="</final>") == "yes"
    with pytest.raises(ValueError, match="open_tag"):
        extract_answer(text, open_tag="<a>", close_tag="<a>")


TURN = (
    "<think>look it up</think>\n<search>capital of France</search>\n\n"
    "<information>Doc 1(Title: Paris) ...</information>\n\n"
)


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        (TURN + "<think>found it</think>\n<answer>Paris</answer>", True),
        (TURN + TURN + "<answer>Paris</answer>\n", True),
        ("<answer>Paris</answer>", True),
        ("<think></think><answer>Paris</answer>", True),  # empty thoughts are allowed
        (TURN.replace("...", "an <answer>x</answer> in a passage") + "<answer>Paris</answer>", True),
        (TURN, False),  # never answers
        ("", False),
        ("<answer>Paris</answer><answer>Rome</answer>", False),  # two answers
        ("<answer>Paris</answer> because", False),  # text after the answer
        ("I think <answer>Paris</answer>", False),  # text outside blocks
        ("<search>q</search><answer>Paris</answer>", False),  # search without information
        ("<information>x</information><answer>Paris</answer>", False),  # information without search
        ("<think>x<answer>Paris</answer>", False),  # unclosed think
        ("<think>x <search>q</search></think><answer>Paris</answer>", False),  # nested tags
        ("</think><answer>Paris</answer>", False),  # stray closing tag
        ("<search> </search><information>x</information><answer>Paris</answer>", False),  # blank query
        ("<answer> </answer>", False),  # blank answer
    ],
)
def test_is_valid_format(text, valid):
    assert is_valid_format(text) is valid


def test_is_valid_format_custom_tags():
    text = "<q>capital</q><docs>Doc 1</docs><final>Paris</final>"
    assert is_valid_format(text, search_tag="q", information_tag="docs", answer_tag="final")
    assert not is_valid_format(text)
    with pytest.raises(ValueError, match="distinct"):
        is_valid_format(text, think_tag="answer")


GOOD = TURN + "<answer>Paris</answer>"
BAD_FORMAT = "Sure! <answer>Paris</answer>"


def test_exact_match_reward_plain_and_shaped():
    golds = ["Paris"]
    plain = ExactMatchReward()
    assert plain.name == "em"
    assert [plain(r, golds) for r in (GOOD, BAD_FORMAT, GOOD.replace("Paris<", "Rome<"), "")] == [1, 1, 0, 0]

    shaped = ExactMatchReward(format_bonus=0.2)
    assert shaped.name == "em_format"
    assert shaped(GOOD, golds) == 1.0
    assert shaped(BAD_FORMAT, golds) == pytest.approx(0.8)
    assert shaped(GOOD.replace("Paris<", "Rome<"), golds) == pytest.approx(0.2)
    assert shaped(BAD_FORMAT.replace("Paris", "Rome"), golds) == 0.0
    assert shaped(TURN, golds) == 0.0  # no answer: invalid format too


def test_exact_match_reward_skip_first_and_options():
    prompt = "Answer like <answer> Beijing </answer>. Question: capital of France?\n"
    assert ExactMatchReward(skip_first=True)(prompt + GOOD, ["Paris"]) == 1.0
    assert ExactMatchReward(skip_first=True)(prompt, ["Beijing"]) == 0.0
    with pytest.raises(ValueError, match="format_bonus must be in"):
        ExactMatchReward(format_bonus=0.5)
    with pytest.raises(ValueError, match="skip_first"):
        ExactMatchReward(format_bonus=0.1, skip_first=True)


def test_f1_and_sub_em_rewards():
    response = "<answer>Barack Obama</answer>"
    assert F1Reward()(response, ["Obama"]) == pytest.approx(2 / 3)
    assert SubEMReward()(response, ["Obama"]) == 1.0
    assert F1Reward()("no answer", ["Obama"]) == 0.0
    assert (F1Reward.name, SubEMReward.name) == ("f1", "sub_em")


def test_reward_function_is_pluggable():
    with pytest.raises(TypeError):
        RewardFunction()

    class LengthPenalty(RewardFunction):
        name = "short"

        def __call__(self, response: str, golds: list[str]) -> float:
            return 1.0 / (1 + len(response))

    assert LengthPenalty()("abc", ["x"]) == 0.25
