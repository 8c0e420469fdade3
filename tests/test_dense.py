"""DenseRetriever with the tiny-bert encoder on a handful of passages."""

import copy
import logging
import sys
import types

import numpy as np
import pytest
import torch

from bridge_pl.records import Passage
from bridge_pl.retrieval.dense import DenseRetriever
from bridge_pl.retrieval.index import StaleIndexError

TEXTS = [
    ("Cats", "the cat sat on the mat and purred"),
    ("Paris", "paris is the capital of france"),
    ("Dogs", "dogs bark loudly at night"),
    ("Python", "python is a programming language"),
    ("Sun", "the sun is a star at the centre of the solar system"),
    ("Tea", "tea is brewed from leaves"),
]
PASSAGES = [Passage(str(i), title, text) for i, (title, text) in enumerate(TEXTS)]
QUERIES = ["capital of france", "a cat on a mat", "what is a star"]


def make(tmp_path, **kwargs) -> DenseRetriever:
    kwargs.setdefault("corpus", PASSAGES)
    return DenseRetriever(encoder="tiny-bert", cache_dir=str(tmp_path / "emb"), progress=False, **kwargs)


def perturb(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    retriever = make(tmp_path_factory.mktemp("frozen"))
    retriever.prepare()
    return retriever


def test_second_prepare_hits_the_embedding_cache(tmp_path):
    first = make(tmp_path)
    first.prepare()
    first.prepare()  # idempotent
    assert first.encoded_passages == len(PASSAGES)
    assert len(list((tmp_path / "emb").glob("*.npy"))) == 1
    second = make(tmp_path)
    second.prepare()
    assert second.encoded_passages == 0
    for a, b in zip(first.search(QUERIES, 3), second.search(QUERIES, 3), strict=True):
        assert torch.equal(a, b)


def test_score_matches_search_and_is_differentiable(frozen):
    assert frozen.training  # as in a training step: search() runs in eval mode, score() in train mode
    scores, rows = frozen.search(QUERIES, 4)
    assert scores.shape == rows.shape == (3, 4) and rows.dtype == torch.int64
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    frozen.query_encoder.zero_grad()
    fresh = frozen.score(QUERIES, rows)
    torch.testing.assert_close(fresh.detach(), scores, rtol=1e-5, atol=1e-5)
    fresh.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in frozen.query_encoder.parameters())
    passage_tower = frozen._passage_side()
    assert passage_tower is not frozen.query_encoder
    assert all(not p.requires_grad and p.grad is None for p in passage_tower.parameters())
    assert frozen.passage_encoder is None


def test_padding_rows_score_minus_inf(frozen):
    scores, rows = frozen.search(QUERIES[:1], len(PASSAGES) + 2)
    assert rows[0, -2:].tolist() == [-1, -1] and torch.isneginf(scores[0, -2:]).all()
    assert torch.isneginf(frozen.score(QUERIES[:1], rows)[0, -2:]).all()


def test_deepcopy_of_query_tower(frozen):
    _, rows = frozen.search(QUERIES, 3)
    psi = copy.deepcopy(frozen.query_encoder)
    assert all(a is not b for a, b in zip(psi.parameters(), frozen.query_encoder.parameters(), strict=True))
    torch.testing.assert_close(frozen.score(QUERIES, rows, psi), frozen.score(QUERIES, rows))
    perturb(psi)
    assert not torch.allclose(frozen.score(QUERIES, rows, psi), frozen.score(QUERIES, rows))


def test_tied_tower_goes_stale_and_refreshes(tmp_path):
    retriever = make(tmp_path, passage_tower="tied")
    retriever.prepare()
    assert retriever._passage_side() is retriever.query_encoder
    before = retriever.fingerprint()
    _, rows = retriever.search(QUERIES, 2)
    perturb(retriever.query_encoder)
    assert retriever.fingerprint() != before
    with pytest.raises(StaleIndexError, match="refresh"):
        retriever.search(QUERIES, 2)
    retriever.refresh_index()
    assert retriever.index.fingerprint == retriever.fingerprint()
    assert retriever.encoded_passages == 2 * len(PASSAGES)
    scores, rows = retriever.search(QUERIES, 2)
    torch.testing.assert_close(retriever.score(QUERIES, rows).detach(), scores, rtol=1e-5, atol=1e-5)


