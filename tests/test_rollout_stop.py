"""A stop signal ends a rollout in progress at its next decode step (a single-process ``bridge-pl fit``, started as a
user starts it): SIGTERM, SIGINT and SIGHUP alike, the iteration the rollout belonged to is not saved, and the exit
line (status 128 + the signal's number) names the newest whole checkpoint.
"""

import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import TINY, bridge_pl_process, finish

from bridge_pl.checkpoint_io import checkpoint_problem

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name == "nt", reason="POSIX signals")]  # subprocess fits

CHECKPOINTS = ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=callbacks.checkpoint.ValidatedCheckpoint",
               "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=true",
               "--trainer.val_check_interval=100"]


class SignalInRollout(L.Callback):
    """Sends this process ``signal_name`` at the ``forward``-th forward of the policy without gradients (the rollout's
    prefill and decode steps) in iteration ``step`` (0-based), and records in the JSON file ``path`` how many such
    forwards ran after it."""

    def __init__(self, path: str, signal_name: str = "SIGTERM", step: int = 0, forward: int = 3) -> None:
        self.path, self.signum, self.step, self.forward = Path(path), signal.Signals[signal_name], step, forward
        self.seen, self.after, self.sent = 0, 0, False
        self.trainer: L.Trainer | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.trainer = trainer
        pl_module.policy.hf_model.register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            return
        if self.sent:
            self.after += 1
        elif self.trainer.global_step == self.step:
            self.seen += 1
            if self.seen == self.forward:
                self.sent = True
                os.kill(os.getpid(), self.signum)  # its handler runs when this returns
        if self.sent:
            self.path.write_text(json.dumps({"after": self.after}))


def _fit(root: Path, *extra: str, **signal_at: object) -> tuple[int, str]:
    """``bridge-pl fit`` on the tiny config with ``extra`` options and :class:`SignalInRollout` (``signal_at``: its
    arguments); its exit status and output."""
    run = bridge_pl_process("fit", "--config", TINY, f"--trainer.default_root_dir={root}", *extra,
                            "--trainer.callbacks+=test_rollout_stop.SignalInRollout",
                            f"--trainer.callbacks.path={root / 'forwards.json'}",
                            *(f"--trainer.callbacks.{key}={value}" for key, value in signal_at.items()))
    return finish(run, timeout=900)


def test_a_long_rollout_ends_at_the_next_decode_step_on_sigterm(tmp_path):
    """Budgets that fill the model's context (3,954 of its 4,096 positions after the 142-token prompt): SIGTERM in
    the first rollout's 20th step ends it there, without waiting for the thousands of steps left."""
    root = tmp_path / "run"
    status, output = _fit(root, "--data.max_new_tokens_per_turn=3954", "--data.max_response_tokens=3954",
                          forward=20)
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert json.loads((root / "forwards.json").read_text())["after"] <= 1  # one more forward at most
    assert "bridge-pl: got SIGTERM: stopping at the next safe point" in output
    last = output.strip().splitlines()[-1]
    assert last == ("bridge-pl: stopped by SIGTERM at step 0; checkpointing is off (trainer.enable_checkpointing), "
                    "nothing was saved")


@pytest.mark.parametrize("name", ["SIGHUP", "SIGINT"])
def test_a_signal_during_a_rollout_stops_at_the_newest_whole_checkpoint(tmp_path, name):
    """The signal comes in the second iteration's rollout: the run stops there, and its exit line names the first
    iteration's checkpoint, which a resume continues."""
    root = tmp_path / "run"
    status, output = _fit(root, *CHECKPOINTS, "--trainer.max_steps=3", signal_name=name, step=1)
    signum = signal.Signals[name]
    assert status == 128 + signum, output[-3000:]
    assert json.loads((root / "forwards.json").read_text())["after"] <= 1
    last = root / "checkpoints" / "last.ckpt"
    line = output.strip().splitlines()[-1]
    assert line.startswith(f"bridge-pl: stopped by {name} at step 1; checkpoint {last}; resume with: bridge-pl fit ")
    assert line.endswith("--ckpt_path=last")
    assert checkpoint_problem(last) is None and torch.load(last, weights_only=True)["global_step"] == 1
