"""benchmarks/iteration_bench.py end to end on the tiny config: one process per mode, floors, the JSON schema."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process or subprocess fits: `make test-fast` leaves them out

ROOT = Path(__file__).resolve().parents[1]


def test_iteration_bench_prints_phases_floors_and_ratios(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/iteration_bench.py"), "--config", str(ROOT / "configs/smoke.yaml"),
         "--threads", "1", "--modes", "frozen", "bridge", "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| policy update" in proc.stdout and "frozen total / (generate floor + update floor)" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["floors"]) == {"generate_s", "update_s", "update_mfu"} and result["floors"]["update_s"] > 0
    mfu = result["floors"]["update_mfu"]
    assert mfu["flops"]["total"] > 0 and mfu["ratio"] > 0 and {"float32", "bfloat16"} == set(mfu["gemm"])
    assert "achieved / GEMM (float32)" in proc.stdout and "| coupling" in proc.stdout
    assert set(result["modes"]) == {"frozen", "bridge"}
    for mode in result["modes"].values():
        assert mode["time_s"] > 0 and mode["peak_mb"] >= 0
        assert {"rollout", "policy_update", "retriever_steps"} <= set(mode["phases"])
        assert mode["phases"]["policy_update"]["time_s"] > 0  # the steady-state adjustment gives θ a signal


def test_warm_child_runs_a_configs_warm_start_beside_its_checkpoint_callback(tmp_path):
    """The demo's config checkpoints (ValidatedCheckpoint); the warm child must not switch checkpointing off
    (Lightning refuses that beside a checkpoint callback) and must save the warm-started adapter."""
    config = tmp_path / "warm.yaml"
    tiny = (ROOT / "configs/smoke.yaml").read_text().replace("enable_checkpointing: false", "callbacks:\n"
        "    - class_path: callbacks.WarmStart\n      init_args: {steps: 1, batch_size: 2}\n"
        "    - class_path: callbacks.ValidatedCheckpoint\n      init_args: {every_n_train_steps: 1, save_last: true}")
    config.write_text(tiny)
    adapter = tmp_path / "warm" / "adapter"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/iteration_bench.py"), "--config", str(config), "--threads", "1",
         "--child", "warm", "--warm-out", str(adapter), "--child-out", str(tmp_path / "warm.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "warm.json").read_text())["adapter"] == str(adapter)
    assert (adapter / "adapter_config.json").is_file()