def test_rerank_stale_scores_with_the_current_tower(tmp_path):
    retriever = make(tmp_path, passage_tower="tied", rerank_stale=True, rerank_factor=2)
    retriever.prepare()
    perturb(retriever.query_encoder)
    scores, rows = retriever.search(QUERIES, 2)  # stale index, no error
    torch.testing.assert_close(retriever.score(QUERIES, rows).detach(), scores, rtol=1e-5, atol=1e-5)


def test_trainable_passage_tower_gets_grad(tmp_path):
    retriever = make(tmp_path, passage_tower="trainable")
    assert retriever.passage_encoder is not None
    assert retriever.passage_encoder is not retriever.query_encoder
    _, rows = retriever.search(QUERIES, 3)
    retriever.score(QUERIES, rows).sum().backward()
    for tower in (retriever.query_encoder, retriever.passage_encoder):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower.parameters())


def test_hnsw_index_is_cached_too(tmp_path):
    make(tmp_path, index="hnsw", index_options={"hnsw_m": 8}).prepare()
    assert len(list((tmp_path / "emb").glob("*.hnsw-*.index.npz"))) == 1
    again = make(tmp_path, index="hnsw", index_options={"hnsw_m": 8})
    _, rows = again.search(QUERIES, 2)
    assert again.encoded_passages == 0 and rows.shape == (3, 2)


def test_corpus_spec_is_loaded_lazily(tmp_path, monkeypatch):
    calls = []

    def load_corpus(spec):
        calls.append(spec)
        return PASSAGES

    monkeypatch.setitem(sys.modules, "bridge_pl.data.sources", types.SimpleNamespace(load_corpus=load_corpus))
    retriever = make(tmp_path, corpus="world")
    assert calls == []
    assert len(retriever.passages) == len(PASSAGES) and calls == ["world"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"pooling": "max"}, "pooling"), ({"passage_tower": "shared"}, "passage_tower"),
     ({"index": "lsh"}, "index"), ({"index_options": {"nprobes": 3}}, "nprobes"),
     ({"batch_size": 0}, "batch_size")],
)
def test_bad_options_are_named(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(tmp_path, **kwargs)


def test_bad_rows_are_named(frozen):
    with pytest.raises(ValueError, match="rows"):
        frozen.score(QUERIES, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="corpus size"):
        frozen.score(QUERIES[:1], torch.tensor([[len(PASSAGES)]]))


@pytest.mark.parametrize("damage", ["random bytes", "truncated", "digest missing"])
def test_a_damaged_embedding_cache_is_reported_and_rebuilt_never_used(tmp_path, caplog, damage):
    first = make(tmp_path)
    first.prepare()
    [cache] = (tmp_path / "emb").glob("*.npy")
    if damage == "random bytes":  # same size, header kept: np.load would read garbage silently
        raw = cache.read_bytes()
        cache.write_bytes(raw[:128] + np.random.default_rng(0).bytes(len(raw) - 128))
    elif damage == "truncated":
        cache.write_bytes(cache.read_bytes()[:100])
    else:
        cache.with_name(cache.name + ".b2").unlink()
    second = make(tmp_path)
    with caplog.at_level(logging.WARNING):
        second.prepare()
    assert str(cache) in caplog.text and "rebuilding" in caplog.text
    assert second.encoded_passages == len(PASSAGES)  # re-encoded, not loaded
    for a, b in zip(first.search(QUERIES, 3), second.search(QUERIES, 3), strict=True):
        assert torch.equal(a, b)
    third = make(tmp_path)  # the rebuilt cache is whole again
    third.prepare()
    assert third.encoded_passages == 0
