"""benchmarks/dev_by_type.py: counting searches that repeat an earlier query of the same trajectory."""

from helpers import load_benchmark


def test_repeated_queries_counts_later_searches_per_record():
    records = [
        {"searches": [{"query": "q"}, {"query": "q"}, {"query": "r"}]},  # 2 later searches, the first repeats
        {"searches": [{"query": "a"}, {"query": "b"}]},  # 1 later search, new
        {"searches": [{"query": "b"}]},  # no later search; "b" of the record above does not count
        {"searches": []},
    ]
    assert load_benchmark("dev_by_type").repeated_queries(records) == (1, 3)
