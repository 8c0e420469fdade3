"""The synthetic world: determinism, invariants, and the source specs that name it."""

import re

import pytest

from bridge_pl.data.qa import read_corpus, read_qa
from bridge_pl.data.sources import load_corpus, load_qa
from bridge_pl.data.world import build_world, write_world


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _contains(haystack: str, needle: str) -> bool:
    """Whole-word, case-insensitive containment."""
    h, n = _words(haystack), _words(needle)
    return any(h[i:i + len(n)] == n for i in range(len(h) - len(n) + 1))


@pytest.fixture(scope="module")
def world():
    return build_world(0)


def test_same_seed_same_bytes_other_seed_other_world(tmp_path):
    a, b = write_world(tmp_path / "a", seed=3), write_world(tmp_path / "b", seed=3)
    assert set(a) == {"corpus", "train", "dev", "test"}
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes(), name
    c = write_world(tmp_path / "c", seed=4)
    assert c["corpus"].read_bytes() != a["corpus"].read_bytes()
    assert read_corpus(a["corpus"]) == build_world(3).corpus
    assert read_qa(a["dev"]) == build_world(3).dev


def test_sizes_and_splits(world):
    assert 300 <= len(world.corpus) <= 2500
    assert 1000 <= len(world.train) <= 2000 and len(world.dev) == len(world.test) == 150
    texts = [{q.question for q in split} for split in (world.train, world.dev, world.test)]
    assert sum(map(len, texts)) == len(world.train) + len(world.dev) + len(world.test)  # unique everywhere
    assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    ids = [q.id for q in world.train + world.dev + world.test]
    assert len(set(ids)) == len(ids)
    for split in (world.dev, world.test):
        assert {q.metadata["type"] for q in split} == {"single", "bridge", "comparison"}


def test_invariants(world):
    by_id = {p.id: p for p in world.corpus}
    assert len(by_id) == len(world.corpus)
    for q in world.train + world.dev + world.test:
        md, (answer,) = q.metadata, q.golden_answers
        hops = {"single": 1, "bridge": 2, "comparison": 2}[md["type"]]
        assert len(md["gold_passages"]) == len(md["hops"]) == len(md["hop_queries"]) == hops
        gold = [by_id[pid] for hop in md["gold_passages"] for pid in hop]  # every gold id exists
        for entity, hop in zip(md["hops"], md["gold_passages"]):
            assert all(by_id[pid].title == entity for pid in hop)
        assert 0 < len(answer) <= 40
        if md["type"] == "comparison":
            assert answer in md["hops"] and any(_contains(p.text, answer) for p in gold)
        else:
            assert _contains(gold[-1].text, answer), q
            assert not _contains(q.question, answer), q


def test_small_worlds_build(tmp_path):
    w = build_world(5, n_people=12, n_cities=4, n_countries=2, n_orgs=2, n_dev=5, n_test=5)
    assert len(w.dev) == 5 and w.train
    with pytest.raises(ValueError, match="n_orgs"):
        build_world(0, n_people=3, n_orgs=4)


def test_sources_share_one_build(world):
    corpus = load_corpus("world")
    assert corpus == world.corpus and load_corpus("world:0") == corpus
    assert load_qa("world/dev") == world.dev and load_qa("world:0/test") == world.test
    assert load_qa("world:1/train") != load_qa("world/train")
    assert load_corpus("world:1") is not load_corpus("world:1")  # callers get their own list


def test_sources_files_and_errors(tmp_path, world):
    paths = write_world(tmp_path, seed=0, n_people=20, n_cities=6, n_countries=2, n_orgs=3, n_dev=4, n_test=4)
    assert load_corpus(str(paths["corpus"])) == read_corpus(paths["corpus"])
    assert load_qa(str(paths["dev"])) == read_qa(paths["dev"])
    with pytest.raises(ValueError, match=r'unknown QA set .*"world/SPLIT".*"fanoutqa/sub"'):
        load_qa("world/validation")
    with pytest.raises(ValueError, match=r'unknown corpus .*"wikipedia"'):
        load_corpus("nowhere.jsonl")
