"""Two ranks started through ``bridge-pl fit`` (Lightning launches rank 1; gloo on the CPU): dynamic sampling's
refills give the ranks different prompts, and the run directory stays locked while the job runs.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import TINY, bridge_pl_process, finish, rank_one

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name == "nt", reason="gloo processes")]

ROUNDS = 3


def _calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_ranks_refill_from_disjoint_prompts_and_hold_the_run_lock(tmp_path):
    # the random tiny policy never answers right: no group has signal, so every iteration refills ROUNDS - 1 times
    log = tmp_path / "prompts"
    run = bridge_pl_process(
        "fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}", "--trainer.devices=2",
        "--trainer.strategy=ddp", "--data.filter_groups=true", f"--data.max_sampling_rounds={ROUNDS}",
        "--trainer.callbacks+=plugins.PromptLog", f"--trainer.callbacks.path={log}",
    )
    while not Path(f"{log}.rank1").is_file():
        assert run.poll() is None, finish(run)[1][-3000:]
        time.sleep(0.2)
    ranks = (run.pid, rank_one(run))
    for pid in ranks:  # paused, the job still holds its directory
        os.kill(pid, signal.SIGSTOP)
    try:
        status, output = finish(bridge_pl_process("fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}"))
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    assert status == 1 and "is in use by another bridge-pl run" in output, output[-3000:]
    status, output = finish(run)
    assert status == 0, output[-3000:]

    ranks = [_calls(Path(f"{log}.rank{r}")) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2 * ROUNDS  # max_steps 2
    for first, second_rank in zip(*ranks, strict=True):
        assert first["step"] == second_rank["step"]
        assert not set(first["ids"]) & set(second_rank["ids"]), first["step"]
