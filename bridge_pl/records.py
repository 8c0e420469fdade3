"""The plain records every layer passes around: corpus passages, QA examples, and how a config names a set of them.

Nothing here imports from the rest of the package, so any module may use these types.
"""

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

    @property
    def gold_text(self) -> str:
        """The first gold answer as text: on a multiple-choice question (``metadata["options"]``) the gold
        letter's option text, else the first golden answer."""
        gold = self.golden_answers[0]
        options = self.metadata.get("options")
        return options[gold] if options else gold


# A corpus or QA set as a config gives it: a name or file path (bridge_pl.data.sources), or the records themselves
# (an inline YAML list; in Python, Passage / QAExample objects too). Not list[Passage]: jsonargparse would read a
# .json file's list straight into dataclasses, past the readers' checks.
CorpusSpec = str | list[dict[str, Any]]
QASpec = str | list[dict[str, Any]]


class DataFormatError(ValueError):
    """A malformed QA or corpus file; the message names ``file:line``, the field and what was expected."""
