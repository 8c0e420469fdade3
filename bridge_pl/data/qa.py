"""QA examples and corpus passages, and their readers (FlashRAG / Search-R1 jsonl layout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Passage:
    """One retrievable passage. ``id`` is the corpus' own string id; retrievers address passages by row."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """FlashRAG ``contents`` field: ``"title"\\ntext``."""
        return f'"{self.title}"\n{self.text}'


@dataclass(frozen=True)
class QAExample:
    """One question with its gold answers.

    ``metadata`` may hold ``gold_passages``: a list (one entry per hop) of lists of gold passage ids.
    """

    id: str
    question: str
    golden_answers: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)
