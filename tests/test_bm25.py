"""BM25Retriever: lexical ranking, padding, the fixed-retriever side of the interface."""

import numpy as np
import pytest
import torch

from bridge_pl.records import Passage
from bridge_pl.retrieval.bm25 import BM25Retriever, top_k_rows

PASSAGES = [
    Passage("a", "Cats", "the cat sat on the mat and purred"),
    Passage("b", "Paris", "paris is the capital of france"),
    Passage("c", "Dogs", "dogs bark loudly at night"),
    Passage("d", "Volcanoes", "a volcano erupts molten lava and ash"),
]


@pytest.fixture(scope="module")
def bm25():
    retriever = BM25Retriever(PASSAGES)
    retriever.prepare()
    return retriever


def test_passage_with_the_query_words_ranks_first(bm25):
    scores, rows = bm25.search(["capital of France", "molten lava", "barking dogs at night"], 2)
    assert rows[:, 0].tolist() == [1, 3, 2]
    assert scores.dtype == torch.float32 and rows.dtype == torch.int64
    assert (scores[:, 0] > scores[:, 1]).all()


def test_score_equals_search_scores_and_pads(bm25):
    scores, rows = bm25.search(["capital of France"], len(PASSAGES) + 1)
    assert rows[0, -1].item() == -1 and torch.isneginf(scores[0, -1])
    torch.testing.assert_close(bm25.score(["capital of France"], rows), scores)
    assert not bm25.trainable and bm25.query_encoder is None


def test_score_rejects_a_query_encoder_and_bad_rows(bm25):
    with pytest.raises(ValueError, match="query_encoder"):
        bm25.score(["x"], torch.zeros(1, 1, dtype=torch.long), query_encoder=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="rows"):
        bm25.score(["x", "y"], torch.zeros(1, 1, dtype=torch.long))


def test_top_k_rows_orders_ties_by_row():
    scores, rows = top_k_rows(np.array([0.5, 2.0, 0.5, 2.0], dtype=np.float32), 4)
    assert rows.tolist() == [1, 3, 0, 2] and scores.tolist() == [2.0, 2.0, 0.5, 0.5]


def test_bad_method_is_named():
    with pytest.raises(ValueError, match="method"):
        BM25Retriever(PASSAGES, method="bm26")
