"""benchmarks/iteration_bench.py end to end on the tiny config: one process per mode, floors, the JSON schema."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_iteration_bench_prints_phases_floors_and_ratios(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/iteration_bench.py"), "--config", str(ROOT / "tests/configs/tiny.yaml"),
         "--threads", "1", "--modes", "frozen", "bridge", "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| policy update" in proc.stdout and "frozen total / (generate floor + update floor)" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["floors"]) == {"generate_s", "update_s"} and result["floors"]["update_s"] > 0
    assert set(result["modes"]) == {"frozen", "bridge"}
    for mode in result["modes"].values():
        assert mode["time_s"] > 0 and mode["peak_mb"] >= 0
        assert {"rollout", "policy_update", "retriever_steps"} <= set(mode["phases"])
        assert mode["phases"]["policy_update"]["time_s"] > 0  # the steady-state adjustment gives θ a signal
