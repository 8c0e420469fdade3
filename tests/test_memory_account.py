"""callbacks.MemoryAccount in a real fit of the smoke config, and the PhaseLedger it keeps (bridge_pl.memory)."""

import csv
import json
from pathlib import Path

import pytest
from helpers import TINY

from bridge_pl.cli import main
from bridge_pl.memory import PhaseLedger, heap, peak_rss, rss
from callbacks.memory import PHASES

linux = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")


@linux
def test_ledger_charges_nested_phases_and_drops_a_discarded_one():
    ledger = PhaseLedger("setup")
    ledger.switch("other", step=0)
    ledger.enter("rollout", step=0)
    ledger.enter("engine_build", step=0)
    built = ledger.leave({"rows": 1})
    ledger.enter("landscape")
    assert ledger.leave(keep=False) is None  # nothing worth a phase: its time goes to rollout
    rollout = ledger.leave()
    records = ledger.finish()
    assert [r.phase for r in records] == ["setup", "engine_build", "rollout", "other"]
    # the peak is never below where the phase began (how far it rises depends on what the allocator kept free)
    assert built.info == {"rows": 1} and built.peak >= built.rss_start
    assert rollout.index == 0 and all(r.phase != "landscape" for r in records)
    assert all(r.peak > 0 and r.rss_end > 0 and r.seconds >= 0 for r in records)
    assert ledger.finished and rss() > 0 and peak_rss() > 0
    info = heap()
    assert info is None or info["in_use"] > 0


@linux
def test_memory_account_reports_every_phase_of_a_fit(tmp_path):
    path = tmp_path / "memory.jsonl"
    main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
          "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
          "--trainer.enable_checkpointing=true",
          "--trainer.callbacks+=callbacks.WarmStart", "--trainer.callbacks.steps=1", "--trainer.callbacks.batch_size=2",
          "--trainer.callbacks.evaluate_before=false",
          "--trainer.callbacks+=callbacks.LossLandscape", "--trainer.callbacks.every_n_steps=2",
          "--trainer.callbacks.targets=[retriever]", "--trainer.callbacks.slice_points=3",
          "--trainer.callbacks.grid_points=2", "--trainer.callbacks.power_iters=1", "--trainer.callbacks.pl_steps=1",
          "--trainer.callbacks+=callbacks.ValidatedCheckpoint", "--trainer.callbacks.every_n_train_steps=2",
          "--trainer.callbacks+=callbacks.MemoryAccount", f"--trainer.callbacks.path={path}",
          "--trainer.callbacks+=callbacks.ReleaseHeap"])  # a user's fit with the trimming callback on
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    records, sizes = lines[:-1], lines[-1]["sizes"]
    assert {r["phase"] for r in records} == set(PHASES)
    for record in records:
        assert record["peak"] > 0 and record["rss_start"] > 0 and record["rss_end"] > 0, record
        assert record["seconds"] >= 0 and (record["in_use"] is None or record["in_use"] > 0), record
    by_phase = {p: [r for r in records if r["phase"] == p] for p in PHASES}
    assert len(by_phase["setup"]) == len(by_phase["warm_start"]) == len(by_phase["engine_build"]) == 1
    assert len(by_phase["rollout"]) == len(by_phase["update"]) == 2  # max_steps: 2
    assert by_phase["rollout"][0]["info"]["rows"] > 0 and by_phase["evaluation"][0]["info"]["tokens"] > 0
    assert len(by_phase["landscape"]) == 2  # step 0's probe and the one at the end (at_fit_end); none at step 1
    assert sizes["parts"]["policy"]["params"] > sizes["parts"]["policy"]["trainable_params"] > 0
    assert sizes["policy_config"]["num_hidden_layers"] > 0 and sizes["corpus"]["passages"] > 0
    assert sizes["data"]["engine_built"] == "hf"
    table = path.with_suffix(".md").read_text()
    assert all(f"| {phase} |" in table for phase in PHASES)
    (metrics,) = tmp_path.rglob("metrics.csv")
    columns = next(csv.reader(metrics.open()))
    assert {f"memory/{phase}/peak_gib" for phase in PHASES} <= set(columns)
