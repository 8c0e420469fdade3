"""benchmarks/compare_modes.py end to end on the tiny config: one warm start per seed, table, plot, resume."""

import importlib.util
import json
from pathlib import Path

from helpers import TINY

ROOT = Path(__file__).resolve().parents[1]


def _compare_modes():
    spec = importlib.util.spec_from_file_location("compare_modes", ROOT / "benchmarks/compare_modes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_modes_shares_the_warm_start_and_writes_table_and_plot(tmp_path, capsys):
    argv = ["--config", TINY, "--modes", "frozen", "bridge", "--seeds", "0", "--max-steps", "1",
            "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"),
            "--data.test={world_test: world/test}", "--trainer.val_check_interval=1",
            "--trainer.callbacks+=callbacks.WarmStart", "--trainer.callbacks.steps=2",
            "--trainer.callbacks.batch_size=2", "--trainer.callbacks.evaluate=false"]
    compare_modes = _compare_modes()
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
    capsys.readouterr()
    compare_modes.main(argv)  # every result is there: nothing is rerun, the table is rewritten
    assert "compare_modes: " not in capsys.readouterr().out
