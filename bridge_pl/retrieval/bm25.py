"""BM25 baseline retriever on ``bm25s``: fixed (nothing trains), same interface as the dense one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from torch import nn

from bridge_pl.config import require_choice
from bridge_pl.records import CorpusSpec, Passage
from bridge_pl.retrieval.base import Retriever

BM25Method = Literal["robertson", "lucene", "bm25l", "bm25+", "atire"]


def top_k_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Best ``k`` of ``scores`` ``[N]``: ``(scores [k], rows [k])`` best first, padded with ``(-inf, -1)``
    when ``k > N``. Equal scores are ordered by row (which of several rows tied at the k-th score make
    the cut is up to ``np.argpartition``, deterministic for a given input)."""
    n = len(scores)
    cand = np.arange(n) if k >= n else np.argpartition(-scores, k - 1)[:k]
    cand = cand[np.lexsort((cand, -scores[cand]))]
    out_scores = np.full(k, -np.inf, dtype=np.float32)
    out_rows = np.full(k, -1, dtype=np.int64)
    out_scores[: len(cand)] = scores[cand]
    out_rows[: len(cand)] = cand
    return out_scores, out_rows


class BM25Retriever(Retriever):
    """Lexical BM25 over ``Passage.contents`` (title and text).

    Args:
        corpus: a spec for ``bridge_pl.data.sources.load_corpus`` or the passages themselves.
        k1, b: BM25 term-frequency saturation and length normalisation.
        method: BM25 variant, ``robertson``, ``lucene``, ``bm25l``, ``bm25+`` or ``atire`` (bm25s).
        stopwords: stop-word list name for ``bm25s.tokenize`` (``"en"``) or ``None`` to keep all words.
    """

    def __init__(
        self,
        corpus: CorpusSpec,
        k1: float = 1.5,
        b: float = 0.75,
        method: BM25Method = "lucene",
        stopwords: str | None = "en",
    ) -> None:
        super().__init__()
        require_choice("BM25Retriever option 'method'", method, BM25Method)
        self.k1, self.b, self.method, self.stopwords = k1, b, method, stopwords
        self._corpus_spec, self._passages = corpus, None  # read (and checked) on first use
        self._bm25 = None

    @property
    def passages(self) -> Sequence[Passage]:
        if self._passages is None:
            from bridge_pl.data.sources import load_corpus

            self._passages = list(load_corpus(self._corpus_spec))
        if not self._passages:
            raise ValueError(f"BM25Retriever corpus {self._corpus_spec!r} has no passages")
        return self._passages

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        import bm25s

        return bm25s.tokenize(texts, stopwords=self.stopwords or [], return_ids=False, show_progress=False)

    def prepare(self) -> None:
        """Tokenise the corpus and build the BM25 index; idempotent."""
        if self._bm25 is not None:
            return
        import bm25s

        bm25 = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
        bm25.index(self._tokenize([p.contents for p in self.passages]), show_progress=False)
        self._bm25 = bm25

    def _all_scores(self, queries: list[str]) -> np.ndarray:
        """``[Q, N]`` float32 BM25 scores of every passage for each query."""
        self.prepare()
        out = np.zeros((len(queries), len(self.passages)), dtype=np.float32)
        for i, tokens in enumerate(self._tokenize(queries) if queries else []):
            out[i] = self._bm25.get_scores(tokens)
        return out

    def search(self, queries: list[str], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` ``(scores [Q, k], rows [Q, k])`` on CPU; ``(-inf, -1)`` padding when ``k > N``."""
        if k <= 0:
            raise ValueError(f"search k must be positive, got {k}")
        all_scores = self._all_scores(queries)
        scores = np.empty((len(queries), k), dtype=np.float32)
        rows = np.empty((len(queries), k), dtype=np.int64)
        for i, s in enumerate(all_scores):
            scores[i], rows[i] = top_k_rows(s, k)
        return torch.from_numpy(scores), torch.from_numpy(rows)

    def score(
        self, queries: list[str], rows: torch.Tensor, query_encoder: nn.Module | None = None
    ) -> torch.Tensor:
        """``[Q, K]`` float32 BM25 scores of ``(queries[i], rows[i, j])`` (no grad; ``-inf`` for row -1)."""
        if query_encoder is not None:
            raise ValueError("BM25Retriever has no query encoder; score() takes query_encoder=None")
        if rows.dim() != 2 or rows.shape[0] != len(queries):
            raise ValueError(f"rows must be [Q={len(queries)}, K] int64, got shape {tuple(rows.shape)}")
        all_scores = torch.from_numpy(self._all_scores(queries))  # [Q, N]
        picked = all_scores.gather(1, rows.cpu().clamp(min=0))
        return picked.masked_fill(rows.cpu() < 0, float("-inf"))

    def fingerprint(self) -> str:
        return f"BM25Retriever(k1={self.k1},b={self.b},method={self.method},stopwords={self.stopwords})"
