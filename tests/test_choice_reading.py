"""Which option a multiple-choice answer names: one table of answer styles, read by ``choice_letter`` and by MIRAGE's
own grader (written out below as the reference), and the reward, accuracy and predictions file agreeing on each.

MIRAGE's grader (Teddy-XiongGZ/MIRAGE, ``src/evaluate.py`` with ``locate_answer`` of ``src/utils.py``) takes the
text after ``"answer_choice": "`` when the output holds that JSON field (else the whole output), then tries, in
order: a capital A-D alone, or at the start followed by `` or``, `` and``, ``/`` or ``,``; ``option X`` / ``Option X``
anywhere; a colon, spaces and a capital A-D anywhere; a capital A-D at the start followed by ``.``, ``"`` or ``:``.
With none of these it answers "A". Ours differs on purpose wherever a row of TABLE names a reason of DIFFERENCES.
"""

import re

import pytest

from bridge_pl.metrics import QAMetrics, set_means
from bridge_pl.records import QAExample
from bridge_pl.rewards import choice_letter
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.rollout.engine import Trajectory
from callbacks.qa_eval import prediction_records

# (searched from the start of the text only, pattern whose group 1 is the letter), in the grader's order
MIRAGE_RULES = (
    (True, r"\s*([ABCD])$"),
    (True, r"\s*([ABCD]) or"),
    (True, r"\s*([ABCD]) and"),
    (True, r"\s*([ABCD])/"),
    (True, r"\s*([ABCD]),"),
    (False, r"[Oo]ption ([ABCD])"),
    (False, r":\s*([ABCD])"),
    (True, r"\s*([ABCD])\."),
    (True, r'\s*([ABCD])"'),
    (True, r"\s*([ABCD]):"),
)
MIRAGE_FIELD = '"answer_choice": "'


def mirage_letter(answer: str) -> str:
    """The letter MIRAGE's grader reads from ``answer`` (always one of A-D: "A" when no rule matches)."""
    text = answer.split(MIRAGE_FIELD)[-1].strip()
    for anchored, pattern in MIRAGE_RULES:
        found = re.match(pattern, text) if anchored else re.search(pattern, text)
        if found:
            return found[1]
    return "A"


# Every way in which our reading departs from MIRAGE's on purpose.
DIFFERENCES = {
    "text": "an option's text without a letter: MIRAGE reads letters only (falling back to A); we read the text",
    "none": "an answer that names no option (a text no option has, 'not A', a letter not among the options, "
            "nothing): MIRAGE falls back to A; we give None",
    "style": "a letter in a form MIRAGE's rules miss (lower case, brackets, markdown, quotes, 'The answer is B', "
             "'B)', 'B - text', 'B text'): MIRAGE falls back to A; we read the letter",
    "two": "two letters ('A or B', 'A, B', 'A/B', 'C and D'): MIRAGE takes the first; we give None",
    "disagree": "a letter followed by another option's text ('C. London' where London is B): MIRAGE reads the "
                "letter (or falls back to A); we give None",
    "beyond_d": "a letter after D (five-option sets): MIRAGE reads A-D only; we read any letter of the options",
    "colon_word": "a colon before a word with a capital A-D ('Answer: Berlin'): MIRAGE reads the capital as the "
                  "letter; we read the word",
    "letter_or_text": "a letter followed by words that, with the letter, are another option's text ('B. cereus' "
                      "where option C is 'B. cereus'): MIRAGE reads the letter; we give None (either is possible)",
}

CITIES = {"A": "Paris", "B": "London", "C": "Berlin", "D": "Rome"}
BLOOD = {"A": "O", "B": "A", "C": "B", "D": "AB"}  # texts that are letters
ARTICLES = {"A": "A virus", "B": "The liver", "C": "An enzyme", "D": "Bacteria"}  # texts led by an article
VIRUS = {"A": "Bacterium", "B": "Virus", "C": "Fungus", "D": "Prion"}
YES_NO = {"A": "yes", "B": "no", "C": "maybe"}  # PubMedQA*
NUMBERS = {"A": "5", "B": "10", "C": "15", "D": "20"}
ABOVE = {"A": "Aspirin", "B": "Heparin", "C": "All of the above", "D": "None of the above"}
MICROBES = {"A": "E. coli", "B": "S. aureus", "C": "B. cereus", "D": "Listeria"}  # texts that start like letters
CELLS = {"A": "Hepatocyte", "B": "Type II pneumocyte", "C": "Beta cell", "D": "Kupffer cell", "E": "Neutrophil"}

