"""The medical track's data and scoring: MIRAGE and MedRAG readers, multiple-choice answers, accuracy, world-mc."""

import collections
import json
from pathlib import Path

import pytest

from bridge_pl.data.datamodule import RolloutDataModule
from bridge_pl.data.medical import MIRAGE_SUBSETS, expand_sets, read_medrag, read_mirage
from bridge_pl.data.sources import load_corpus, load_qa
from bridge_pl.data.world import MC_OPTIONS, build_world
from bridge_pl.metrics import QAMetrics, set_means
from bridge_pl.records import DataFormatError
from bridge_pl.rewards import answer_scores, choice_letter

DATA = Path(__file__).parent / "data"
MIRAGE = DATA / "mirage" / "benchmark.json"
MEDRAG = DATA / "medrag"
# each subset's option letters, as published (MedQA-US 4 options, PubMedQA* yes/no/maybe, BioASQ-Y/N yes/no)
LETTERS = {"medqa": "ABCD", "medmcqa": "ABCD", "pubmedqa": "ABC", "bioasq": "AB", "mmlu": "ABCD"}


def test_each_mirage_subset_is_read_with_its_options_and_gold_letter():
    subsets = read_mirage(MIRAGE)
    assert tuple(subsets) == MIRAGE_SUBSETS
    raw = json.loads(MIRAGE.read_text())
    for subset, examples in subsets.items():
        assert len(examples) == len(raw[subset]) == 24
        for ex, (qid, row) in zip(examples, raw[subset].items()):
            assert ex.id == qid and ex.question == row["question"]
            assert ex.golden_answers == [row["answer"]]
            assert ex.metadata == {"options": row["options"], "type": subset}
            assert "".join(ex.metadata["options"]) == LETTERS[subset]
    assert subsets["pubmedqa"][0].metadata["options"] == {"A": "yes", "B": "no", "C": "maybe"}
    assert subsets["bioasq"][0].metadata["options"] == {"A": "yes", "B": "no"}


def test_mirage_specs_name_one_subset_or_all_five():
    assert expand_sets({"mirage": f"mirage:{MIRAGE}", "dev": "world/dev", "one": f"mirage:{MIRAGE}#mmlu"}) == {
        **{f"mirage/{s}": f"mirage:{MIRAGE}#{s}" for s in MIRAGE_SUBSETS}, "dev": "world/dev",
        "one": f"mirage:{MIRAGE}#mmlu"}
    assert [ex.id for ex in load_qa(f"mirage:{MIRAGE}#bioasq")] == list(json.loads(MIRAGE.read_text())["bioasq"])
    assert len(load_qa(f"mirage:{MIRAGE}")) == 5 * 24
    with pytest.raises(DataFormatError, match="no subset 'medqa_us'.*medqa, medmcqa"):
        load_qa(f"mirage:{MIRAGE}#medqa_us")
    data = RolloutDataModule(val={"mirage": f"mirage:{MIRAGE}"}, test={"t": f"mirage:{MIRAGE}#pubmedqa"})
    assert list(data.val_sources) == [f"mirage/{s}" for s in MIRAGE_SUBSETS] and list(data.test_sources) == ["t"]


def _bad_benchmark(tmp_path, change):
    data = json.loads(MIRAGE.read_text())
    qid = list(data["medqa"])[3]
    change(data["medqa"][qid])
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(data, indent=1))
    return path, qid


@pytest.mark.parametrize(("change", "field", "expected"), [
    (lambda q: q.update(answer="E"), "answer", "is 'E', which is not one of the options A, B, C, D"),
    (lambda q: q.update(answer="b"), "answer", "must be an option letter"),
    (lambda q: q.pop("answer"), "answer", "is missing"),
    (lambda q: q.update(options=["x", "y", "z"]), "options", "{letter: text}"),
    (lambda q: q.update(options={"1": "x", "2": "y"}), "options", "letters A, B in order"),
    (lambda q: q.update(options={"A": "x", "B": ""}), "options", "non-empty string"),
    (lambda q: q.pop("options"), "options", "is missing"),
    (lambda q: q.update(question=" "), "question", "non-empty string"),
])
def test_a_bad_mirage_question_fails_with_file_question_id_and_field(tmp_path, change, field, expected):
    path, qid = _bad_benchmark(tmp_path, change)
    with pytest.raises(DataFormatError) as err:
        read_mirage(path)
    message = str(err.value)
    assert message.startswith(f"{path}: question 'medqa/{qid}': field '{field}'") and expected in message
    assert "\n" not in message


