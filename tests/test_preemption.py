"""A preempted 2-process ``fsdp2`` run: ``bridge-pl fit`` is started as a user starts it (Lightning launches rank 1
from it), and SIGTERM is sent from outside, as a scheduler sends it, to one rank or to both seconds apart, or
reaches rank 1 as a checkpoint save begins. Both ranks stop at the same iteration with exit status 143 and one
whole checkpoint, and ``--ckpt_path last`` resumes to the losses and validations of a run never stopped.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import TINY, assert_same_log, bridge_pl_process, finish, rank_one, step_log

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name == "nt", reason="POSIX signals, gloo processes")]

TWO_RANKS = [
    "--trainer.devices=2", "--trainer.strategy=fsdp2", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
    "--trainer.enable_checkpointing=true", "--data.reward=plugins.DistinctWordsReward",
    "--trainer.callbacks+=callbacks.checkpoint.ValidatedCheckpoint",
    "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=true",
    "--trainer.callbacks+=plugins.SearchSteer",
]
STOPPED_WITHIN = 120  # seconds from the first signal to both ranks' exit


def start(root: Path, *extra: str) -> subprocess.Popen:
    """``bridge-pl fit`` on 2 ranks, logging each iteration's losses to ``root/steps.jsonl``, resuming from
    ``last`` when there is one."""
    return bridge_pl_process("fit", "--config", TINY, f"--trainer.default_root_dir={root}", *TWO_RANKS,
                             "--trainer.callbacks+=plugins.StepLog", f"--trainer.callbacks.path={root / 'steps.jsonl'}",
                             *extra, "--ckpt_path=last")


def wait_for_step(root: Path, step: int, run: subprocess.Popen) -> None:
    path = root / "steps.jsonl"
    while not (path.is_file() and any(json.loads(line).get("step") == step for line in path.read_text().splitlines())):
        assert run.poll() is None, finish(run)[1][-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    status, output = finish(start(root))
    assert status == 0, output[-3000:]
    return root


# rank 1's own SIGTERM as its first checkpoint save begins (the end of iteration 1)
DURING_A_SAVE = ["--trainer.callbacks+=plugins.KillAt", "--trainer.callbacks.point=save",
                 "--trainer.callbacks.signal_name=SIGTERM", "--trainer.callbacks.rank=1"]


@pytest.mark.parametrize("targets", [(1,), (0, 1), ()], ids=["rank1-alone", "both-ranks-3s-apart", "rank1-in-a-save"])
def test_sigterm_stops_both_ranks_at_one_checkpoint_that_resumes_exactly(tmp_path, uninterrupted, targets):
    run = start(tmp_path, *([] if targets else DURING_A_SAVE))
    pids = {0: run.pid, 1: rank_one(run)}
    wait_for_step(tmp_path, 1, run)  # the outside signals land in the second iteration
    sent = time.monotonic()
    for i, rank in enumerate(targets):
        if i:
            time.sleep(3)
        os.kill(pids[rank], signal.SIGTERM)
    status, output = finish(run, timeout=STOPPED_WITHIN)
    assert time.monotonic() - sent < STOPPED_WITHIN
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert not Path(f"/proc/{pids[1]}").exists() or "zombie" in Path(f"/proc/{pids[1]}/status").read_text()
    (line,) = [line for line in output.splitlines() if "bridge-pl: stopped by SIGTERM" in line and "resume" in line]
    assert "--ckpt_path=last" in line
    stopped_at = max(step_log(tmp_path, "step"))
    assert 1 <= stopped_at < 4

    status, output = finish(start(tmp_path))
    assert status == 0, output[-3000:]
    for key in ("step", "val_step"):
        assert_same_log(tmp_path, uninterrupted, key)