# (options, answer as written inside <answer>, the letter we read, the DIFFERENCES reason or None when MIRAGE agrees)
TABLE = [
    (CITIES, "B", "B", None),
    (CITIES, "b", "B", "style"),
    (CITIES, "B.", "B", None),
    (CITIES, "(B)", "B", "style"),
    (CITIES, "[B]", "B", "style"),
    (CITIES, "B)", "B", "style"),
    (CITIES, "B:", "B", None),
    (CITIES, "**B**", "B", "style"),
    (CITIES, "Answer: B", "B", None),
    (CITIES, "The answer is B", "B", "style"),
    (CITIES, "The answer is (B).", "B", "style"),
    (CITIES, "The correct answer is B. London", "B", "style"),
    (CITIES, "Option B", "B", None),
    (CITIES, "option b", "B", "style"),
    (CITIES, "B. London", "B", None),
    (CITIES, "B) London", "B", "style"),
    (CITIES, "(B) London", "B", "style"),
    (CITIES, "B - London", "B", "style"),
    (CITIES, "B London", "B", "style"),
    (CITIES, "London", "B", "text"),
    (CITIES, "london.", "B", "text"),
    (CITIES, "A", "A", None),
    (CITIES, "A. Paris", "A", None),
    (CITIES, "Paris", "A", None),  # MIRAGE's fallback happens to be right
    (CITIES, "A. London", None, "disagree"),
    (CITIES, "(A) London", None, "disagree"),
    (CITIES, "A) London", None, "disagree"),
    (CITIES, "a. Rome", None, "disagree"),
    (CITIES, "C. London", None, "disagree"),
    (CITIES, "A or B", None, "two"),
    (CITIES, "A, B", None, "two"),
    (CITIES, "A/B", None, "two"),
    (CITIES, "C and D", None, "two"),
    (CITIES, "Answer: A or B", None, "two"),
    (CITIES, "not A", None, "none"),
    (CITIES, "Not B", None, "none"),
    (CITIES, "E", None, "none"),
    (CITIES, "Madrid", None, "none"),
    (CITIES, "", None, "none"),
    (CITIES, "I am not sure", None, "none"),
    (CITIES, "Answer: Berlin", "C", "colon_word"),
    (CITIES, '{"step_by_step_thinking": "Big Ben is in London.", "answer_choice": "B"}', "B", None),
    (CITIES, '{"answer_choice": "B. London"}', "B", None),
    (CITIES, "Final answer: D", "D", None),
    (CITIES, "The answer is B because London is the capital", "B", "style"),
    (CITIES, "B, because the capital is London", "B", None),
    (CITIES, "'C'", "C", "style"),
    (CITIES, "  D  ", "D", None),
    (BLOOD, "B", "B", None),
    (BLOOD, "(B)", "B", "style"),
    (BLOOD, "B.", "B", None),
    (BLOOD, "AB", "D", "text"),
    (BLOOD, "A", "A", None),
    (BLOOD, "O", "A", None),  # a letter no option has, but option A's whole text
    (BLOOD, "D. AB", "D", None),
    (BLOOD, "C. B", "C", None),
    (BLOOD, "B. B", None, "disagree"),  # B's text is "A"; "B" is option C's
    (BLOOD, "Blood group AB", None, "none"),
    (BLOOD, "The answer is AB", "D", "text"),
    (ARTICLES, "A virus", "A", None),
    (ARTICLES, "The liver", "B", "text"),
    (ARTICLES, "the liver.", "B", "text"),
    (ARTICLES, "An enzyme", "C", "text"),
    (ARTICLES, "B. The liver", "B", None),
    (ARTICLES, "A. A virus", "A", None),
    (ARTICLES, "The answer is the liver", "B", "text"),
    (ARTICLES, "liver", None, "none"),  # articles are kept: "liver" is not "The liver"
    (ARTICLES, "C", "C", None),
    (VIRUS, "A virus", None, "none"),  # not option A (Bacterium), and "A virus" is not "Virus"
    (VIRUS, "The answer is A virus", None, "disagree"),  # letter A, and the text names B
    (VIRUS, "B. Virus", "B", None),
    (YES_NO, "yes", "A", None),
    (YES_NO, "No", "B", "text"),
    (YES_NO, "Maybe.", "C", "text"),
    (YES_NO, "B", "B", None),
    (YES_NO, "(C) maybe", "C", "style"),
    (YES_NO, "Yes, the drug works", None, "none"),
    (YES_NO, "Answer: no", "B", "text"),
    (YES_NO, "The answer is yes", "A", None),
    (NUMBERS, "10", "B", "text"),
    (NUMBERS, "B. 10", "B", None),
    (NUMBERS, "B. 15", None, "disagree"),
    (NUMBERS, "15 mg", None, "none"),
    (NUMBERS, "(20)", "D", "text"),
    (NUMBERS, "Answer: 5", "A", None),
    (ABOVE, "All of the above", "C", "text"),
    (ABOVE, "None of the above", "D", "text"),
    (ABOVE, "C. All of the above", "C", None),
    (ABOVE, "D", "D", None),
    (ABOVE, "none of the above.", "D", "text"),
    (ABOVE, "Aspirin and heparin", None, "none"),
    (MICROBES, "E. coli", "A", None),  # E is no option's letter: the whole text is option A's
    (MICROBES, "s. aureus", "B", "text"),
    (MICROBES, "B. cereus", None, "letter_or_text"),
    (MICROBES, "C. B. cereus", "C", None),
    (MICROBES, "Listeria", "D", "text"),
    (MICROBES, "E. faecalis", None, "none"),
    (CELLS, "E", "E", "beyond_d"),
    (CELLS, "(e)", "E", "beyond_d"),
    (CELLS, "E. Neutrophil", "E", "beyond_d"),
    (CELLS, "Option E", "E", "beyond_d"),
    (CELLS, "C Beta cell", "C", "style"),
    (CELLS, "c) because insulin comes from islets", "C", "style"),
    (CELLS, "Beta cell", "C", "text"),
    (CELLS, "Beta cells of the islets", None, "none"),
    (CELLS, "F", None, "none"),
    (CELLS, "**Answer:** C", "C", "style"),
    (CELLS, "Answer: **C**", "C", "style"),
    (CELLS, "__D__", "D", "style"),
    (CELLS, "D: Kupffer cell", "D", None),
    (CELLS, "The final answer is: B", "B", None),
]
SETS = {"cities": CITIES, "blood": BLOOD, "articles": ARTICLES, "virus": VIRUS, "yes_no": YES_NO, "numbers": NUMBERS,
        "above": ABOVE, "microbes": MICROBES, "cells": CELLS}
