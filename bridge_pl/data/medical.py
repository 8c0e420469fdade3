"""Readers for the medical track: MIRAGE multiple-choice benchmarks and MedRAG corpus chunks.

MIRAGE (``benchmark.json`` of the MedRAG/MIRAGE project) is one JSON object whose top-level keys name
subsets (``medqa``, ``medmcqa``, ``pubmedqa``, ``bioasq``, ``mmlu``); each maps a question id to
``{"question": str, "options": {"A": str, "B": str, ...}, "answer": "<letter>"}``. A question becomes a
:class:`~bridge_pl.data.qa.QAExample` whose ``golden_answers`` is ``[letter]`` and whose ``metadata`` holds
``options`` (letter -> text) and ``type`` (the subset name).

MedRAG corpora (PubMed, StatPearls, Textbooks, Wikipedia; MedCorp is all four) are jsonl chunk files with rows
``{"id", "title", "content", "contents"}`` (``contents`` = title + content, not needed here). A corpus is one
such file or a folder of them (read recursively, in sorted path order).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bridge_pl.data.qa import DataFormatError, Passage, QAExample, _check_unique, _records, _scalar_id

MIRAGE_SUBSETS = ("medqa", "medmcqa", "pubmedqa", "bioasq", "mmlu")  # the benchmark's order
MIRAGE_PREFIX = "mirage:"
MEDRAG_PREFIX = "medrag:"
_LETTER = re.compile(r"[A-Z]")


def mirage_sets(name: str, spec: str) -> dict[str, str]:
    """Expand one evaluation set ``name: spec`` into the sets it names.

    ``mirage:PATH`` names all five MIRAGE subsets: ``{"<name>/medqa": "mirage:PATH#medqa", ...}``; any other
    spec (``mirage:PATH#medqa`` included) is one set, returned as it is. The file is not read here.
    """
    if not isinstance(spec, str) or not spec.startswith(MIRAGE_PREFIX) or "#" in spec:
        return {name: spec}  # an inline list too
    return {f"{name}/{subset}": f"{spec}#{subset}" for subset in MIRAGE_SUBSETS}


def expand_sets(sources: dict[str, str]) -> dict[str, str]:
    """Every ``name: spec`` of ``sources`` expanded by :func:`mirage_sets`, in order."""
    out: dict[str, str] = {}
    for name, spec in sources.items():
        out.update(mirage_sets(name, spec))
    return out


def check_options(where: str, options: Any) -> dict[str, str]:
    """``options`` checked to be ``{letter: text}``: at least two, keys ``A``, ``B``, ... in order, texts non-empty.

    ``where`` starts the error message (``file: question 'id'``).
    """
    if not isinstance(options, dict) or len(options) < 2:
        raise DataFormatError(f"{where}: field 'options' must be an object of at least two "
                              f"{{letter: text}} pairs, got {options!r}")
    expected = [chr(ord("A") + i) for i in range(len(options))]
    if list(options) != expected:
        raise DataFormatError(f"{where}: field 'options' must have the letters {', '.join(expected)} in order, "
                              f"got {', '.join(map(str, options))}")
    for letter, text in options.items():
        if not isinstance(text, str) or not text.strip():
            raise DataFormatError(f"{where}: field 'options' must map each letter to a non-empty string; "
                                  f"{letter} is {text!r}")
    return dict(options)


def _gold_letter(where: str, answer: Any, options: dict[str, str], field: str = "answer") -> str:
    if not isinstance(answer, str) or not _LETTER.fullmatch(answer):
        raise DataFormatError(f"{where}: field '{field}' must be an option letter (A-Z), got {answer!r}")
    if answer not in options:
        raise DataFormatError(f"{where}: field '{field}' is '{answer}', which is not one of the options "
                              f"{', '.join(options)}")
    return answer


def _mirage_example(path: Path, subset: str, qid: str, row: Any) -> QAExample:
    where = f"{path}: question '{subset}/{qid}'"
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DataFormatError(f"{where}: field 'question' must be a non-empty string, got {question!r}")
    if "options" not in row:
        raise DataFormatError(f"{where}: field 'options' is missing (expected {{letter: text}})")
    options = check_options(where, row["options"])
    if "answer" not in row:
        raise DataFormatError(f"{where}: field 'answer' is missing (expected the gold option's letter)")
    letter = _gold_letter(where, row["answer"], options)
    extra = {k: v for k, v in row.items() if k not in ("question", "options", "answer")}
    return QAExample(id=qid, question=question, golden_answers=[letter],
                     metadata={**extra, "options": options, "type": subset})


def read_mirage(path: str | Path) -> dict[str, list[QAExample]]:
    """Every subset of a MIRAGE ``benchmark.json``: ``{subset: examples}`` in file order (ids as in the file).

    Raises:
        DataFormatError: an unreadable or empty file, a subset that is not an object of questions, or a
            question with a missing or malformed field; the message names the file, the question
            (``subset/id``) and the field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise DataFormatError(f"{path}: the file is empty (expected a MIRAGE benchmark.json object)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataFormatError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(data, dict) or not data:
        raise DataFormatError(f"{path}: expected a JSON object mapping subset names to questions, "
                              f"got {type(data).__name__ if data else 'an empty object'}")
    subsets = {}
    for subset, questions in data.items():
        if not isinstance(questions, dict) or not questions:
            raise DataFormatError(f"{path}: subset '{subset}' must be a non-empty object mapping question ids "
                                  f"to questions")
        subsets[subset] = [_mirage_example(path, subset, qid, row) for qid, row in questions.items()]
    return subsets


def load_mirage(spec: str) -> list[QAExample]:
    """The examples of ``mirage:PATH#SUBSET`` (one subset) or ``mirage:PATH`` (all subsets, in file order)."""
    path, _, subset = spec.removeprefix(MIRAGE_PREFIX).partition("#")
    subsets = read_mirage(Path(path).expanduser())
    if not subset:
        return [ex for examples in subsets.values() for ex in examples]
    if subset not in subsets:
        raise DataFormatError(f"{path}: no subset '{subset}' (the file has {', '.join(subsets)})")
    return subsets[subset]


def check_choice_examples(source: str, examples: list[QAExample]) -> list[QAExample]:
    """``examples`` after checking every multiple-choice one (``metadata["options"]``) of a QA file.

    A multiple-choice example needs ``{letter: text}`` options and one gold answer, an option letter.
    """
    for ex in examples:
        if "options" in ex.metadata:
            where = f"{source}: question '{ex.id}'"
            options = check_options(where, ex.metadata["options"])
            if len(ex.golden_answers) != 1:
                raise DataFormatError(f"{where}: field 'golden_answers' of a multiple-choice question must be "
                                      f"one option letter, got {ex.golden_answers!r}")
            _gold_letter(where, ex.golden_answers[0], options, field="golden_answers")
    return examples


def _medrag_passage(loc: str, row: Any) -> Passage:
    if not isinstance(row, dict):
        raise DataFormatError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    missing = [name for name in ("id", "title", "content") if name not in row]
    if missing:
        raise DataFormatError(f"{loc}: field '{missing[0]}' is missing (MedRAG rows hold id, title, content, contents)")
    ident = _scalar_id(loc, row["id"])
    for name in ("title", "content"):
        if not isinstance(row[name], str):
            raise DataFormatError(f"{loc}: field '{name}' must be a string, got {type(row[name]).__name__}")
    if not row["content"].strip():
        raise DataFormatError(f"{loc}: field 'content' is blank")
    return Passage(id=ident, title=row["title"], text=row["content"])


def read_medrag(path: str | Path) -> list[Passage]:
    """Passages of a MedRAG corpus: one chunk ``.jsonl`` file, or a folder whose ``*.jsonl`` files (recursively,
    sorted by path) are read in turn, so a MedCorp folder holding the four corpora's folders is one corpus.

    Raises:
        DataFormatError: a malformed row (``file:line`` and the field), an id seen twice (in any file), an empty
            file or a folder without jsonl files.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
        if not files:
            raise DataFormatError(f"{path}: a folder without .jsonl files (expected MedRAG chunk files)")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no such file or folder")
    passages: list[Passage] = []
    seen: dict[str, str] = {}
    for file in files:
        before = len(passages)
        for loc, row in _records(file):
            passage = _medrag_passage(loc, row)
            _check_unique(loc, passage.id, seen)
            passages.append(passage)
        if len(passages) == before:
            raise DataFormatError(f"{file}: no passages (the file is empty)")
    return passages
