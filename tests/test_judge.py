"""The reasoning-quality judge: reply parsing, the prompt, the OpenAI-compatible client against a local server,
the reply cache (resuming), SmolLM2 as a real judge, and QAEval's per-row and per-set reports."""

import collections
import http.server
import json
import re
import threading
import types
from pathlib import Path

import pytest
from test_miss_report import PASSAGES, rollout_batch

from bridge_pl.judge import (
    JUDGE_PROMPT,
    HFJudge,
    JudgeCache,
    JudgeSummary,
    OpenAIJudge,
    apply_verdicts,
    judge_prompt,
    judge_verdicts,
    parse_score,
    summarize,
)
from callbacks.qa_eval import QAEval

DOCS = Path(__file__).parents[1] / "docs" / "medical.md"


@pytest.mark.parametrize(("reply", "score"), [
    ("Score: 4", 4), ("score: 5", 5), ("SCORE = 3", 3), ("Score: **2**", 2), ("The score is 1.", 1),
    ("Reasoning is coherent.\nScore: 4", 4), ("Score: 2\nOn reflection, Score: 3", 3), ("4", 4), ("4/5", 4),
    (" **5** ", 5), ("Score: 7", None), ("Score: 4.5", None), ("Score: 10", None), ("good reasoning", None),
    ("", None), (None, None), ("I give it 4 out of 5 stars and 3 thumbs", None),
])
def test_parse_score(reply, score):
    assert parse_score(reply) == score


def judge_all(judge, records, cache) -> JudgeSummary:
    """Judge ``records`` in place and sum them up, by the steps QAEval runs (each rank's share, then the set)."""
    verdicts = judge_verdicts(judge, records, cache)
    apply_verdicts(records, verdicts)
    return summarize(verdicts)


def _record(question="Which cell makes insulin?", response="<think>islets</think>\n<answer> C </answer>",
            prediction="C", options=None):
    return {"question": question, "options": options, "response": response, "prediction": prediction,
            "golden_answers": ["SECRET-GOLD"]}


def test_the_prompt_shows_question_options_trajectory_and_answer_but_never_the_gold():
    options = {"A": "Hepatocyte", "B": "Beta cell"}
    prompt = judge_prompt(_record(options=options), 12_000)
    assert "Question: Which cell makes insulin?\nOptions:\nA. Hepatocyte\nB. Beta cell\n" in prompt
    assert "<think>islets</think>" in prompt and "Final answer: C" in prompt and "SECRET-GOLD" not in prompt
    assert "Options" not in judge_prompt(_record(), 12_000)
    assert "Final answer: (no answer)" in judge_prompt(_record(prediction=None), 12_000)
    long = judge_prompt(_record(response="x" * 500 + "MIDDLE" + "y" * 500), 400)
    assert "MIDDLE" not in long and "x" * 200 + "\n[...]\n" + "y" * 200 in long


def test_the_docs_print_the_prompt_verbatim():
    assert JUDGE_PROMPT in DOCS.read_text()