IDS = [f"{next(k for k, v in SETS.items() if v is options)}|{answer}" for options, answer, _, _ in TABLE]


def test_the_table_holds_at_least_sixty_styles_and_every_kind_of_option_set():
    assert len(TABLE) >= 60
    assert {id(options) for options, *_ in TABLE} == {id(o) for o in SETS.values()}
    assert {why for *_, why in TABLE} - {None} == set(DIFFERENCES)  # every reason listed is used


@pytest.mark.parametrize(("options", "answer", "letter", "why"), TABLE, ids=IDS)
def test_each_style_is_read_as_the_table_says(options, answer, letter, why):
    assert choice_letter(answer, options) == letter


@pytest.mark.parametrize(("options", "answer", "letter", "why"), TABLE, ids=IDS)
def test_ours_and_mirage_agree_except_where_a_difference_is_listed(options, answer, letter, why):
    assert why is None or why in DIFFERENCES
    assert (mirage_letter(answer) == letter) == (why is None), DIFFERENCES.get(why, "listed as agreeing")


def test_the_mirage_reference_reads_its_own_examples():
    assert mirage_letter('{"step_by_step_thinking": "...", "answer_choice": "C"}') == "C"
    assert mirage_letter("B or C") == "B" and mirage_letter("the option D is right") == "D"
    assert mirage_letter("(C)") == "A"  # no rule matches: the fallback


@pytest.mark.parametrize("options", SETS.values(), ids=SETS.keys())
def test_a_letter_form_is_its_letter_whatever_the_option_texts(options):
    """Every letter of every option set, in every letter form, alone or with its own text: that letter."""
    for letter, text in options.items():
        for written in (letter, letter.lower(), f"({letter})", f"[{letter}]", f"{letter}.", f"{letter})",
                        f"{letter}:", f"**{letter}**", f"Answer: {letter}", f"The answer is {letter}",
                        f"The correct option is ({letter.lower()}).", f"Option {letter}", f"{letter}. {text}",
                        f"({letter}) {text}", f"{letter}) {text}", f"**{letter}.** {text}"):
            assert choice_letter(written, options) == letter, written
        for other, other_text in options.items():
            if other != letter:  # a letter and another option's text
                assert choice_letter(f"{letter}. {other_text}", options) is None, (letter, other_text)
    for absent in "FGZ":
        assert choice_letter(absent, options) is None and choice_letter(f"({absent})", options) is None


