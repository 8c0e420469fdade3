"""Crash safety: a tiny ``bridge-pl fit`` is SIGKILLed at five different points and rerun with ``--ckpt_path last``;
the resumed run ends with the same trained weights (LoRA, query encoder, ψ, optimizer-visible state) and logs the
same per-iteration losses and the same validations (steps and metrics) as a run that was never interrupted.

Each run is a real subprocess (a SIGKILL cannot be caught); ``plugins.KillAt`` picks the point.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, assert_same_log, step_log

pytestmark = pytest.mark.slow  # multi-process or subprocess fits: `make test-fast` leaves them out

TESTS = Path(__file__).parent
COMMON = [
    "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.enable_checkpointing=true",
    "--data.reward=plugins.DistinctWordsReward", "--model.retriever.init_args.passage_tower=tied",
    "--trainer.callbacks+=callbacks.index_refresh.IndexRefresh", "--trainer.callbacks.every_n_steps=2",
    "--trainer.callbacks+=callbacks.checkpoint.ValidatedCheckpoint",
    "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=true",
    "--trainer.callbacks+=plugins.SearchSteer",
]
KILL_POINTS = {  # point -> which pass through it (1-based) is killed
    "rollout": 5,  # an env step of the second iteration's rollout
    "update": 5,  # an optimizer step of the second iteration
    "checkpoint": 3,  # the checkpoint written after the second iteration (and its validation), before its rename
    "validation": 1,  # the first validation batch (after iteration 2)
    "refresh": 1,  # the first index rebuild
}


def fit(root: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), "OMP_NUM_THREADS": "1"}
    args = ["fit", "--config", TINY, f"--trainer.default_root_dir={root}", *COMMON,
            "--trainer.callbacks+=plugins.StepLog", f"--trainer.callbacks.path={root / 'steps.jsonl'}", *extra,
            "--ckpt_path=last"]
    return subprocess.run([sys.executable, "-m", "bridge_pl.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def final_state(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    done = fit(root)
    assert done.returncode == 0, done.stderr[-2000:]
    return root


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted, point):
    killed = fit(tmp_path, "--trainer.callbacks+=plugins.KillAt", f"--trainer.callbacks.point={point}",
                 f"--trainer.callbacks.count={KILL_POINTS[point]}")
    assert killed.returncode == -9, f"not killed at {point}: {killed.stderr[-2000:]}"
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.suffix == ".ckpt")
    assert "last.ckpt" in checkpoints  # whole checkpoints only: temp files never end in .ckpt
    resumed = fit(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not list((tmp_path / "checkpoints").glob(".*.tmp-*"))  # a killed write's temp file is cleared
    assert "Restored all states from the checkpoint" in resumed.stderr + resumed.stdout
    want, got = final_state(uninterrupted), final_state(tmp_path)
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    for key, steps in [("step", [1, 2, 3, 4]), ("val_step", [2, 4])]:  # a validation is not skipped on resume
        assert assert_same_log(tmp_path, uninterrupted, key) == steps, key
    phi_grads = [v for row in step_log(uninterrupted, "step").values() for k, v in row.items()
                 if k.startswith("grad_norm/phi")]
    assert any(v != 0 for v in phi_grads)
