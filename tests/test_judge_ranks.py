"""The reasoning-quality judge with several ranks: each rank judges a share of the set, and the ranks wait for each
other on the process group's store, so a judge slower than the process group's timeout cannot kill the validation.

Two gloo processes whose process group times out after a few seconds: the store wait outlasts it where a barrier
fails; and a 2-process ``bridge-pl validate`` whose judge sleeps past the timeout on rank 0 ends with the judged
numbers, predictions and cache of one process.
"""

import json
import os
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TINY, bridge_pl_process, finish, tiny_cli
from plugins import SlowJudge
from test_judge import _record
from test_metrics import _free_port

import callbacks.qa_eval
from bridge_pl.distributed import join_at_rank_zero, share_from_rank_zero, wait_for_ranks
from bridge_pl.judge import JudgeCache
from callbacks.qa_eval import QAEval

TIMEOUT_S, SLOW_S = 2, 5  # the process group's timeout; how much later rank 1 arrives


def _wait_worker(rank: int, port: int, out: str) -> None:
    """Rank 1 arrives ``SLOW_S`` seconds late at a store wait, then at a barrier."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.barrier()  # both up (the rendezvous keeps the default timeout: the two start apart)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S))
    result = {"share": share_from_rank_zero(list(range(5)) if rank == 0 else None)}
    result["joined"] = join_at_rank_zero([f"r{rank}:{i}" for i in result["share"]])
    if rank == 1:
        time.sleep(SLOW_S)
    start = time.monotonic()
    wait_for_ranks("test")
    result["waited_s"] = time.monotonic() - start
    result["after"] = share_from_rank_zero(["a", "b"] if rank == 0 else None)  # the group still works
    if rank == 1:
        time.sleep(SLOW_S)
    try:  # the same wait in a collective fails: the scenario is real
        dist.barrier()
    except RuntimeError as err:
        result["barrier"] = str(err)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_a_store_wait_outlasts_the_process_group_timeout_where_a_barrier_fails(tmp_path):
    mp.spawn(_wait_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["share"] == [0, 2, 4] and ranks[1]["share"] == [1, 3]
    assert ranks[0]["joined"] == ["r0:0", "r1:1", "r0:2", "r1:3", "r0:4"] and ranks[1]["joined"] is None
    assert ranks[0]["waited_s"] > TIMEOUT_S + 1
    assert ranks[0]["after"] == ["a"] and ranks[1]["after"] == ["b"]
    assert "Timed out" in ranks[0]["barrier"]


def test_a_long_judgement_prints_progress_lines_without_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(callbacks.qa_eval, "JUDGE_PROGRESS_EVERY_S", 0.0)
    records = [_record(question=f"q{i}") for i in range(70)]
    metrics = QAEval(judge=SlowJudge()).judge_set(records, "val/x", types.SimpleNamespace(default_root_dir=tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("QAEval judge:")]
    assert [line.split(" (")[0] for line in lines] == ["QAEval judge: val/x: asked 64 of 70",
                                                       "QAEval judge: val/x: asked 70 of 70"]
    assert metrics["val/x/judge_failed"] == 0 and 1 <= metrics["val/x/reasoning_quality"] <= 5


@pytest.mark.slow
@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_two_ranks_survive_a_judge_slower_than_the_process_group_timeout(tmp_path):
    """Rank 0's judge sleeps 6 s per call, collectives time out after 3 s: rank 1 judges its share and waits on the
    store. The run logs the one-process numbers, rank 0 writes the one-process predictions, each rank cached its
    share."""
    root, steps = tmp_path / "two", tmp_path / "steps.jsonl"
    config = tmp_path / "slow_judge.yaml"
    config.write_text(
        "trainer:\n  devices: 2\n  strategy: {class_path: plugins.ShortTimeoutDDP, init_args: {seconds: 3}}\n"
        "  callbacks:\n    - class_path: callbacks.QAEval\n      init_args:\n        num_trajectories: 0\n"
        "        judge: {class_path: plugins.SlowJudge, init_args: {seconds: 6, slow_rank: 0}}\n"
        f"    - {{class_path: plugins.StepLog, init_args: {{path: '{steps}'}}}}\n"
    )
    status, output = finish(bridge_pl_process("validate", "--config", TINY, "--config", str(config),
                                              f"--trainer.default_root_dir={root}"))
    assert status == 0, output[-3000:]
    logged = [json.loads(line) for line in steps.read_text().splitlines()]  # broadcast: one line or one per rank

    qa = QAEval(num_trajectories=0, judge=SlowJudge())
    single = tiny_cli(tmp_path / "one")
    single.trainer.callbacks.append(qa)
    single.trainer.validate(single.model, single.datamodule)
    one = {k: float(v) for k, v in single.trainer.callback_metrics.items() if k.startswith("val/")}
    assert {"val/world_dev/reasoning_quality", "val/world_dev/judge_failed"} <= set(one)
    assert logged and all(row == pytest.approx({"val_step": 0, **one}) for row in logged)
    assert (root / "predictions" / "val_world_dev_step0.jsonl").read_text() == qa.written[0].read_text()
    assert (root / "judge_cache.rank1.jsonl").is_file()
    assert len(JudgeCache(root / "judge_cache.jsonl").entries) == 4  # a rerun finds every rank's replies
