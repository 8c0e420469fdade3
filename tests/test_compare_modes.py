"""benchmarks/compare_modes.py end to end on the tiny config (one warm start per seed, table, plot, resume) and its
statistics against hand-computed numbers."""

import json
import math
from pathlib import Path

from helpers import TINY, load_benchmark


def test_compare_modes_shares_the_warm_start_and_writes_table_and_plot(tmp_path, capsys):
    argv = ["--config", TINY, "--modes", "frozen", "bridge", "--seeds", "0", "--max-steps", "1",
            "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"),
            "--data.test={world_test: world/test}", "--trainer.val_check_interval=1",
            "--trainer.callbacks+=callbacks.WarmStart", "--trainer.callbacks.steps=2",
            "--trainer.callbacks.batch_size=2", "--trainer.callbacks.evaluate=false"]
    compare_modes = load_benchmark("compare_modes")
    compare_modes.main(argv)
    table = (tmp_path / "out/compare_modes.md").read_text()
    assert "| frozen |" in table and "| bridge |" in table and "--max-steps 1" in table
    assert (tmp_path / "out/compare_modes_dev_em.png").stat().st_size > 0
    warm = json.loads((tmp_path / "runs/warm_seed0/result.json").read_text())
    assert (Path(warm["adapter"]) / "adapter_config.json").is_file()
    for variant in ("frozen", "bridge"):
        result = json.loads((tmp_path / f"runs/{variant}_seed0/result.json").read_text())
        assert result["dev_curve"][0] == [0, warm["dev_em"]] and [s for s, _ in result["dev_curve"]] == [0, 1]
        assert 0.0 <= result["EM"] <= 1.0 and result["peak_rss_mb"] > 0
        assert 0.0 <= result["hop recall@k"] <= 1.0
    assert 0.0 <= warm["EM"] <= 1.0 and 0.0 <= warm["hop recall@k"] <= 1.0  # the warm start's own test row
    assert "| warm start | 1 |" in table and "| bridge > frozen |" in table and "not tested" in table
    capsys.readouterr()
    compare_modes.main(argv)  # every result is there: nothing is rerun, the table is rewritten
    assert "compare_modes: " not in capsys.readouterr().out


def test_table_only_reports_the_finished_runs_and_names_the_missing(tmp_path):
    compare_modes = load_benchmark("compare_modes")
    runs = tmp_path / "runs"
    record = {"variant": "frozen", "seed": 0, "fit_s": 10.0, "dev_curve": [[0, 0.2], [4, 0.3]], "peak_rss_mb": 900.0,
              "EM": 0.25, "F1": 0.3, "retrieval-miss share": 0.5, "recall@k": 0.4, "hop recall@k": 0.6}
    (runs / "frozen_seed0").mkdir(parents=True)
    (runs / "frozen_seed0/result.json").write_text(json.dumps(record))
    compare_modes.main(["--modes", "frozen", "bridge", "--seeds", "0", "1", "--table-only",
                        "--runs", str(runs), "--out", str(tmp_path / "out")])
    table = (tmp_path / "out/compare_modes.md").read_text()
    assert "not yet run: frozen seed 1, bridge seed 0, bridge seed 1" in table
    assert "| frozen | 1 | 0.250 | 0.300 |" in table and "0.200 → 0.300" in table
    assert "--table-only" not in table  # the command shown is the one that makes the runs


def test_paired_difference_and_verdict_by_hand():
    compare_modes = load_benchmark("compare_modes")
    # differences 0.1, 0.3, 0.2 (seed 3 only in a: unpaired): mean 0.2, sample std 0.1, SE 0.1 / √3
    mean, se, n = compare_modes.paired_difference({0: 0.5, 1: 0.6, 2: 0.4, 3: 0.9}, {0: 0.4, 1: 0.3, 2: 0.2})
    assert (n, round(mean, 12), round(se, 12)) == (3, 0.2, round(0.1 / math.sqrt(3), 12))
    # 95 % t-interval with 2 degrees of freedom: 0.2 ± 4.303 × 0.0577 = 0.2 ± 0.248 contains 0
    assert compare_modes.verdict(mean, se, n) == "within noise"
    assert compare_modes.verdict(0.3, 0.05, 3) == "reproduced"  # 0.3 - 4.303 × 0.05 = 0.085 > 0
    assert compare_modes.verdict(-0.3, 0.05, 3) == "refuted"
    assert compare_modes.verdict(0.3, math.nan, 1).startswith("not tested")
    assert compare_modes.verdict(0.027, 0.0, 2).startswith("not tested")  # two equal differences: SE 0
    assert compare_modes.paired_difference({0: 0.1}, {1: 0.2})[2] == 0
