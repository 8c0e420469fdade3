"""benchmarks/dev_by_type.py: counting searches that repeat an earlier query of the same trajectory."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dev_by_type():
    spec = importlib.util.spec_from_file_location("dev_by_type", ROOT / "benchmarks/dev_by_type.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeated_queries_counts_later_searches_per_record():
    records = [
        {"searches": [{"query": "q"}, {"query": "q"}, {"query": "r"}]},  # 2 later searches, the first repeats
        {"searches": [{"query": "a"}, {"query": "b"}]},  # 1 later search, new
        {"searches": [{"query": "b"}]},  # no later search; "b" of the record above does not count
        {"searches": []},
    ]
    assert _dev_by_type().repeated_queries(records) == (1, 3)
