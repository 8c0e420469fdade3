"""Readers and writers of QA sets and corpora in the FlashRAG / Search-R1 jsonl layout."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bridge_pl.files import atomic_write
from bridge_pl.records import DataFormatError, Passage, QAExample

MAX_RECORD_CHARS = 1_000_000  # one QA example or passage per line; longer lines are rejected, not truncated
_ANSWER_FIELDS = ("golden_answers", "answers", "answer")  # first one present wins; see read_qa


def _unzipped(path: Path) -> Path:
    """``path`` without a ``.gz`` suffix (``x.jsonl.gz`` -> ``x.jsonl``), to tell the format of what it holds."""
    return path.with_suffix("") if path.suffix.lower() == ".gz" else path


def _file_text(path: Path) -> str:
    """The text of a UTF-8 file, gunzipped first when its name ends in ``.gz``.

    Raises:
        DataFormatError: a damaged gzip file, or a byte that is not UTF-8 (``file:line``, the byte and its offset in
            the uncompressed text).
    """
    raw = path.read_bytes()
    if path.suffix.lower() == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise DataFormatError(f"{path}: not a readable gzip file ({err})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataFormatError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); save the file as UTF-8"
        ) from None


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, record)`` for each non-blank record of a jsonl / json-list / parquet file (jsonl and json
    also gzipped, as ``.jsonl.gz`` / ``.json.gz``).

    ``location`` is ``file:line`` for jsonl, ``file:item N`` (0-based) for a ``.json`` list and
    ``file:row N`` (0-based) for parquet.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataFormatError(
                f"{path}: reading parquet needs pyarrow, which is not installed; run: pip install pyarrow "
                "(or convert the file to jsonl)"
            ) from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
        return
    text = _file_text(path)
    if _unzipped(path).suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        for i, item in enumerate(items):
            yield f"{path}:item {i}", item
        return
    # JSON Lines ends a record at '\n' only: str.splitlines() would also split at U+2028, U+0085, \x1c ..., which
    # JSON strings may hold unescaped (the project's own writer keeps them, ensure_ascii=False)
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_RECORD_CHARS:
            raise DataFormatError(
                f"{path}:{lineno}: a record of {len(line):,} characters, over the {MAX_RECORD_CHARS:,}-character "
                "limit for one QA example or passage (is this one object per line?)"
            )
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(
                f"{path}:{lineno}: invalid JSON ({err.msg}); expected one object per line"
            ) from None
        yield f"{path}:{lineno}", record


def _scalar_id(loc: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataFormatError(f"{loc}: field 'id' must be a string or number, got {type(value).__name__}")
    return str(value)


def _check_unique(loc: str, ident: str, seen: dict[str, str]) -> None:
    if ident in seen:
        raise DataFormatError(f"{loc}: field 'id' duplicates id '{ident}' first seen at {seen[ident]}")
    seen[ident] = loc


def _qa_example(loc: str, index: int, row: Any) -> QAExample:
    if not isinstance(row, dict):
        raise DataFormatError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    row = dict(row)
    question = row.pop("question", None)
    if not isinstance(question, str) or not question.strip():
        raise DataFormatError(f"{loc}: field 'question' must be a non-empty string, got {question!r}")
    name = next((f for f in _ANSWER_FIELDS if f in row), None)
    if name is None:
        raise DataFormatError(
            f"{loc}: field 'golden_answers' is missing (expected a non-empty list of strings)"
        )
    answers = row.pop(name)
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers:
        raise DataFormatError(f"{loc}: field '{name}' must be a non-empty list of strings, got {answers!r}")
    for a in answers:
        if not isinstance(a, str) or not a.strip():
            raise DataFormatError(f"{loc}: field '{name}' must hold non-empty strings, got {a!r}")
    ident = _scalar_id(loc, row.pop("id")) if "id" in row else str(index)
    metadata = row.pop("metadata", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise DataFormatError(f"{loc}: field 'metadata' must be an object, got {type(metadata).__name__}")
    # Unknown extra fields are kept, not dropped, under metadata (an existing metadata key wins).
    metadata = {**row, **metadata}
    return QAExample(id=ident, question=question, golden_answers=list(answers), metadata=metadata)


def read_qa(path: str | Path) -> list[QAExample]:
    """Read QA examples in the FlashRAG / Search-R1 layout.

    One object per record with ``question`` (str), ``golden_answers`` (non-empty list of str; a bare
    string is wrapped; ``answers`` / ``answer`` are accepted as aliases when ``golden_answers`` is
    absent), optional ``id`` (str or number, stringified; default the 0-based record index) and
    optional ``metadata`` (object). Other fields are kept in ``metadata``. Files: ``.jsonl`` (any
    suffix but the two below; blank lines skipped), ``.json`` holding a list, ``.parquet`` (needs pyarrow); jsonl
    and json may be gzipped (``.jsonl.gz``).

    Raises:
        DataFormatError: for any malformed record (the message names ``file:line`` and the field);
            no record is ever skipped.
    """
    path = Path(path)
    return qa_from_records(_records(path), str(path))


def qa_from_records(records: Iterable[tuple[str, Any]], where: str) -> list[QAExample]:
    """QA examples from ``(location, record)`` pairs (a file's, or an inline YAML list's), with the checks of
    :func:`read_qa`; ``where`` names the source in the empty-set error."""
    examples: list[QAExample] = []
    seen: dict[str, str] = {}
    for index, (loc, row) in enumerate(records):
        ex = _qa_example(loc, index, row)
        _check_unique(loc, ex.id, seen)
        examples.append(ex)
    if not examples:
        raise DataFormatError(f"{where}: no QA examples (the file is empty)")
    return examples


def _split_contents(contents: str) -> tuple[str, str]:
    """FlashRAG ``contents`` -> ``(title, text)``: first line is the title, quotes around it optional."""
    title, newline, text = contents.partition("\n")
    if not newline:
        return "", contents
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return title, text


def _passage(loc: str, row: Any) -> Passage:
    if not isinstance(row, dict):
        raise DataFormatError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    if "id" not in row:
        raise DataFormatError(f"{loc}: field 'id' is missing (expected a string or number)")
    ident = _scalar_id(loc, row["id"])
    if "text" in row:
        title, text = row.get("title", ""), row["text"]
        for name, value in (("title", title), ("text", text)):
            if not isinstance(value, str):
                raise DataFormatError(f"{loc}: field '{name}' must be a string, got {type(value).__name__}")
    elif "contents" in row:
        contents = row["contents"]
        if not isinstance(contents, str) or not contents.strip():
            raise DataFormatError(f"{loc}: field 'contents' must be a non-empty string, got {contents!r}")
        title, text = _split_contents(contents)
    else:
        raise DataFormatError(f"{loc}: field 'contents' is missing (expected 'contents' or 'title' + 'text')")
    return Passage(id=ident, title=title, text=text)


def read_corpus(path: str | Path) -> list[Passage]:
    """Read a corpus: one object per line with ``id`` and ``contents`` (FlashRAG ``"title"\\ntext``; the
    quotes are optional and stripped; no newline means an empty title) or ``id`` + ``title`` + ``text``
    (preferred when both are present). Same file types and error discipline as :func:`read_qa`;
    ``id`` is required and duplicate ids are errors.
    """
    path = Path(path)
    return passages_from_records(_records(path), str(path))


def passages_from_records(records: Iterable[tuple[str, Any]], where: str) -> list[Passage]:
    """Passages from ``(location, record)`` pairs (a file's, or an inline YAML list's), with the checks of
    :func:`read_corpus`; ``where`` names the source in the empty-corpus error."""
    passages: list[Passage] = []
    seen: dict[str, str] = {}
    for loc, row in records:
        p = _passage(loc, row)
        _check_unique(loc, p.id, seen)
        passages.append(p)
    if not passages:
        raise DataFormatError(f"{where}: no passages (the file is empty)")
    return passages


def _write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write rows as UTF-8 jsonl (ensure_ascii=False, '\\n'), atomically (temp file, then rename)."""

    def write(f) -> None:
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))

    return atomic_write(path, write)


def write_qa(path: str | Path, examples: Iterable[QAExample]) -> Path:
    """Write examples as jsonl with ``id``, ``question``, ``golden_answers``, ``metadata`` (in that order)."""
    return _write_jsonl(
        path,
        ({"id": e.id, "question": e.question, "golden_answers": e.golden_answers, "metadata": e.metadata}
         for e in examples),
    )


def write_corpus(path: str | Path, passages: Iterable[Passage]) -> Path:
    """Write passages as jsonl with ``id``, ``contents`` (FlashRAG), ``title`` and ``text``."""
    return _write_jsonl(
        path, ({"id": p.id, "contents": p.contents, "title": p.title, "text": p.text} for p in passages)
    )
