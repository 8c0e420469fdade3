"""Readers for the medical track: MIRAGE multiple-choice benchmarks and MedRAG corpus chunks.

MIRAGE (``benchmark.json`` of the MedRAG/MIRAGE project) is one JSON object whose top-level keys name
subsets (``medqa``, ``medmcqa``, ``pubmedqa``, ``bioasq``, ``mmlu``); each maps a question id to
``{"question": str, "options": {"A": str, "B": str, ...}, "answer": "<letter>"}``. A question becomes a
:class:`~bridge_pl.data.qa.QAExample` whose ``golden_answers`` is ``[letter]`` and whose ``metadata`` holds
``options`` (letter -> text) and ``type`` (the subset name).

MedRAG corpora (PubMed, StatPearls, Textbooks, Wikipedia; MedCorp is all four) are jsonl chunk files with rows
``{"id", "title", "content", "contents"}`` (``contents`` = title + content, not needed here). A corpus is one
such file or a folder of them (``.jsonl`` and gzipped ``.jsonl.gz``, any case, read recursively in sorted path
order). Rows with a blank ``content`` and rows that repeat an id are skipped (the first row with an id is kept) and
reported in one warning, with the files of the folder that are not read; ``medrag:PATH?strict`` refuses them.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bridge_pl.data.qa import _records, _scalar_id
from bridge_pl.records import DataFormatError, Passage, QAExample

MIRAGE_SUBSETS = ("medqa", "medmcqa", "pubmedqa", "bioasq", "mmlu")  # the benchmark's order
MIRAGE_PREFIX = "mirage:"
MEDRAG_PREFIX = "medrag:"
MEDRAG_STRICT = "?strict"  # medrag:PATH?strict refuses blank rows and repeated ids instead of skipping them
MEDRAG_SUFFIXES = (".jsonl", ".jsonl.gz")  # the chunk files of a folder, in any case
SHOWN = 5  # skipped rows and files named in a warning; the rest are counted
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
        DataFormatError: an unreadable or empty file, a byte that is not UTF-8, a subset that is not an object of
            questions, or a question with a missing or malformed field; the message names the file, the question
            (``subset/id``) and the field (a byte outside any question: its line and offset).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataFormatError(_not_utf8(path, raw, err.start)) from None
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


def _has_undecoded_byte(value: Any) -> bool:
    """Whether ``value`` (JSON decoded from ``surrogateescape`` text) holds a byte that was not UTF-8."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return any("\udc80" <= char <= "\udcff" for char in text)


def _undecodable_question(raw: bytes) -> tuple[str, str] | None:
    """``(subset/id, field)`` of the first question of a MIRAGE file whose text holds a byte that is not UTF-8, or
    None when the file does not parse or the byte lies outside every question."""
    try:
        data = json.loads(raw.decode("utf-8", errors="surrogateescape"))
    except json.JSONDecodeError:
        return None
    for subset, questions in data.items() if isinstance(data, dict) else ():
        for qid, row in questions.items() if isinstance(questions, dict) else ():
            fields = row.items() if isinstance(row, dict) else [("question", row)]
            bad = [name for name, value in fields if _has_undecoded_byte(name) or _has_undecoded_byte(value)]
            if bad or _has_undecoded_byte(qid):
                return f"{subset}/{qid}", (bad or ["id"])[0]
    return None


def _not_utf8(path: Path, raw: bytes, offset: int) -> str:
    """The one-line error for a MIRAGE file whose byte at ``offset`` is not UTF-8: the file and the question (and
    field) that holds it, or the line when no question does."""
    line = raw[:offset].count(b"\n") + 1
    byte = f"byte 0x{raw[offset]:02x} at offset {offset}, line {line}"
    if found := _undecodable_question(raw):
        question, field = found
        return f"{path}: question '{question}': field '{field}' is not UTF-8 text ({byte}); save the file as UTF-8"
    return f"{path}: not UTF-8 text ({byte}); save the file as UTF-8"


def looks_like_mirage(path: Path) -> bool:
    """Whether ``path`` is a ``.json`` file in MIRAGE's layout: one object whose subsets map ids to questions with
    ``question``, ``options`` and ``answer``."""
    if path.suffix.lower() != ".json":
        return False
    try:
        data = json.loads(path.read_bytes().decode("utf-8", errors="replace"))
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(data, dict):
        return False
    first_rows = (next(iter(questions.values()), None) for questions in data.values() if isinstance(questions, dict))
    return any(isinstance(row, dict) and {"question", "options", "answer"} <= row.keys() for row in first_rows)


