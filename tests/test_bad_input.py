"""Bad input, tried as a user would through ``bridge-pl fit``: each case must end with a non-zero exit, a message
that names the option or the file:line and field, no Python traceback, and no run directory left behind.

Option errors (keys, types, choices, ranges, cross-field rules, class paths, config files) are caught while the
config is parsed, before any model loads; data-file errors before the trainer (and its log directory) exists.
"""

import json

import pytest
from helpers import TINY

from bridge_pl.cli import main

OPTION_CASES = {
    "negative batch size": (["--data.batch_size=-1"], "data.batch_size must be an integer >= 1"),
    "zero samples per prompt": (["--data.n_samples=0"], "data.n_samples"),
    "zero eval batch": (["--data.eval_batch_size=0"], "data.eval_batch_size"),
    "zero turns": (["--data.max_turns=0"], "data.max_turns"),
    "zero response budget": (["--data.max_response_tokens=0"], "data.max_response_tokens"),
    "zero eval examples": (["--data.max_eval_examples=0"], "data.max_eval_examples"),
    "zero sampling rounds": (["--data.max_sampling_rounds=0"], "data.max_sampling_rounds"),
    "top_p above one": (["--data.top_p=1.5"], "data.top_p must be in (0, 1]"),
    "zero temperature": (["--data.temperature=0"], "data.temperature must be a finite number >= 0.01"),
    "top_k above candidates": (["--model.retrieval.top_k=9"],
                               "model.retrieval.top_k (9) must be <= model.retrieval.candidates (4)"),
    "zero candidates": (["--model.retrieval.candidates=0", "--model.retrieval.top_k=0"], "model.retrieval.candidates"),
    "negative kl": (["--model.rl.kl_coef=-0.1"], "model.rl.kl_coef must be >= 0"),
    "lambda above its cap": (["--model.solver.lam_init=20"],
                             "model.solver.lam_init (20.0) must be <= model.solver.lam_max (10.0)"),
    "lambda schedule in frozen mode": (["--model.mode=frozen", "--model.solver.lam_delta=0.1"],
                                       "model.mode 'frozen' does not use model.solver.lam_delta"),
    "neumann series in bridge mode": (["--model.solver.neumann_steps=3"],
                                      "model.mode 'bridge' does not use model.solver.neumann_steps"),
    "unknown key in a group": (["--model.rl.kl_coeff=0.1"], "--model.rl.kl_coeff"),
    "gamma above one": (["--model.rl.gamma=2"], "model.rl.gamma"),
    "zero token budget": (["--model.rl.micro_batch_tokens=0"], "model.rl.micro_batch_tokens"),
    "zero mini-batches": (["--model.rl.minibatches=0"], "model.rl.minibatches must be an integer >= 1"),
    "more mini-batches than a group's rows": (["--data.n_samples=2", "--model.rl.minibatches=3"],
                                             "model.rl.minibatches (3) must be <= data.n_samples (2)"),
    "zero retrieval temperature": (["--model.retrieval.temperature=0"], "model.retrieval.temperature"),
    "mode typo": (["--model.mode=brige"], "model.mode"),
    "unknown algorithm": (["--model.rl.algorithm=dpo"], "model.rl.algorithm"),
    "unknown kl estimator": (["--model.rl.kl_kind=k4"], "model.rl.kl_kind"),
    "unknown loss aggregation": (["--model.rl.loss_agg=sum"], "model.rl.loss_agg"),
    "abbreviated trainer key": (["--trainer.max_step=3"], "--trainer.max_step"),
    "unknown model key": (["--model.nonsense=1"], "--model.nonsense"),
    "wrong type": (["--data.batch_size=two"], "data.batch_size"),
    "unknown retriever class": (["--model.retriever.class_path=no.such.Retriever"], "no.such.Retriever"),
    "unknown policy model": (["--model.policy.init_args.model=no-such-model"], "no-such-model"),
    "negative type mixture weight": (['--data.type_mixture={"single": -1}'], "data.type_mixture"),
    "infinite kl coefficient": (["--model.rl.kl_coef=.inf"], "model.rl.kl_coef must be a finite number, got inf"),
    "nan clip range": (["--model.rl.clip_high=.nan"], "model.rl.clip_high must be a finite number, got nan"),
    "infinite mixture weight": (['--data.type_mixture={"single": .inf}'], "data.type_mixture must be finite weights"),
    "zero learning rate": (["--model.policy_optimizer=torch.optim.AdamW", "--model.policy_optimizer.init_args.lr=0"],
                           "model.policy_optimizer.init_args.lr must be > 0 (a learning rate), got 0"),
    "negative learning rate": (["--model.retriever_optimizer=torch.optim.SGD",
                                "--model.retriever_optimizer.init_args.lr=-0.01"],
                               "model.retriever_optimizer.init_args.lr must be > 0 (a learning rate), got -0.01"),
    "temperature below the floor": (["--data.temperature=1e-30"], "data.temperature must be a finite number >= 0.01"),
    "instruction with a stray brace": (["--data.instruction=Question: {question} {"],
                                       "data.instruction must be a template whose only placeholders are"),
    "instruction with an unknown placeholder": (["--data.instruction=Question: {question} {context}"],
                                                "unknown placeholder {context}"),
}