class _Endpoint(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint whose behaviour depends on the question in the prompt."""

    calls: collections.Counter = collections.Counter()

    def do_POST(self):  # noqa: N802 (the http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0 and body["model"] == "judge-model"
        question = re.search(r"Question: (\S+)", body["messages"][0]["content"])[1]
        self.calls[question] += 1
        status, payload = 200, None
        if question == "flaky" and self.calls[question] == 1:
            status = 503
        elif question == "refused":
            status = 400
        elif question == "garbled":
            payload = b"<html>not json</html>"
        content = {"good": "Coherent and grounded.\nScore: 4", "flaky": "Score: 2", "chatty": "Looks fine to me."}
        payload = payload or json.dumps({"choices": [{"message": {"content": content.get(question, "")}}]}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    _Endpoint.calls = collections.Counter()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_endpoint_judge_scores_counts_and_resumes_from_its_cache(endpoint, tmp_path):
    judge = OpenAIJudge(endpoint, "judge-model", retries=1, concurrency=2, timeout=10)
    questions = ["good", "flaky", "chatty", "refused", "garbled"]
    records = [_record(question=q) for q in questions]
    cache = JudgeCache(tmp_path / "cache.jsonl")
    summary = judge_all(judge, records, cache)
    assert [r["reasoning_quality"] for r in records] == [4, 2, None, None, None]
    assert (summary.judged, summary.unparsed, summary.failed) == (2, 1, 2)
    assert summary.reasoning_quality == pytest.approx(3.0)
    assert records[2]["judge_reply"] == "Looks fine to me."
    assert records[3]["judge_reply"].startswith("error: HTTP 400")
    assert records[4]["judge_reply"].startswith("error: not an OpenAI chat-completions reply")
    assert _Endpoint.calls == {"good": 1, "flaky": 2, "chatty": 1, "refused": 1, "garbled": 1}  # 400: no retry
    # resume: a new cache object on the same file asks again only for the two that got no reply
    again = [_record(question=q) for q in questions]
    summary = judge_all(judge, again, JudgeCache(tmp_path / "cache.jsonl"))
    assert _Endpoint.calls == {"good": 1, "flaky": 2, "chatty": 1, "refused": 2, "garbled": 2}
    assert [r["reasoning_quality"] for r in again] == [4, 2, None, None, None] and summary.failed == 2
    with open(tmp_path / "cache.jsonl", "a") as f:
        f.write('{"key": "torn')  # a run killed while writing
    assert len(JudgeCache(tmp_path / "cache.jsonl").entries) == 3


def test_each_rank_appends_to_its_own_cache_file_and_every_cache_reads_them_all(tmp_path):
    path = tmp_path / "judge_cache.jsonl"
    JudgeCache(path).add("k0", "Score: 1", 1)
    JudgeCache(path, rank=1).add("k1", "Score: 2", 2)
    JudgeCache(path, rank=12).add("k12", "no score", None)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "judge_cache.jsonl", "judge_cache.rank1.jsonl", "judge_cache.rank12.jsonl"]
    for rank in (0, 1, 3):  # any rank of a run with any number of ranks
        assert set(JudgeCache(path, rank).entries) == {"k0", "k1", "k12"}
    with open(tmp_path / "judge_cache.rank1.jsonl", "a") as f:
        f.write('{"key": "torn')  # a rank killed while writing
    JudgeCache(path, rank=1).add("k2", "Score: 3", 3)  # starts a new line: the torn one does not swallow it
    assert set(JudgeCache(path).entries) == {"k0", "k1", "k12", "k2"}


def test_an_unreachable_endpoint_counts_every_row_as_failed(tmp_path, endpoint):
    closed = endpoint.rsplit(":", 1)[0] + ":9/v1"  # the discard port on 127.0.0.1: nothing listens
    judge = OpenAIJudge(closed, "judge-model", retries=0, timeout=2)
    records = [_record(question="good"), _record(question="flaky")]
    summary = judge_all(judge, records, JudgeCache(tmp_path / "cache.jsonl"))
    assert (summary.judged, summary.unparsed, summary.failed, summary.reasoning_quality) == (0, 0, 2, None)
    assert records[0]["judge_reply"].startswith("error: no reply from http://127.0.0.1:9/v1")
    assert not (tmp_path / "cache.jsonl").exists()


def test_smollm2_as_the_judge_gives_a_score_or_a_counted_parse_failure_for_every_row(tmp_path):
    judge = HFJudge("smollm2-135m-instruct", max_new_tokens=8, batch_size=3, device="cpu")
    records = [
        _record(),
        _record(question="Is metformin used for type 2 diabetes?", options={"A": "yes", "B": "no"}, prediction="A",
                response="<search> metformin </search>\n<information>Doc 1(Title: \"Katzung\") Metformin is a "
                         "biguanide used for type 2 diabetes.</information>\n<answer> A </answer>"),
        _record(prediction=None, response="<think> I do not know </think>"),
    ]
    cache = JudgeCache(tmp_path / "cache.jsonl")
    summary = judge_all(judge, records, cache)
    assert summary.failed == 0 and summary.judged + summary.unparsed == 3
    for record in records:
        assert isinstance(record["judge_reply"], str)
        assert record["reasoning_quality"] == parse_score(record["judge_reply"])
        assert record["reasoning_quality"] is None or 1 <= record["reasoning_quality"] <= 5
    scores = [r["reasoning_quality"] for r in records if r["reasoning_quality"] is not None]
    assert summary.reasoning_quality == (sum(scores) / len(scores) if scores else None)
    assert len(cache.entries) == 3


def test_qa_eval_writes_the_judgement_per_row_and_logs_per_set_and_macro_means(endpoint, tmp_path):
    def batch(questions, dataset):
        b = rollout_batch(answers=["A"] * len(questions), golds=[["A"]] * len(questions), searches=[],
                          metadata=[{"options": {"A": "yes", "B": "no"}}] * len(questions), dataset=dataset)
        b.questions = list(questions)
        b.example_ids = [f"{dataset}-{i}" for i in range(len(questions))]
        b.choices = ["A"] * len(questions)  # the letter each answer's reward read
        return b

    sets = {"mirage/bioasq": ["good", "chatty"], "mirage/pubmedqa": ["flaky", "refused"]}
    logged = {}
    trainer = types.SimpleNamespace(
        log_dir=str(tmp_path), default_root_dir=str(tmp_path), global_step=3, loggers=[], sanity_checking=False,
        strategy=types.SimpleNamespace(broadcast=lambda obj, src: obj),
        datamodule=types.SimpleNamespace(val_sources=dict.fromkeys(sets, "mirage:x")),
    )
    module = types.SimpleNamespace(
        last_eval_batches={f"val/{name}": [batch(qs, name)] for name, qs in sets.items()},
        retriever=types.SimpleNamespace(passage=PASSAGES.__getitem__),
        log_dict=lambda metrics, **options: logged.update(metrics),
    )
    callback = QAEval(num_trajectories=0, judge=OpenAIJudge(endpoint, "judge-model", retries=1))
    with pytest.warns(UserWarning, match=r"on val/mirage/bioasq, 1 of 2 replies held no 'Score: N' and 0"):
        callback.on_validation_epoch_end(trainer, module)
    assert logged["val/mirage/bioasq/reasoning_quality"] == 4.0 and logged["val/mirage/bioasq/judge_unparsed"] == 1
    assert logged["val/mirage/pubmedqa/reasoning_quality"] == 2.0 and logged["val/mirage/pubmedqa/judge_failed"] == 1
    assert logged["val/mirage/reasoning_quality"] == logged["val/reasoning_quality"] == 3.0
    rows = [json.loads(line) for line in (tmp_path / "predictions" / "val_mirage_bioasq_step3.jsonl").open()]
    assert [(r["reasoning_quality"], r["judge_reply"], r["em"]) for r in rows] == [
        (4, "Coherent and grounded.\nScore: 4", 1.0), (None, "Looks fine to me.", 1.0)]
    assert (tmp_path / "judge_cache.jsonl").is_file()


def test_judge_settings_are_checked():
    with pytest.raises(ValueError, match="base_url"):
        OpenAIJudge("localhost:8000", "m")
    with pytest.raises(ValueError, match="dtype"):
        HFJudge("smollm2-135m-instruct", dtype="int8")


def test_a_yaml_config_turns_the_judge_on_and_a_validation_reports_it(tmp_path):
    """QAEval with an HFJudge named in YAML (the tiny random model as judge: its replies do not parse, and are
    counted and shown per row, while the validation completes)."""
    from helpers import tiny_cli

    config = tmp_path / "judge.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: callbacks.QAEval\n      init_args:\n        judge:\n"
        "          class_path: bridge_pl.judge.HFJudge\n"
        "          init_args: {model: tiny-llama, max_new_tokens: 4, device: cpu}\n"
    )
    cli = tiny_cli(tmp_path, "--data.max_eval_examples=2", "--config", str(config))
    cli.trainer.validate(cli.model, cli.datamodule)
    metrics = cli.trainer.callback_metrics
    parsed = 2 - float(metrics["val/world_dev/judge_unparsed"])
    assert float(metrics["val/world_dev/judge_failed"]) == 0
    assert ("val/world_dev/reasoning_quality" in metrics) == (parsed > 0)
    rows = [json.loads(line) for line in (tmp_path / "predictions" / "val_world_dev_step0.jsonl").open()]
    assert len(rows) == 2 and all(isinstance(r["judge_reply"], str) for r in rows)
    assert (tmp_path / "judge_cache.jsonl").is_file()
