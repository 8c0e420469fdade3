"""What ``tensorboard --logdir`` shows after a tiny ``bridge-pl fit``: read back from the event files."""

import contextlib
import io
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import TINY, load_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bridge_pl.cli import BridgeCLI
from bridge_pl.metrics import StepLogKeys
from callbacks.progress import BridgeProgressBar


def event_tags(log_dir: Path) -> tuple[EventAccumulator, dict[str, list[str]]]:
    """The loaded event files of ``log_dir`` and their tags by kind ("scalars", "tensors" (text), "images", ...)."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return events, events.Tags()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[BridgeCLI, Path, str]:
    """``bridge-pl fit`` on the tiny config with the default TensorBoard logger and the inspection callbacks."""
    root = tmp_path_factory.mktemp("tb")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli = BridgeCLI(args=[
            "fit", "--config", TINY, f"--trainer.default_root_dir={root}", "--trainer.logger=true",
            "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=true",
            "--trainer.callbacks+=callbacks.qa_eval.QAEval",
            "--trainer.callbacks+=callbacks.miss_report.MissReport",
            "--trainer.callbacks+=callbacks.progress.BridgeProgressBar",
            "--trainer.callbacks+=callbacks.warm_start.WarmStart",
            "--trainer.callbacks.steps=1", "--trainer.callbacks.batch_size=1",
        ])
    return cli, Path(cli.trainer.logger.log_dir), out.getvalue()


def test_fit_says_where_the_logs_are(tiny_run):
    cli, log_dir, printed = tiny_run
    assert f"TensorBoard logs in {log_dir}" in printed and log_dir.is_relative_to(cli.trainer.default_root_dir)


def test_event_files_hold_eval_misses_and_trajectories(tiny_run):
    _, log_dir, _ = tiny_run
    events, tags = event_tags(log_dir)
    scalars = set(tags["scalars"])
    assert {"val/world_dev/em", "val/world_dev/f1", "val/world_dev/sub_em", "val/em", "val/f1"} <= scalars
    misses = {"retrieval_miss_rate", "reasoning_miss_rate", "failure_rate", "recall@k", "gold_id_share"}
    assert {f"miss/{n}" for n in misses} <= scalars and {f"val/world_dev/miss/{n}" for n in misses} <= scalars
    # one x-axis, the RL iterations done: iteration i's metrics at step i, the dev-EM curve after the warm start
    # (step 0) and after iteration 2 (step 2)
    assert [e.step for e in events.Scalars("miss/failure_rate")] == [1, 2]  # every training step
    for timing in ("rollout/seconds", "update/seconds"):  # where each iteration's wall time went
        assert [e.step for e in events.Scalars(timing)] == [1, 2] and all(e.value > 0 for e in events.Scalars(timing))
    assert [e.step for e in events.Scalars("val/world_dev/em")] == [0, 2]
    assert [e.step for e in events.Scalars("val/world_dev/miss/failure_rate")] == [2]  # callbacks' too
    assert "step" not in scalars and "epoch" not in scalars
    text_tag = "val/world_dev/trajectories/text_summary"
    assert text_tag in tags["tensors"]
    text = events.Tensors(text_tag)[0].tensor_proto.string_val[0].decode()
    assert text.count("**Question**") == 3 and "**Gold:**" in text and "Response:" in text
    assert (log_dir / "predictions" / "val_world_dev_step2.jsonl").is_file()


def test_validate_from_a_checkpoint_logs_at_its_iteration(tiny_run, tmp_path):
    """Outside ``fit`` Lightning's global step is 0; the checkpoint's iteration (2 here) is the x-axis instead."""
    cli, _, _ = tiny_run
    checkpoint = tmp_path / "iteration2.ckpt"
    cli.trainer.save_checkpoint(checkpoint)
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="validate")
    trainer = L.Trainer(default_root_dir=tmp_path, logger=logger, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.validate(cli.model, cli.datamodule, ckpt_path=checkpoint, verbose=False)
    assert trainer.global_step == 0
    events, _ = event_tags(Path(logger.log_dir))
    assert [e.step for e in events.Scalars("val/world_dev/em")] == [2]


def test_timeline_charges_the_whole_span_to_phases(tiny_run):
    """experiments/demo_timeline.py on a real run: warm start, evaluations and the iterations' split add up."""
    _, log_dir, _ = tiny_run
    seconds = load_script("experiments", "demo_timeline").timeline(log_dir)
    assert {"warm start", "evaluation", "iteration: rollout", "iteration: update", "iteration: other"} <= seconds.keys()
    assert all(seconds[p] > 0 for p in ("warm start", "evaluation", "iteration: rollout", "iteration: update"))
    assert sum(v for p, v in seconds.items() if p != "span") == pytest.approx(seconds["span"])


def test_progress_bar_shows_reward_and_val_em(tiny_run):
    cli, _, _ = tiny_run
    bars = [c for c in cli.trainer.callbacks if isinstance(c, BridgeProgressBar)]
    assert len(bars) == 1 and cli.trainer.progress_bar_callback is bars[0]
    assert set(bars[0].get_metrics(cli.trainer, cli.model)) == {"reward", "val/em"}
    assert BridgeProgressBar(metrics=["miss/failure_rate"]).get_metrics(cli.trainer, cli.model) == {
        "miss/failure_rate": float(cli.trainer.callback_metrics["miss/failure_rate"])
    }


class _SometimesLogs(L.LightningModule):
    """Logs ``loss/policy`` at its first two steps only, as an iteration that skips its θ step leaves it out."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.keys = StepLogKeys()

    def training_step(self, batch, batch_idx):
        logs = {"train/reward": float(batch_idx)} | ({"loss/policy": 100.0 + batch_idx} if batch_idx < 2 else {})
        self.log_dict(self.keys.fill(logs))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(4, 1))


def test_a_key_a_step_leaves_out_shows_a_gap_not_the_last_value(tmp_path):
    """Without ``StepLogKeys`` Lightning re-sends ``loss/policy`` = 101 at steps 2 and 3 (its last value)."""
    trainer = L.Trainer(max_epochs=1, default_root_dir=tmp_path, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(_SometimesLogs())
    events, _ = event_tags(Path(trainer.logger.log_dir))
    values = [e.value for e in events.Scalars("loss/policy")]
    assert values[:2] == [100.0, 101.0] and len(values) == 4 and all(math.isnan(v) for v in values[2:])
    assert [e.value for e in events.Scalars("train/reward")] == [0.0, 1.0, 2.0, 3.0]