def _run(tmp_path, capfd, *args: str) -> str:
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, f"--trainer.default_root_dir={root}", "--trainer.max_steps=1"])
    out, err = capfd.readouterr()
    text = out + err
    assert exit_info.value.code not in (0, None), text
    assert "Traceback" not in text
    assert not root.exists(), "a failed run must leave no run directory behind"
    return text


@pytest.mark.parametrize("args, message", OPTION_CASES.values(), ids=OPTION_CASES.keys())
def test_a_bad_option_is_named_before_anything_runs(tmp_path, capfd, weight_loads, args, message):
    text = _run(tmp_path, capfd, "--config", TINY, *args)
    assert message in text
    assert "Loading weights" not in weight_loads  # no model was loaded


def test_a_policy_without_a_model_is_named(tmp_path, capfd):
    """The policy's model has no default: a config that leaves it out must not train a random-init model."""
    config = tmp_path / "no_model.yaml"
    config.write_text(open(TINY).read().replace("      model: tiny-llama\n", ""))
    text = _run(tmp_path, capfd, "--config", str(config))
    assert "model.policy" in text and "required: model" in text


def test_a_good_config_does_load_weights(tmp_path, weight_loads):
    """The counterpart of the check above: an accepted config does load the models (transformers opens its
    "Loading weights" bar, drawn on a terminal only)."""
    from helpers import tiny_cli

    tiny_cli(tmp_path)
    assert weight_loads.count("Loading weights") == 2  # the policy and the retriever's encoder


def test_too_many_minibatches_stop_a_python_built_fit_before_it_trains(tmp_path):
    """The CLI's mini-batch rule (above) also holds for a module and datamodule built in Python: ``setup`` raises,
    naming both options, before the warm start or any rollout."""
    from dataclasses import replace

    from helpers import tiny_cli

    from callbacks import WarmStart

    cli = tiny_cli(tmp_path)
    module = cli.model
    module.rl_config = replace(module.rl_config, minibatches=cli.datamodule.n_samples + 1)
    warm_start = WarmStart(steps=1, batch_size=1)
    cli.trainer.callbacks.append(warm_start)
    with pytest.raises(ValueError, match=rf"model.rl.minibatches \({cli.datamodule.n_samples + 1}\) must be <= "
                                         rf"data.n_samples \({cli.datamodule.n_samples}\)"):
        cli.trainer.fit(module, datamodule=cli.datamodule)
    assert warm_start.em == {}, "the warm start ran (it measures dev EM first)"


def test_a_missing_config_file_is_named(tmp_path, capfd):
    assert f"config file {tmp_path / 'missing.yaml'}: no such file" in _run(
        tmp_path, capfd, "--config", str(tmp_path / "missing.yaml"))


