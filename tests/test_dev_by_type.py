"""experiments/dev_by_type.py: counting searches that repeat an earlier query of the same trajectory, and EM split by
whether a gold passage of every hop was shown."""

from helpers import load_script


def test_repeated_queries_counts_later_searches_per_record():
    records = [
        {"searches": [{"query": "q"}, {"query": "q"}, {"query": "r"}]},  # 2 later searches, the first repeats
        {"searches": [{"query": "a"}, {"query": "b"}]},  # 1 later search, new
        {"searches": [{"query": "b"}]},  # no later search; "b" of the record above does not count
        {"searches": []},
    ]
    assert load_script("experiments", "dev_by_type").repeated_queries(records) == (1, 3)


def test_em_by_gold_shown_needs_a_gold_passage_of_every_hop_over_all_searches():
    gold = {"a": [{"p1"}], "b": [{"p2"}, {"p3", "p5"}], "c": [{"p4"}], "e": [{"p6"}, {"p7"}]}
    records = [
        {"id": "a", "em": 1.0, "searches": [{"ids": ["x", "p1"]}]},  # shown, right
        {"id": "b", "em": 0.0, "searches": [{"ids": ["p2"]}, {"ids": ["p5"]}]},  # both hops, over two searches
        {"id": "c", "em": 1.0, "searches": [{"ids": ["p1"]}]},  # another question's gold: not shown
        {"id": "d", "em": 1.0, "searches": [{"ids": ["p4"]}]},  # no gold known: left out
        {"id": "c", "em": 0.0, "searches": []},  # no search: not shown
        {"id": "e", "em": 1.0, "searches": [{"ids": ["p6"]}]},  # one hop of two: not shown
    ]
    assert load_script("experiments", "dev_by_type").em_by_gold_shown(records, gold) == {"shown": (2, 0.5),
                                                                             "not shown": (3, 2 / 3)}