@pytest.mark.parametrize(("options", "answer", "letter", "why"), TABLE, ids=IDS)
def test_the_stored_answer_reads_back_as_the_letter_it_was_read_as(options, answer, letter, why):
    """A batch stores a multiple-choice answer as its letter (as written when it names none); a caller that has only
    that text reads the same letter from it."""
    assert choice_letter(letter or answer, options) == letter


# ---- reward, accuracy and the predictions file: one letter, read once ------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import tiny_module

    return tiny_module(tmp_path_factory.mktemp("tiny"))


def _written(tokenizer, text: str) -> Trajectory:
    """A trajectory in which the policy wrote ``text`` (every token sampled by the policy)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Trajectory(0, [1], ids, [1] * len(ids), text, [], 1, 1, 0, True)


def test_reward_accuracy_and_predictions_file_agree_on_every_case(tiny):
    """Every table row against every gold letter of its options, through the datamodule's scorer, a RolloutBatch,
    QAMetrics and QAEval's prediction records; the MIRAGE average over two sets through set_means."""
    module, data = tiny
    tokenizer = module.policy.tokenizer
    cases = [(options, answer, letter, gold) for options, answer, letter, _ in TABLE for gold in options]
    examples = [QAExample(f"q{i}", "Which one?", [gold], {"options": options, "type": "t"})
                for i, (options, _, _, gold) in enumerate(cases)]
    trajectories = [_written(tokenizer, f"<think>x</think><answer>{answer}</answer>") for _, answer, _, _ in cases]
    scores = data.collector.score(module.policy.tokenizer, trajectories, examples)
    assert [score.choice for score in scores] == [letter for _, _, letter, _ in cases]  # the table's reading
    half = len(cases) // 2
    per_set, records = {}, []
    for name, part in (("mirage/one", slice(None, half)), ("mirage/two", slice(half, None))):
        batch = RolloutBatch.from_trajectories(
            trajectories[part], pad_token_id=0, answers=[s.answer for s in scores[part]],
            rewards=[s.reward for s in scores[part]], choices=[s.choice for s in scores[part]],
            golds=[ex.golden_answers for ex in examples[part]], questions=[ex.question for ex in examples[part]],
            example_ids=[ex.id for ex in examples[part]], metadata=[ex.metadata for ex in examples[part]],
            policy_version=0, retriever_version=0, dataset=name)
        metric = QAMetrics()
        metric.update_from_rollouts(batch)
        per_set[f"val/{name}"] = {key: float(value) for key, value in metric.compute().items()}
        records += prediction_records(batch, lambda row: None)
        rewards = batch.rewards.tolist()
        assert per_set[f"val/{name}"]["accuracy"] == pytest.approx(sum(rewards) / len(rewards))
        assert per_set[f"val/{name}"]["em"] == pytest.approx(sum(rewards) / len(rewards))
    for (_, answer, letter, gold), score, record in zip(cases, scores, records, strict=True):
        expected = float(letter == gold)
        assert score.reward == record["reward"] == record["em"] == record["f1"] == expected, (answer, gold)
        assert record["prediction"] == score.answer and (letter is None or record["prediction"] == letter)
    assert 0 < sum(score.reward for score in scores) < len(scores)
    average = set_means(per_set, "val")["val/mirage/accuracy"]
    assert average == pytest.approx((per_set["val/mirage/one"]["accuracy"] + per_set["val/mirage/two"]["accuracy"]) / 2)


def test_metrics_score_the_letter_the_batch_carries_and_never_read_the_answer_again():
    """A multiple-choice question scores its carried letter: an answer text that another reading would take for the
    gold letter does not count, and a metric given options without letters refuses."""
    metric = QAMetrics()
    metric.update(["B", "B"], [["C"], ["B"]], [1, 1], [0, 0], [1, 1], [1, 1], [BLOOD, BLOOD], ["B", None])
    assert float(metric.compute()["accuracy"]) == 0.0
    with pytest.raises(ValueError, match="need choices"):
        metric.update(["B"], [["B"]], [1], [0], [1], [1], [BLOOD])
