"""QAEval: hand-counted predictions, validate-from-checkpoint = end of fit, 2-process DDP = 1 process.

Run as a script (``python tests/test_qa_eval.py OUT_DIR``) it is the 2-process CPU DDP job that
``test_ddp_agrees_with_one_process`` launches (QAEval and MissReport together).
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import TINY, fit_tiny, tiny_cli
from lightning.pytorch.callbacks import ModelCheckpoint
from test_miss_report import PASSAGES, rollout_batch

from bridge_pl.cli import BridgeCLI
from bridge_pl.miss_analysis import MissCounts, batch_verdicts
from callbacks.miss_report import MissReport
from callbacks.qa_eval import QAEval, merge_rank_records, metrics_by_type, prediction_records, trajectory_markdown

# every eval question alone in its batch, so how examples are split into batches cannot change generation
EVAL_ALONE = ("--data.eval_batch_size=1", "--trainer.limit_val_batches=1.0", "--data.max_eval_examples=4")


def hand_batch():
    return rollout_batch(
        answers=["Paris", "the Paris city", None],
        golds=[["Paris"], ["Lyon", "paris"], ["Berlin"]],
        searches=[(1, "capital of france", [0, 1])],
        metadata=[{"type": "single"}, {"type": "bridge"}, {}],
        rewards=[1.0, 0.0, 0.0],
        dataset="dev",
    )


def test_prediction_records_hand_count():
    records = prediction_records(hand_batch(), PASSAGES.__getitem__)
    assert [(r["id"], r["prediction"], r["em"], r["reward"]) for r in records] == [
        ("e0", "Paris", 1.0, 1.0), ("e1", "the Paris city", 0.0, 0.0), ("e2", None, 0.0, 0.0)
    ]
    # "paris city" vs gold "paris": precision 1/2, recall 1
    assert [r["f1"] for r in records] == pytest.approx([1.0, 2 / 3, 0.0])
    assert records[1]["searches"] == [
        {"query": "capital of france", "titles": ["Paris", "France"], "ids": ["p0", "p1"]}
    ]
    assert records[0]["searches"] == [] and records[1]["golden_answers"] == ["Lyon", "paris"]
    assert [r["type"] for r in records] == ["single", "bridge", None]
    text = trajectory_markdown(records[1])
    assert "capital of france" in text and "Paris [p0]; France [p1]" in text and "Lyon | paris" in text


def test_metrics_by_type_hand_count():
    records = [{"type": "bridge", "em": 1.0, "searches": [1, 2]}, {"type": "bridge", "em": 0.0, "searches": [1]},
               {"type": "single", "em": 0.0, "searches": []}, {"type": None, "em": 1.0, "searches": [1]}]
    assert metrics_by_type(records, "val/dev") == {
        "val/dev/by_type/bridge/em": 0.5, "val/dev/by_type/bridge/searches": 1.5,
        "val/dev/by_type/single/em": 0.0, "val/dev/by_type/single/searches": 0.0,
    }
    assert metrics_by_type(records[3:], "val/dev") == {}  # untyped data: nothing logged


def test_report_writes_a_file_per_dataset_and_a_text_panel(tmp_path):
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path / "tb")
    panels, logged = [], []
    logger.experiment.add_text = lambda tag, text, step: panels.append((tag, text, step))
    trainer = types.SimpleNamespace(
        log_dir=str(tmp_path), default_root_dir=str(tmp_path), global_step=5, loggers=[logger], sanity_checking=False,
        strategy=types.SimpleNamespace(broadcast=lambda obj, src: obj),
        datamodule=types.SimpleNamespace(test_sources={"dev": "world/dev", "empty": "world/test"}),
    )
    module = types.SimpleNamespace(
        last_eval_batches={"test/dev": [hand_batch(), hand_batch()]},
        retriever=types.SimpleNamespace(passage=PASSAGES.__getitem__),
        log_dict=lambda metrics, **options: logged.append(metrics),
    )
    callback = QAEval(num_trajectories=2)
    callback.on_test_epoch_end(trainer, module)
    assert callback.written == [tmp_path / "predictions" / "test_dev_step5.jsonl"]
    lines = [json.loads(line) for line in callback.written[0].read_text().splitlines()]
    assert len(lines) == 6 and sum(r["em"] for r in lines) / len(lines) == pytest.approx(1 / 3)
    assert [(tag, step) for tag, _, step in panels] == [("test/dev/trajectories", 5)]
    assert panels[0][1].count("**Question**") == 2
    assert logged == [{"test/dev/by_type/bridge/em": 0.0, "test/dev/by_type/bridge/searches": 1.0,
                        "test/dev/by_type/single/em": 1.0, "test/dev/by_type/single/searches": 0.0}]


def test_merge_rank_records_restores_sampler_order():
    def recs(*ids):
        return [{"id": i} for i in ids]

    # 5 examples on 2 ranks: DistributedSampler deals 0,2,4 / 1,3 and pads rank 1 with example 0
    assert merge_rank_records([recs("a", "c", "e"), recs("b", "d", "a")]) == recs("a", "b", "c", "d", "e")
    assert merge_rank_records([recs("a"), []]) == recs("a") and merge_rank_records([[], []]) == []


def test_bad_option_is_named():
    with pytest.raises(ValueError, match="num_trajectories"):
        QAEval(num_trajectories=-1)


def _val_metrics(trainer: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


def test_validate_from_checkpoint_matches_the_end_of_fit(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    qa = QAEval()
    fit = fit_tiny(tmp_path / "fit", *EVAL_ALONE, callbacks=(qa, ckpt), search=False)
    at_fit = _val_metrics(fit.trainer)
    assert {"val/world_dev/em", "val/world_dev/f1", "val/world_dev/sub_em", "val/em", "val/searches"} <= set(at_fit)
    predictions = qa.written[-1].read_text()
    assert qa.written[-1].name == "val_world_dev_step2.jsonl"
    records = [json.loads(line) for line in predictions.splitlines()]
    assert len(records) == 4
    assert sum(r["em"] for r in records) / 4 == pytest.approx(at_fit["val/world_dev/em"])
    assert sum(r["f1"] for r in records) / 4 == pytest.approx(at_fit["val/world_dev/f1"])

    root = tmp_path / "validate"
    cli = BridgeCLI(args=[
        "validate", "--config", TINY, f"--trainer.default_root_dir={root}", *EVAL_ALONE,
        "--trainer.callbacks+=callbacks.qa_eval.QAEval", f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}",
    ])
    assert _val_metrics(cli.trainer) == pytest.approx(at_fit)
    assert (root / "predictions" / "val_world_dev_step2.jsonl").read_text() == predictions


class LocalMisses(L.Callback):
    """Records each training step's rank-local miss counts and the pooled counts MissReport logged."""

    def __init__(self, report: MissReport) -> None:
        self.report, self.steps = report, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        local = MissCounts.of(batch_verdicts(batch, pl_module.retriever.passage))
        self.steps.append({"local": vars(local), "pooled": vars(self.report.last["miss"])})