def mirage_hint(spec: str) -> str:
    """The one-line error for MIRAGE's ``benchmark.json`` named as a plain QA file ``spec``."""
    return (f"{spec}: looks like MIRAGE's benchmark.json: use mirage:{spec} (every subset) or "
            f"mirage:{spec}#SUBSET (one, e.g. #medqa)")


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
    """The passage of one MedRAG row (its ``content`` may be blank: the caller decides)."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    missing = [name for name in ("id", "title", "content") if name not in row]
    if missing:
        raise DataFormatError(f"{loc}: field '{missing[0]}' is missing (MedRAG rows hold id, title, content, contents)")
    ident = _scalar_id(loc, row["id"])
    for name in ("title", "content"):
        if not isinstance(row[name], str):
            raise DataFormatError(f"{loc}: field '{name}' must be a string, got {type(row[name]).__name__}")
    return Passage(id=ident, title=row["title"], text=row["content"])


def _row_problem(loc: str, passage: Passage, seen: dict[str, str]) -> tuple[str, str] | None:
    """Why a well-formed row is not a passage of the corpus, as ``(kind, message)``: ``"blank"`` (a blank
    ``content``) or ``"repeated"`` (an id seen before, at ``seen[id]``); None when it is one."""
    if not passage.text.strip():
        return "blank", f"{loc}: field 'content' is blank"
    if passage.id in seen:
        return "repeated", f"{loc}: field 'id' duplicates id '{passage.id}' first seen at {seen[passage.id]}"
    return None


def _is_chunk_file(path: Path) -> bool:
    return path.name.lower().endswith(MEDRAG_SUFFIXES)


def medrag_files(path: Path) -> tuple[list[Path], list[Path]]:
    """``(chunk files, other files)`` of a MedRAG corpus ``path``: a file is its own chunk file; below a folder,
    every file (recursively, sorted by path) whose name ends in ``.jsonl`` or ``.jsonl.gz`` (any case) is a chunk
    file and every other one is not read. Hidden files and folders (``.git``, ``.DS_Store``) are left out of both."""
    if path.is_file():
        return [path], []
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    chunks = [p for p in files if _is_chunk_file(p)]
    if not chunks:
        raise DataFormatError(f"{path}: a folder without .jsonl or .jsonl.gz files (expected MedRAG chunk files)")
    return chunks, [p for p in files if not _is_chunk_file(p)]


def _passages(files: list[Path], strict: bool, skipped: list[tuple[str, str]]) -> Iterator[Passage]:
    """The passages of ``files`` in order; a blank or repeated row raises when ``strict``, else ``(file:line,
    "blank" | "repeated")`` goes into ``skipped`` and the row is left out."""
    seen: dict[str, str] = {}
    for file in files:
        rows = 0
        for loc, row in _records(file):
            rows += 1
            passage = _medrag_passage(loc, row)
            if problem := _row_problem(loc, passage, seen):
                kind, message = problem
                if strict:
                    raise DataFormatError(message)
                skipped.append((loc, kind))
                continue
            seen[passage.id] = loc
            yield passage
        if rows == 0:
            raise DataFormatError(f"{file}: no passages (the file is empty)")


def _count(n: int, noun: str) -> str:
    """``"1 row"``, ``"3 rows"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _named(items: list[str]) -> str:
    """The first :data:`SHOWN` of ``items``, comma-separated, and how many more there are."""
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def medrag_warning(path: Path, skipped: list[tuple[str, str]], unread: list[Path]) -> str | None:
    """The one warning of a MedRAG read: the rows skipped (``(file:line, "blank" | "repeated")`` in reading order;
    counted, the first ones named) and the files of the folder not read; None when there is neither."""
    parts = []
    if skipped:
        blank = sum(kind == "blank" for _, kind in skipped)
        parts.append(f"skipped {_count(len(skipped), 'row')} ({blank} with a blank 'content', {len(skipped) - blank} "
                     f"repeating an id whose first row is kept): {_named([loc for loc, _ in skipped])}; "
                     f"medrag:PATH{MEDRAG_STRICT} refuses them")
    if unread:
        names = [str(p.relative_to(path)) for p in unread]
        parts.append(f"did not read {_count(len(unread), 'file')} (not .jsonl or .jsonl.gz): {_named(names)}")
    return f"MedRAG corpus {path}: " + "; ".join(parts) if parts else None


def read_medrag(path: str | Path, strict: bool = False) -> list[Passage]:
    """Passages of a MedRAG corpus: one chunk file, or a folder whose chunk files (:func:`medrag_files`: ``.jsonl``
    and ``.jsonl.gz``, recursively, sorted by path) are read in turn, so a MedCorp folder holding the four corpora's
    folders is one corpus.

    Rows with a blank ``content`` and rows whose id an earlier row had (in any file) are skipped, the first row of
    an id kept, and named in one warning (:func:`medrag_warning`) together with the folder's files that are not
    read; ``strict=True`` refuses them instead.

    Raises:
        DataFormatError: a malformed row or invalid JSON (``file:line`` and the field), an empty file or a folder
            without chunk files; with ``strict``, a blank row or a repeated id.
    """
    path = Path(path).expanduser()
    files, unread = medrag_files(path)
    skipped: list[tuple[str, str]] = []
    passages = list(_passages(files, strict, skipped))
    if message := medrag_warning(path, skipped, unread):
        warnings.warn(message, stacklevel=2)
    if not passages:
        raise DataFormatError(f"{path}: no passages (every row was skipped)")
    return passages


def load_medrag(spec: str) -> list[Passage]:
    """The passages of ``medrag:PATH`` (:func:`read_medrag`); ``medrag:PATH?strict`` refuses blank rows and
    repeated ids."""
    path = spec.removeprefix(MEDRAG_PREFIX)
    strict = path.endswith(MEDRAG_STRICT)
    return read_medrag(path.removesuffix(MEDRAG_STRICT), strict=strict)
