"""QA / corpus readers and writers: error messages, aliases, round trips."""

import json

import pytest

from bridge_pl.data.qa import read_corpus, read_qa, write_corpus, write_qa
from bridge_pl.records import DataFormatError, Passage, QAExample


def _jsonl(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


GOOD = {"id": "a", "question": "Who?", "golden_answers": ["Zorvan"]}


@pytest.mark.parametrize(
    ("bad", "field", "expected"),
    [
        ("{not json", None, "invalid JSON"),
        ({"id": "b", "golden_answers": ["x"]}, "question", "non-empty string"),
        ({"id": "b", "question": "Q?", "golden_answers": []}, "golden_answers", "non-empty list"),
        ({"id": "b", "question": "Q?", "golden_answers": [3]}, "golden_answers", "non-empty strings"),
        ({"id": "b", "question": "Q?"}, "golden_answers", "missing"),
        ({"id": "a", "question": "Q?", "golden_answers": ["x"]}, "id", "duplicates id 'a'"),
        ({"id": [1], "question": "Q?", "golden_answers": ["x"]}, "id", "string or number"),
        ({"id": "b", "question": "Q?", "golden_answers": ["x"], "metadata": 3}, "metadata", "object"),
        ([1, 2], None, "expected a JSON object"),
    ],
)
def test_read_qa_errors_name_file_line_and_field(tmp_path, bad, field, expected):
    path = _jsonl(tmp_path, [GOOD, "", bad])  # the bad row is on line 3, after a blank line
    with pytest.raises(DataFormatError) as err:
        read_qa(path)
    msg = str(err.value)
    assert f"{path}:3" in msg and expected in msg
    if field:
        assert f"'{field}'" in msg


def test_read_qa_defaults_aliases_and_extra_fields(tmp_path):
    path = _jsonl(tmp_path, [
        {"question": "Q1?", "golden_answers": "one"},
        "   ",
        {"question": "Q2?", "answers": ["two", "2"], "id": 7, "source": "nq"},
        {"question": "Q3?", "answer": "three", "metadata": {"k": 1}},
    ])
    q1, q2, q3 = read_qa(path)
    assert (q1.id, q1.golden_answers) == ("0", ["one"])
    assert (q2.id, q2.golden_answers, q2.metadata) == ("7", ["two", "2"], {"source": "nq"})
    assert (q3.id, q3.golden_answers, q3.metadata) == ("2", ["three"], {"k": 1})


def test_read_qa_json_list_and_location(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([GOOD, {"id": "b", "question": "", "golden_answers": ["x"]}]))
    with pytest.raises(DataFormatError, match=r"data.json:item 1: field 'question'"):
        read_qa(path)
    path.write_text(json.dumps([GOOD]))
    assert read_qa(path)[0].golden_answers == ["Zorvan"]


def test_read_qa_parquet_needs_pyarrow(tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        path = tmp_path / "data.parquet"
        path.write_bytes(b"PAR1")
        with pytest.raises(DataFormatError, match="pip install pyarrow"):
            read_qa(path)
    else:
        pytest.skip("pyarrow is installed")


def test_read_corpus_formats_and_errors(tmp_path):
    path = _jsonl(tmp_path, [
        {"id": 1, "contents": '"Velmar"\nVelmar is a city.'},
        {"id": "2", "contents": "Kor\nKor is a country."},
        {"id": "3", "title": "T", "text": "body", "contents": "ignored"},
        {"id": "4", "contents": "no title line"},
    ])
    assert read_corpus(path) == [
        Passage("1", "Velmar", "Velmar is a city."), Passage("2", "Kor", "Kor is a country."),
        Passage("3", "T", "body"), Passage("4", "", "no title line"),
    ]
    for bad, field in [({"contents": "x"}, "id"), ({"id": "1", "contents": "x"}, "id"),
                       ({"id": "9", "contents": ""}, "contents"), ({"id": "9"}, "contents"),
                       ({"id": "9", "title": 1, "text": "x"}, "title")]:
        path = _jsonl(tmp_path, [{"id": "1", "contents": "a\nb"}, bad])
        with pytest.raises(DataFormatError, match=rf"{path}:2: field '{field}'"):
            read_corpus(path)


def test_round_trips_are_exact_and_deterministic(tmp_path):
    examples = [
        QAExample("q1", "Wo liegt Zürich?", ["Schweiz"], {"gold_passages": [["p1"]], "type": "single"}),
        QAExample("q2", "Who?", ["A", "B"]),
    ]
    passages = [Passage("p1", 'Zürich "city"', "Line one.\nLine two."), Passage("p2", "", "x")]
    a, b = write_qa(tmp_path / "a.jsonl", examples), write_qa(tmp_path / "b.jsonl", examples)
    assert read_qa(a) == examples
    assert a.read_bytes() == b.read_bytes() and "Zürich".encode() in a.read_bytes()
    c = write_corpus(tmp_path / "c.jsonl", passages)
    assert read_corpus(c) == passages
    assert set(json.loads(c.read_text().splitlines()[0])) == {"id", "contents", "title", "text"}


# Every character str.splitlines() breaks at besides '\n' and '\r\n'; JSON may hold them unescaped in a string.
LINE_SEPARATORS = "\r\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e"


def test_jsonl_splits_records_at_newline_only_so_its_own_files_read_back(tmp_path):
    examples = [QAExample(id=f"q{i}", question=f"Who{sep}wrote it?", golden_answers=[f"A{sep}B"],
                          metadata={"note": sep})
                for i, sep in enumerate(LINE_SEPARATORS)]
    passages = [Passage(id=f"p{i}", title=f"T{sep}", text=f"x{sep}y") for i, sep in enumerate(LINE_SEPARATORS)]
    assert read_qa(write_qa(tmp_path / "qa.jsonl", examples)) == examples
    assert read_corpus(write_corpus(tmp_path / "corpus.jsonl", passages)) == passages


def test_inline_lists_and_json_files_go_through_the_same_checks():
    """A corpus or QA set given in YAML as a list of records is read by the file readers' record checks."""
    from bridge_pl.data.sources import load_corpus, load_qa

    passage = {"id": "p1", "contents": '"Paris"\nParis is a city.'}
    assert load_corpus([passage]) == [Passage(id="p1", title="Paris", text="Paris is a city.")]
    assert load_corpus([Passage("p1", "Paris", "x")]) == [Passage("p1", "Paris", "x")]  # objects, from Python
    with pytest.raises(DataFormatError, match=r"corpus \(inline list\) item 1: field 'id' duplicates id 'p1'"):
        load_corpus([passage, passage])
    with pytest.raises(DataFormatError, match=r"QA set \(inline list\) item 0: field 'golden_answers' is missing"):
        load_qa([{"question": "Who?"}])
    with pytest.raises(DataFormatError, match=r"QA set \(inline list\): no QA examples"):
        load_qa([])
    assert load_qa([GOOD])[0].golden_answers == ["Zorvan"]
