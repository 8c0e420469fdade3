"""MedRAG and MIRAGE files as a new user has them: a corpus folder with blank rows, repeated ids, gzipped and
upper-case chunk files and files that are not chunks; a benchmark.json with a byte that is not UTF-8 or named without
``mirage:``. Each case loads with one warning naming what was left out, or stops with one line naming the file (and
the question)."""

import gzip
import json
import warnings
from pathlib import Path

import pytest
from helpers import TINY

from bridge_pl.cli import main
from bridge_pl.data.medical import SHOWN, read_medrag, read_mirage
from bridge_pl.data.sources import load_corpus, load_qa
from bridge_pl.records import DataFormatError

MIRAGE = Path(__file__).parent / "data" / "mirage" / "benchmark.json"


def _row(ident: str, content: str = "text") -> dict:
    return {"id": ident, "title": "T", "content": content, "contents": f"T. {content}"}


def _lines(*rows: dict) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A MedRAG folder: a plain chunk file with a blank row and a repeated id, a gzipped one that repeats an id of the
    first and has a blank row, an upper-case .JSONL, and a README and a .zst file that are not read."""
    folder = tmp_path / "medcorp"
    (folder / "pubmed" / "chunk").mkdir(parents=True)
    (folder / "statpearls").mkdir()
    (folder / "pubmed" / "chunk" / "a.jsonl").write_text(
        _lines(_row("PMID:1"), _row("PMID:2", " "), _row("PMID:1", "another version"), _row("PMID:3")))
    (folder / "pubmed" / "chunk" / "b.jsonl.gz").write_bytes(
        gzip.compress(_lines(_row("PMID:3", "again"), _row("PMID:4"), _row("PMID:5", "")).encode()))
    (folder / "statpearls" / "C.JSONL").write_text(_lines(_row("sp-1")))
    (folder / "README.md").write_text("MedRAG corpus\n")
    (folder / "statpearls" / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # hidden: neither read nor named
    return folder


def _one_warning(read) -> tuple[object, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = read()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "\n" not in messages[0]
    return result, messages[0]


def test_a_medrag_folder_with_blank_rows_repeated_ids_and_a_gzipped_file_loads_with_one_warning(corpus):
    passages, message = _one_warning(lambda: load_corpus(f"medrag:{corpus}"))
    assert [p.id for p in passages] == ["PMID:1", "PMID:3", "PMID:4", "sp-1"]
    assert passages[0].text == "text"  # the first row of an id is kept
    a, b = corpus / "pubmed" / "chunk" / "a.jsonl", corpus / "pubmed" / "chunk" / "b.jsonl.gz"
    assert "skipped 4 rows (2 with a blank 'content', 2 repeating an id" in message
    assert f"{a}:2, {a}:3, {b}:1, {b}:3" in message and "medrag:PATH?strict" in message
    assert "did not read 2 files (not .jsonl or .jsonl.gz): README.md, statpearls/d.jsonl.zst" in message
    assert ".git" not in message


def test_many_skipped_rows_are_counted_and_the_first_named(tmp_path):
    path = tmp_path / "chunk.jsonl"
    path.write_text(_lines(_row("x"), *[_row("x") for _ in range(SHOWN + 3)]))
    passages, message = _one_warning(lambda: read_medrag(path))
    assert len(passages) == 1
    assert f"skipped {SHOWN + 3} rows" in message and f"{path}:2, {path}:3" in message and "and 3 more" in message


def test_strict_refuses_the_first_blank_row_or_repeated_id_by_file_line(corpus, tmp_path):
    with pytest.raises(DataFormatError, match=r"a\.jsonl:2: field 'content' is blank$"):
        load_corpus(f"medrag:{corpus}?strict")
    (tmp_path / "two").mkdir()
    first, second = tmp_path / "two" / "1.jsonl", tmp_path / "two" / "2.jsonl.gz"
    first.write_text(_lines(_row("PMID:3")))
    second.write_bytes(gzip.compress(_lines(_row("PMID:4"), _row("PMID:3")).encode()))
    expected = rf"^{second}:2: field 'id' duplicates id 'PMID:3' first seen at {first}:1$"
    with pytest.raises(DataFormatError, match=expected):
        read_medrag(tmp_path / "two", strict=True)


def test_a_clean_medrag_folder_loads_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_corpus(f"medrag:{Path(__file__).parent / 'data' / 'medrag'}")) == 30


def test_bad_json_in_a_gzipped_chunk_still_fails_by_file_line(tmp_path):
    path = tmp_path / "chunk.jsonl.gz"
    path.write_bytes(gzip.compress((_lines(_row("a")) + '{"id": "b", "title": \n').encode()))
    with pytest.raises(DataFormatError, match=rf"^{path}:2: invalid JSON"):
        read_medrag(tmp_path)
    path.write_bytes(b"\x1f\x8b not gzip")
    with pytest.raises(DataFormatError, match=rf"^{path}: not a readable gzip file"):
        read_medrag(tmp_path)


def _benchmark(tmp_path, data: dict | None = None, indent: int | None = 1) -> Path:
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(data or json.loads(MIRAGE.read_text()), indent=indent))
    return path


def test_a_byte_that_is_not_utf8_names_the_file_the_question_and_the_field(tmp_path):
    data = json.loads(MIRAGE.read_text())
    qid = list(data["pubmedqa"])[2]
    data["pubmedqa"][qid]["options"]["C"] = "MARKER"
    path = _benchmark(tmp_path, data)
    raw = path.read_bytes()
    offset = raw.index(b"MARKER")
    path.write_bytes(raw.replace(b"MARKER", b"may\xe9be"))
    line = raw[:offset].count(b"\n") + 1
    with pytest.raises(DataFormatError) as err:
        read_mirage(path)
    assert str(err.value) == (f"{path}: question 'pubmedqa/{qid}': field 'options' is not UTF-8 text (byte 0xe9 at "
                              f"offset {offset + 3}, line {line}); save the file as UTF-8")


def test_a_byte_that_is_not_utf8_outside_any_question_names_its_offset(tmp_path):
    path = tmp_path / "benchmark.json"
    path.write_bytes(b'{"med\xe9qa": {}}')
    with pytest.raises(DataFormatError) as err:
        read_mirage(path)
    assert str(err.value) == f"{path}: not UTF-8 text (byte 0xe9 at offset 5, line 1); save the file as UTF-8"


@pytest.mark.parametrize("indent", [1, None], ids=["pretty", "one line"])
def test_mirage_named_without_its_prefix_gets_a_hint(tmp_path, indent):
    path = _benchmark(tmp_path, indent=indent)
    with pytest.raises(DataFormatError) as err:
        load_qa(str(path))
    assert str(err.value) == (f"{path}: looks like MIRAGE's benchmark.json: use mirage:{path} (every subset) or "
                              f"mirage:{path}#SUBSET (one, e.g. #medqa)")


def test_a_plain_json_qa_file_keeps_its_own_error(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"id": "q", "golden_answers": ["x"]}]))
    with pytest.raises(DataFormatError, match=r"qa.json:item 0: field 'question'"):
        load_qa(str(path))


def _cli_error(tmp_path, capfd, *args: str) -> str:
    """The one error line of a ``bridge-pl validate`` that stops before any model loads."""
    with pytest.raises(SystemExit):
        main(["validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path / 'run'}", *args])
    text = "".join(capfd.readouterr())
    errors = [line for line in text.splitlines() if line.startswith("bridge-pl: error:")]
    assert len(errors) == 1 and "Traceback" not in text and "Loading weights" not in text, text
    return errors[0]


def test_the_cli_names_a_mirage_file_and_question_in_one_line(tmp_path, capfd):
    data = json.loads(MIRAGE.read_text())
    qid = list(data["medqa"])[0]
    path = _benchmark(tmp_path, data)
    path.write_bytes(path.read_bytes().replace(data["medqa"][qid]["question"][:5].encode(), b"\xff\xfe", 1))
    line = _cli_error(tmp_path, capfd, f'--data.val={{"mirage": "mirage:{path}"}}')
    assert f"{path}: question 'medqa/{qid}': field 'question' is not UTF-8 text" in line
    path = _benchmark(tmp_path)
    assert f"{path}: looks like MIRAGE's benchmark.json: use mirage:{path}" in _cli_error(
        tmp_path, capfd, f'--data.val={{"mirage": "{path}"}}')
