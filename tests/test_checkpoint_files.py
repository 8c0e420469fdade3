"""Checkpoint files on their own (``bridge_pl.checkpoint_io``), without a training run: a checkpoint and its digest
agree whenever the writing process is killed; a bridge-pl checkpoint without its digest is checked by its zip CRCs and
named in a warning; a resume is compared with the run-defining options stored in the checkpoint.

A kill is a real SIGKILL of a child process that writes the checkpoint (a SIGKILL cannot be caught).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bridge_pl.checkpoint_io import (
    AtomicCheckpointIO,
    checkpoint_problem,
    config_problem,
    resolve_checkpoint,
)
from bridge_pl.files import digest_path

TESTS = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), "OMP_NUM_THREADS": "1"}
RUN = {"model.mode": "'bridge'", "model.policy.init_args.model": "'tiny-llama'", "model.policy.init_args.lora_r": "4",
       "model.retriever.init_args.corpus": "'world'", "data.train": "'world/train'",
       "model.policy_optimizer.init_args.lr": "0.0001", "model.rl.kl_coef": "0.001"}

# Saves step 1, then step 2 of one checkpoint, SIGKILLing itself at the n-th rename (os.replace) of the second save.
KILLED_WRITER = """
import os, signal, sys
import torch
from bridge_pl.checkpoint_io import AtomicCheckpointIO

path, kill_at = sys.argv[1], int(sys.argv[2])
io = AtomicCheckpointIO({"model.mode": "'bridge'"})
io.save_checkpoint({"state_dict": {"w": torch.full((256, 256), 1.0)}, "global_step": 1}, path)
replace, renames = os.replace, []

def replace_then_die(src, dst):
    renames.append(dst)
    if len(renames) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return replace(src, dst)

os.replace = replace_then_die
io.save_checkpoint({"state_dict": {"w": torch.full((256, 256), 2.0)}, "global_step": 2}, path)
"""


def zero_middle(path: Path) -> None:
    """Zero 4 KiB in the middle of the file, as a bad disk block would."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\0" * 4096)


@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_a_write_killed_at_any_rename_leaves_a_checkpoint_its_digest_accepts(tmp_path, kill_at):
    path = tmp_path / "last.ckpt"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path), str(kill_at)], env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, f"not killed at rename {kill_at}: {killed.stderr[-2000:]}"
    assert checkpoint_problem(path) is None
    assert torch.load(path, weights_only=True)["global_step"] in (1, 2)
    assert resolve_checkpoint("last", tmp_path) == (str(path), [])  # nothing skipped, nothing to warn about

    io = AtomicCheckpointIO({"model.mode": "'bridge'"})  # the next write clears the killed one's temp files
    io.save_checkpoint({"state_dict": {"w": torch.full((256, 256), 3.0)}, "global_step": 3}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.b2"]
    assert checkpoint_problem(path) is None and torch.load(path, weights_only=True)["global_step"] == 3
    assert len(digest_path(path).read_text().split()) == 1  # the previous file's digest is no longer accepted


def test_a_bridge_pl_checkpoint_without_its_digest_is_checked_by_its_crcs_and_named(tmp_path):
    io = AtomicCheckpointIO(RUN)
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(256, 256)}, "global_step": 1}, path)
    digest_path(path).unlink()
    assert resolve_checkpoint("last", tmp_path) == (str(path), [
        f"checkpoint {path} has no digest (last.ckpt.b2 is missing, though bridge-pl writes one with each "
        "checkpoint): checked by its archive's CRCs and structure instead"])

    zero_middle(path)  # zeroed tensor bytes: torch still reads the file, with zeros in the weights
    assert torch.load(path, weights_only=True)["state_dict"]["w"].eq(0).any()
    assert checkpoint_problem(path) == "damaged: its record archive/data/0 fails its zip CRC check (it has no digest " \
                                       "beside it)"


def test_a_checkpoint_written_by_another_tool_is_used_without_a_warning(tmp_path):
    path = tmp_path / "theirs.ckpt"
    torch.save({"state_dict": {"w": torch.ones(4)}, "global_step": 7}, path)
    assert resolve_checkpoint(str(path), tmp_path) == (str(path), [])


@pytest.mark.parametrize(("key", "value", "said"), [
    ("model.mode", "'frozen'", "model.mode is frozen here, bridge in the checkpoint"),
    ("model.policy.init_args.model", "'tiny-llama-hd32'",
     "model.policy.init_args.model is tiny-llama-hd32 here, tiny-llama in the checkpoint"),
    ("model.policy.init_args.lora_r", "8", "model.policy.init_args.lora_r is 8 here, 4 in the checkpoint"),
    ("model.retriever.init_args.corpus", "'medrag'", "model.retriever.init_args.corpus is medrag here, world in"),
    ("data.train", "'world/dev'", "data.train is world/dev here, world/train in the checkpoint"),
])
def test_a_resume_under_an_option_that_defines_the_run_is_refused_naming_it(tmp_path, key, value, said):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO(RUN).save_checkpoint({"state_dict": {}, "global_step": 1}, path)
    problem = config_problem(path, {**RUN, key: value})
    assert problem.startswith(f"checkpoint {path} does not fit this config: {said}") and "\n" not in problem


def test_a_resume_may_change_the_options_that_do_not_define_the_run(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO(RUN).save_checkpoint({"state_dict": {}, "global_step": 1}, path)
    assert config_problem(path, {**RUN, "model.policy_optimizer.init_args.lr": "5e-05",
                                 "model.rl.kl_coef": "0.0"}) is None
    older = tmp_path / "older.ckpt"  # written before data.train was stored: not compared
    AtomicCheckpointIO({k: v for k, v in RUN.items() if k != "data.train"}).save_checkpoint(
        {"state_dict": {}, "global_step": 1}, older)
    assert config_problem(older, {**RUN, "data.train": "'world/dev'"}) is None