@pytest.mark.parametrize(("text", "expected"), [
    ("", "the file is empty"), ("  \n", "the file is empty"), ('{"medqa": {"q1": ', ":1: invalid JSON"),
    ("[1, 2]", "expected a JSON object"), ('{"medqa": []}', "subset 'medqa' must be a non-empty object"),
])
def test_a_bad_mirage_file_fails_with_its_name(tmp_path, text, expected):
    path = tmp_path / "benchmark.json"
    path.write_text(text)
    with pytest.raises(DataFormatError, match=expected) as err:
        read_mirage(path)
    assert str(err.value).startswith(str(path))


def test_medrag_rows_are_a_corpus_kind_read_from_a_file_or_a_folder():
    one = read_medrag(MEDRAG / "textbooks" / "chunk" / "Pharmacology_Katzung.jsonl")
    row = json.loads((MEDRAG / "textbooks" / "chunk" / "Pharmacology_Katzung.jsonl").read_text().splitlines()[0])
    assert (one[0].id, one[0].title, one[0].text) == (row["id"], row["title"], row["content"])
    medcorp = load_corpus(f"medrag:{MEDRAG}")  # all chunk files below the folder, in sorted path order
    assert len(medcorp) == 6 + 12 + 12
    first = json.loads((MEDRAG / "pubmed" / "chunk" / "pubmed23n0001.jsonl").read_text().splitlines()[0])
    assert medcorp[0].id == first["id"]  # pubmed/ sorts before statpearls/ and textbooks/
    assert {p.id for p in medcorp} >= {p.id for p in one}


@pytest.mark.parametrize(("row", "field", "expected"), [
    ({"title": "T", "content": "c"}, "id", "is missing"),
    ({"id": "x", "content": "c"}, "title", "is missing"),
    ({"id": "x", "title": "T"}, "content", "is missing"),
    ({"id": "x", "title": "T", "content": 3}, "content", "must be a string"),
    ({"id": "x", "title": "T", "content": " "}, "content", "is blank"),  # strict only
    ({"id": "Pharmacology_Katzung_0", "title": "T", "content": "c"}, "id", "duplicates id"),  # strict only
])
def test_a_bad_medrag_row_fails_with_file_line_and_field(tmp_path, row, field, expected):
    good = (MEDRAG / "textbooks" / "chunk" / "Pharmacology_Katzung.jsonl").read_text().splitlines()[:2]
    path = tmp_path / "chunk.jsonl"
    path.write_text("\n".join([*good, json.dumps(row)]) + "\n")
    with pytest.raises(DataFormatError) as err:
        load_corpus(f"medrag:{path}?strict")
    assert str(err.value).startswith(f"{path}:3: field '{field}'") and expected in str(err.value)