def test_a_config_file_with_a_yaml_syntax_error_is_named(tmp_path, capfd):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  mode: [bridge\n")
    assert f"config file {bad}:3: YAML syntax error" in _run(tmp_path, capfd, "--config", str(bad))


def test_a_config_file_holding_a_list_is_named(tmp_path, capfd):
    listed = tmp_path / "list.yaml"
    listed.write_text("- model:\n    mode: bridge\n")
    assert f"config file {listed}: expected a mapping of options (key: value), got a YAML list" in _run(
        tmp_path, capfd, "--config", str(listed))


def test_a_key_given_twice_in_a_config_file_is_named(tmp_path, capfd):
    twice = tmp_path / "twice.yaml"
    twice.write_text("data:\n  batch_size: 2\n  n_samples: 2\n  batch_size: 4\n")
    assert f"config file {twice}:4: key 'batch_size' appears twice in one mapping" in _run(
        tmp_path, capfd, "--config", TINY, "--config", str(twice))


def test_a_training_batch_larger_than_the_training_set_is_named(tmp_path, capfd, weight_loads):
    path = _jsonl(tmp_path / "qa.jsonl", QA, {**QA, "id": "b"})
    text = _run(tmp_path, capfd, "--config", TINY, f"--data.train={path}", "--data.batch_size=3")
    assert f"data.batch_size (3) is larger than the training set {path} (2 examples)" in text
    assert "Loading weights" not in weight_loads


def _jsonl(path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


QA = {"id": "a", "question": "Which city?", "golden_answers": ["Paris"]}
QA_CASES = {
    "missing answers": ([{"id": "a", "question": "Q?"}], ":1: field 'golden_answers' is missing"),
    "question not a string": ([QA, {"id": "b", "question": 5, "golden_answers": ["x"]}], ":2: field 'question'"),
    "empty answer list": ([{**QA, "golden_answers": []}], ":1: field 'golden_answers'"),
    "invalid json": ([QA, '{"id": "b", "question": "Q?"'], ":2: invalid JSON"),
    "duplicate ids": ([QA, QA], ":2: field 'id' duplicates id 'a'"),
    "not an object": ([QA, "[1, 2]"], ":2: expected a JSON object"),
    "empty file": ([], ": no QA examples (the file is empty)"),
    "huge line": ([{**QA, "question": "x" * 1_200_000}], ":1: a record of 1,200,"),
}


@pytest.mark.parametrize("rows, message", QA_CASES.values(), ids=QA_CASES.keys())
def test_a_bad_qa_file_is_named_with_line_and_field(tmp_path, capfd, weight_loads, rows, message):
    path = _jsonl(tmp_path / "qa.jsonl", *rows)
    text = _run(tmp_path, capfd, "--config", TINY, f"--data.train={path}")
    assert path + message in text
    assert "Loading weights" not in weight_loads  # QA sets are read before the models load


def test_a_non_utf8_qa_file_is_named_with_its_line(tmp_path, capfd):
    path = tmp_path / "qa.jsonl"
    path.write_bytes(json.dumps(QA).encode() + b'\n{"id": "b", "question": "\xff"}\n')
    assert f"{path}:2: not UTF-8 text" in _run(tmp_path, capfd, "--config", TINY, f"--data.train={path}")


def test_a_missing_qa_file_is_named(tmp_path, capfd):
    assert "nope.jsonl" in _run(tmp_path, capfd, "--config", TINY, f"--data.train={tmp_path / 'nope.jsonl'}")


PASSAGE = {"id": "p1", "contents": '"Paris"\nParis is a city.'}
CORPUS_CASES = {
    "missing contents": ([{"id": "p1", "title": "Paris"}], ":1: field 'contents' is missing"),
    "missing id": ([{"contents": "x"}], ":1: field 'id' is missing"),
    "duplicate passage ids": ([PASSAGE, PASSAGE], ":2: field 'id' duplicates id 'p1'"),
    "invalid json": ([PASSAGE, "{oops"], ":2: invalid JSON"),
    "empty corpus": ([], ": no passages (the file is empty)"),
}


@pytest.mark.parametrize("rows, message", CORPUS_CASES.values(), ids=CORPUS_CASES.keys())
def test_a_bad_corpus_is_named_with_line_and_field(tmp_path, capfd, weight_loads, rows, message):
    path = _jsonl(tmp_path / "corpus.jsonl", *rows)
    text = _run(tmp_path, capfd, "--config", TINY, f"--model.retriever.init_args.corpus={path}")
    assert path + message in text
    assert "Loading weights" not in weight_loads  # the corpus is read before the models load


TITLED = {"id": "p1", "title": "Paris", "text": "Paris is a city."}  # Passage's own fields


def test_a_corpus_in_a_json_file_goes_through_the_corpus_checks(tmp_path, capfd, weight_loads):
    """A .json list in Passage's own layout is read by the corpus reader, not straight into dataclasses."""
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps([TITLED, TITLED]))
    text = _run(tmp_path, capfd, "--config", TINY, f"--model.retriever.init_args.corpus={path}")
    assert f"{path}:item 1: field 'id' duplicates id 'p1'" in text and "Loading weights" not in weight_loads


def test_an_inline_corpus_goes_through_the_corpus_checks(tmp_path, capfd, weight_loads):
    inline = tmp_path / "inline.yaml"
    inline.write_text("model:\n  retriever:\n    init_args:\n      corpus:\n"
                      + "".join(f"        - {json.dumps(TITLED)}\n" for _ in range(2)))
    text = _run(tmp_path, capfd, "--config", TINY, "--config", str(inline))
    assert "corpus (inline list) item 1: field 'id' duplicates id 'p1'" in text
    assert "Loading weights" not in weight_loads
