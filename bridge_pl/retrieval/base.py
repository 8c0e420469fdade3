"""The ``Retriever`` interface: the seam where users plug in their own retriever by YAML ``class_path``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from bridge_pl.records import Passage


class Retriever(nn.Module, ABC):
    """A retriever over a fixed corpus, addressed by passage row ``0..len(passages)-1``.

    Subclasses implement :meth:`search` (candidate generation, no grad) and :meth:`score`
    (differentiable relevance of given (query, passage) pairs). A trainable retriever exposes its
    query tower as :attr:`query_encoder` (the φ of docs/method.md); the trainer may deep-copy it (ψ) and pass
    the copy back to :meth:`score`.
    """

    def __init__(self) -> None:
        super().__init__()
        # Not "_version": nn.Module uses that class attribute for state_dict versioning.
        self.register_buffer("_update_count", torch.zeros((), dtype=torch.long), persistent=True)

    # ---- corpus -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def passages(self) -> Sequence[Passage]:
        """The corpus, in row order."""

    def passage(self, row: int) -> Passage:
        return self.passages[row]

    # ---- retrieval ----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build or load whatever search needs (index, embeddings). Called once before use; idempotent."""

    @abstractmethod
    def search(self, queries: list[str], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` candidates per query with the current query encoder, without grad.

        Returns:
            scores: ``[Q, k]`` float32 relevance scores (higher is better), on CPU.
            rows: ``[Q, k]`` int64 passage rows, on CPU, best first.
        """

    @abstractmethod
    def score(
        self, queries: list[str], rows: torch.Tensor, query_encoder: nn.Module | None = None
    ) -> torch.Tensor:
        """Relevance scores for the pairs ``(queries[i], rows[i, j])``: ``[Q, K]`` float32.

        Differentiable w.r.t. ``query_encoder`` (default: :attr:`query_encoder`) when the retriever is
        trainable. ``rows`` is ``[Q, K]`` int64.
        """

    # ---- training -----------------------------------------------------------------------------
    @property
    def trainable(self) -> bool:
        """Whether :attr:`query_encoder` has parameters the trainer should optimise."""
        return self.query_encoder is not None

    @property
    def query_encoder(self) -> nn.Module | None:
        """The trainable query tower φ, or ``None`` for a fixed retriever (BM25)."""
        return None

    @property
    def version(self) -> int:
        """Number of query-encoder updates applied so far (recorded in every rollout batch)."""
        return int(self._update_count.item())

    def bump_version(self) -> None:
        """Called by the trainer after each optimiser step on :attr:`query_encoder`."""
        self._update_count += 1

    def fingerprint(self) -> str:
        """Identifies the passage side (corpus + passage encoder); an index built under another is stale."""
        return type(self).__name__