def test_an_empty_medrag_file_or_folder_fails(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    with pytest.raises(DataFormatError, match="a.jsonl: no passages"):
        read_medrag(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFormatError, match="without .jsonl or .jsonl.gz files"):
        read_medrag(tmp_path / "empty")


def test_a_multiple_choice_row_of_a_qa_file_is_checked(tmp_path):
    path = tmp_path / "train.jsonl"
    good = {"id": "m1", "question": "Q?", "golden_answers": ["B"], "options": {"A": "x", "B": "y"}}
    bad = {"id": "m2", "question": "Q?", "golden_answers": ["C"], "options": {"A": "x", "B": "y"}}
    path.write_text(json.dumps(good) + "\n")
    assert load_qa(str(path))[0].metadata["options"] == {"A": "x", "B": "y"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataFormatError, match=r"train.jsonl: question 'm2': field 'golden_answers' is 'C'"):
        load_qa(str(path))


OPTIONS = {"A": "Hepatocyte", "B": "Type II pneumocyte", "C": "Beta cell", "D": "Kupffer cell"}
STYLES = [  # (answer as written, letter read)
    ("C", "C"), ("c", "C"), ("C.", "C"), ("(C)", "C"), ("C)", "C"), ("[C]", "C"), ("{C}", "C"), ("**C**", "C"),
    ("'C'", "C"), ("C:", "C"), (" C ", "C"), ("Answer: C", "C"), ("answer C", "C"), ("The answer is C", "C"),
    ("The answer is (C).", "C"), ("The correct answer is C", "C"), ("Option C", "C"), ("option (c)", "C"),
    ("Choice: C", "C"), ("C. Beta cell", "C"), ("(C) Beta cell", "C"), ("C - Beta cell", "C"),
    ("C Beta cell", "C"), ("C) because insulin comes from islets", "C"), ("Beta cell", "C"), ("beta cell.", "C"),
    ("the beta cell", None), ("A", "A"), ("D. Kupffer cell", "D"), ("type ii pneumocyte", "B"),
    # what must not map to a letter
    ("E", None), ("(E)", None), ("C. Hepatocyte", None), ("A virus", None), ("Beta cells of the islets", None),
    ("I am not sure", None), ("", None), (None, None), ("CD", None),
]


@pytest.mark.parametrize(("written", "letter"), STYLES, ids=[repr(w) for w, _ in STYLES])
def test_choice_letter_reads_hand_written_answer_styles(written, letter):
    assert choice_letter(written, OPTIONS) == letter


def test_there_are_at_least_twenty_styles():
    assert len([s for s in STYLES if s[1] is not None]) >= 20


def test_accuracy_equals_a_hand_count_and_the_macro_average_the_mean_of_subsets():
    yes_no = {"A": "yes", "B": "no"}
    four = dict(OPTIONS)
    # subset 1: 3 of 4 right; subset 2: 1 of 2 right; one free-text question does not count towards accuracy
    metric_1, metric_2 = QAMetrics(), QAMetrics()
    metric_1.update(["C", "A", "D", "B"], [["C"], ["A"], ["D"], ["A"]], [1] * 4, [0] * 4, [1] * 4,
                    [1] * 4, [four] * 4, ["C", "A", "D", "B"])
    metric_2.update(["A", "maybe", "Paris"], [["A"], ["B"], ["Paris"]], [1] * 3, [0] * 3, [1] * 3, [1] * 3,
                    [yes_no, yes_no, None], ["A", None, None])
    one, two = metric_1.compute(), metric_2.compute()
    assert float(one["accuracy"]) == pytest.approx(3 / 4) and float(one["em"]) == pytest.approx(3 / 4)
    assert float(two["accuracy"]) == pytest.approx(1 / 2) and float(two["em"]) == pytest.approx(2 / 3)
    free = QAMetrics()
    free.update(["Paris"], [["Paris"]], [1], [0], [1], [1])
    assert "accuracy" not in free.compute()
    means = set_means({"val/mirage/medqa": {"accuracy": 0.75, "em": 0.75}, "val/mirage/bioasq": {"accuracy": 0.5,
                       "em": 2 / 3}, "val/nq": {"em": 0.2}}, "val")
    assert means["val/mirage/accuracy"] == pytest.approx((0.75 + 0.5) / 2)
    assert means["val/accuracy"] == pytest.approx((0.75 + 0.5) / 2)  # over the sets that have it
    assert means["val/em"] == pytest.approx((0.75 + 2 / 3 + 0.2) / 3)
    assert "val/nq/em" not in means


def test_letter_a_scores_although_squad_normalisation_erases_it():
    assert answer_scores("A", ["A"], {"A": "yes", "B": "no"}) == {"em": 1.0, "f1": 1.0, "sub_em": 1.0}
    assert answer_scores("A", ["A"])["em"] == 0.0  # free text: "a" is an article


def test_the_world_renders_a_share_as_multiple_choice_with_the_gold_letter_uniform():
    plain, mixed = build_world(0), build_world(0, mc_share=0.5)
    assert plain.corpus == mixed.corpus
    everything = mixed.train + mixed.dev + mixed.test
    choice = [ex for ex in everything if "options" in ex.metadata]
    assert 0.45 < len(choice) / len(everything) < 0.55
    letters = collections.Counter(ex.golden_answers[0] for ex in choice)
    assert set(letters) == {"A", "B", "C", "D"} and min(letters.values()) > len(choice) / MC_OPTIONS * 0.8
    by_id = {ex.id: ex for ex in plain.train + plain.dev + plain.test}
    for ex in choice:
        original, options = by_id[ex.id], ex.metadata["options"]
        assert ex.question == original.question and len(set(options.values())) == MC_OPTIONS
        assert options[ex.golden_answers[0]] == ex.metadata["answer_text"] == original.golden_answers[0]
        if ex.metadata["type"] == "comparison":
            assert set(ex.metadata["hops"]) <= set(options.values())
        kinds = {value.isdigit() for value in options.values()}
        assert len(kinds) == 1  # years among years, names among names
    assert load_qa("world-mc/dev") == mixed.dev
    assert load_qa("world/dev") == plain.dev


def test_a_multiple_choice_prompt_lists_the_lettered_options_and_asks_for_a_letter():
    class Tokenizer:
        chat_template = None

        def __call__(self, text, **_):
            self.text = text
            return {"input_ids": [1]}

    tokenizer, data = Tokenizer(), RolloutDataModule()
    data.collector.prompts.ids(tokenizer, "Which cell makes insulin?", OPTIONS)
    assert "Question: Which cell makes insulin?\nOptions:\nA. Hepatocyte\nB. Type II pneumocyte\nC. Beta cell\n" \
           "D. Kupffer cell\n" in tokenizer.text
    assert "<answer>C</answer>" in tokenizer.text
    data.collector.prompts.ids(tokenizer, "Who?")
    assert "Options" not in tokenizer.text
    with pytest.raises(ValueError, match="choice_instruction"):
        RolloutDataModule(choice_instruction="{question}")


def test_a_multiple_choice_rollout_is_rewarded_for_the_gold_letter(tmp_path):
    """The datamodule's scorer on what a policy wrote (tiny model's tokenizer): letter out, reward 1 for the gold."""
    from helpers import tiny_module

    from bridge_pl.records import QAExample
    from bridge_pl.rollout.engine import Trajectory

    module, data = tiny_module(tmp_path)
    tokenizer = module.policy.tokenizer
    example = QAExample("q", "Which cell makes insulin?", ["C"], {"options": OPTIONS})
    free = QAExample("f", "Capital of France?", ["Paris"])

    def written(text):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return Trajectory(0, [1], ids, [1] * len(ids), text, [], 1, 1, 0, True)

    texts = ["<answer>(C)</answer>", "<answer>Beta cell</answer>", "<answer>A</answer>", "<answer>Paris</answer>"]
    written_texts = [written(t) for t in texts]
    scores = data.collector.score(module.policy.tokenizer, written_texts, [example, example, example, free])
    assert scores == [("C", 1.0, "C"), ("C", 1.0, "C"), ("A", 0.0, "A"), ("Paris", 1.0, None)]


def test_a_tiny_fit_on_world_mc_trains_and_logs_accuracy(tmp_path):
    """One iteration and one validation on world-mc with the tiny models: the multiple-choice path runs end to end."""
    from helpers import fit_tiny

    cli = fit_tiny(tmp_path, "--data.train=world-mc/train", '--data.val={"mc": "world-mc/dev"}',
                   "--data.max_eval_examples=4", "--trainer.max_steps=1", "--trainer.val_check_interval=1")
    metrics = cli.trainer.callback_metrics
    dev = load_qa("world-mc/dev")[:4]
    choices = sum("options" in ex.metadata for ex in dev)
    assert choices > 0 and float(metrics["val/mc/accuracy"]) * choices in range(choices + 1)
    assert 0.0 <= float(metrics["val/mc/em"]) <= 1.0


def test_the_miss_report_scores_a_multiple_choice_answer_by_its_letter_and_looks_for_the_option_text():
    from bridge_pl.miss_analysis import classify
    from bridge_pl.records import Passage

    shown = [Passage("p1", "Islets", "Beta cells of the pancreas make insulin.")]
    options = {"A": "Hepatocyte", "B": "Beta cells"}
    right = classify("B", ["B"], shown, options=options, choice="B")
    wrong = classify("A", ["B"], shown, options=options, choice="A")
    assert (right.failed, right.retrieved) == (False, True)
    assert (wrong.failed, wrong.retrieved) == (True, True)  # the evidence was shown: a reasoning miss
    assert classify("A", ["A"], [], options={"A": "yes", "B": "no"}, choice="A").failed is False
    assert classify("A", ["A"], [], options={"A": "yes", "B": "no"}).failed is True  # the reward read no letter