def ddp_main(out: Path) -> None:
    """2-process CPU DDP: validate (QAEval + MissReport), then a 1-step fit; each rank writes what it saw."""
    torch.set_num_threads(1)
    # mode frozen: the cheapest training step (MissReport's per-step path does not depend on the mode)
    cli = tiny_cli(out, *EVAL_ALONE, "--trainer.devices=2", "--trainer.strategy=ddp_find_unused_parameters_true",
                   "--trainer.max_steps=1", "--trainer.val_check_interval=100", "--model.mode=frozen")
    qa, report = QAEval(), MissReport()
    local = LocalMisses(report)
    cli.trainer.callbacks.extend([qa, report, local])  # LocalMisses after MissReport: reads its pooled counts
    cli.trainer.validate(cli.model, cli.datamodule)
    metrics = _val_metrics(cli.trainer)
    cli.trainer.fit(cli.model, cli.datamodule)
    result = {"val": metrics, "written": [str(p) for p in qa.written], "train": local.steps}
    (out / f"rank{cli.trainer.global_rank}.json").write_text(json.dumps(result))


def test_ddp_agrees_with_one_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get(
        "PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(tmp_path / "ddp")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text()) for r in range(2)]

    qa, report = QAEval(), MissReport()
    single = tiny_cli(tmp_path / "one", *EVAL_ALONE)
    single.trainer.callbacks.extend([qa, report])
    single.trainer.validate(single.model, single.datamodule)
    one = _val_metrics(single.trainer)
    assert {"val/world_dev/em", "val/world_dev/miss/retrieval_miss_rate", "val/world_dev/miss/recall@k"} <= set(one)
    assert any(key.startswith("val/world_dev/by_type/") for key in one)  # and every rank logged the same per type
    assert ranks[0]["val"] == pytest.approx(one) and ranks[1]["val"] == pytest.approx(one)
    assert ranks[1]["written"] == [] and len(ranks[0]["written"]) == 1  # rank 0 writes, once
    assert Path(ranks[0]["written"][0]).read_text() == qa.written[0].read_text()

    # training: every rank logs the sum of both ranks' counts of the step
    local = [ranks[r]["train"][0]["local"] for r in range(2)]
    total = {k: local[0][k] + local[1][k] for k in local[0]}
    assert ranks[0]["train"][0]["pooled"] == total == ranks[1]["train"][0]["pooled"]
    assert total["trajectories"] == 2 * 4  # 2 ranks x (batch_size 2 x n_samples 2)


if __name__ == "__main__":
    ddp_main(Path(sys.argv[1]))
