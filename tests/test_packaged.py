"""Real data shipped in packages: counts, ids, answer conversion, gold passages."""

import pytest

from bridge_pl.data.packaged import _answer_parts, fanoutqa_questions, wikipedia_corpus
from bridge_pl.data.sources import load_corpus, load_qa


@pytest.fixture(scope="module")
def wiki():
    return wikipedia_corpus()


def test_wikipedia_corpus(wiki):
    assert len(wiki) == 10_033
    ids = [p.id for p in wiki]
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    assert all(p.text and p.title == p.id for p in wiki)
    assert wikipedia_corpus() == wiki and load_corpus("wikipedia") == wiki


def test_fanoutqa_top_and_sub(wiki):
    top, sub = fanoutqa_questions("top"), fanoutqa_questions("sub")
    assert len(top) == 310
    assert len(sub) == 2_141  # 2,142 sub-questions with evidence, one of them with an empty answer
    assert len({q.id for q in sub}) == len(sub)
    titles = {p.id for p in wiki}
    for q in top + sub:
        md = q.metadata
        assert q.golden_answers and all(a.strip() for a in q.golden_answers)
        assert len(md["gold_passages"]) == len(md["evidence_titles"])
        for title, hop in zip(md["evidence_titles"], md["gold_passages"]):
            assert hop == ([title] if title in titles else [])
    assert all(len(q.metadata["evidence_titles"]) == 1 for q in sub)
    assert sum(bool(q.metadata["gold_passages"][0]) for q in sub) == 558
    assert load_qa("fanoutqa/top") == top
    with pytest.raises(ValueError, match="level"):
        fanoutqa_questions("middle")


def test_answer_parts():
    assert _answer_parts(True) == ["yes"] and _answer_parts(3.0) == ["3"] and _answer_parts(2.5) == ["2.5"]
    assert _answer_parts(["a", 1, ""]) == ["a", "1"]
    assert _answer_parts({"A": "x", "B": [1, 2]}) == ["A: x", "B: 1, 2"]
