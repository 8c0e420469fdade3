"""``data.engine=vllm`` on 2 CPU processes (gloo) under ``fsdp2`` and ``ddp``: each rank's own vLLM engine samples
the updated policy. Apart from tests/test_fsdp2.py (whose configs it shares) so that the two files, each long, run
on different test processes.

Each 2-process fit runs in its own subprocess (Lightning re-launches it as rank 1): the three fits one after the
other in one pair of processes hung in the second (rank 1 had exited), so they are not shared.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from helpers import fit_tiny
from test_fsdp2 import COMMON

pytestmark = pytest.mark.slow  # multi-process or subprocess fits: `make test-fast` leaves them out

ENGINES = [("fsdp2", "merged"), ("fsdp2", "adapter"), ("ddp", "merged")]  # (strategy, weight sync)
STRATEGIES = {"fsdp2": "fsdp2", "ddp": "ddp_find_unused_parameters_true"}


class RecordEngine(L.Callback):
    """Each rank saves its engine's name and pushes, the sampler's log-prob gap of each iteration and its
    validation metrics, at the end of the fit (before the engine is freed)."""

    def __init__(self, out: Path) -> None:
        self.out, self.gaps = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.gaps.append(float(trainer.callback_metrics["rollout/sampler_logprob_gap"]))

    def on_train_end(self, trainer, pl_module):
        engine = trainer.datamodule.collector.engine
        val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        record = {"engine": engine.name, "syncs": engine.syncs, "gaps": self.gaps, "val": val}
        (self.out / f"engine{trainer.global_rank}.json").write_text(json.dumps(record))


def _run_2proc(out: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
@pytest.mark.parametrize("strategy, sync", ENGINES)
def test_each_rank_gets_a_vllm_engine_that_samples_the_updated_policy(tmp_path, strategy, sync):
    """``data.engine=vllm`` on 2 processes: each rank builds its own engine and, after each update, pushes the
    policy into it (under fsdp2 gathered from the shards; ``merged``: the LoRA deltas merged into the base weights,
    ``adapter``: the adapter saved to the rank's own folder). The sampler's log-probs match the trainer's own
    forward in the iteration after an update (an engine left with the old weights is off by 0.14-0.17 nats at this
    policy lr), and a validation with unequal numbers of batches per rank needs no collective."""
    _run_2proc(tmp_path, f"{strategy}-{sync}")
    folder = tmp_path / f"{strategy}-{sync}"
    ranks = [json.loads((folder / f"engine{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["engine"] == "vllm"
        assert rank["syncs"] == 3  # built for iteration 1, pushed for the validations after updates 1 and 2
        assert len(rank["gaps"]) == 2 and max(rank["gaps"]) < 1e-3  # float32 in both
    assert ranks[0]["val"] == ranks[1]["val"] and "val/world_dev/em" in ranks[0]["val"]


def main(out: Path, runs: list[str]) -> None:
    """2-process fits, each ``STRATEGY-SYNC`` (this script is re-launched as rank 1 by Lightning); one at a time
    (see above)."""
    import torch

    torch.set_num_threads(1)
    for run in runs:
        strategy, sync = run.split("-")
        folder = out / run
        folder.mkdir(parents=True, exist_ok=True)
        # 12 dev questions in batches of 4: rank 0 evaluates two batches, rank 1 one
        fit_tiny(folder, "--trainer.devices=2", f"--trainer.strategy={STRATEGIES[strategy]}", *COMMON,
                 "--model.mode=bridge", f"--data.vllm.weight_sync={sync}", "--trainer.max_steps=2",
                 "--trainer.val_check_interval=1", "--trainer.limit_val_batches=null", "--data.max_eval_examples=12",
                 "--model.policy.init_args.model=tiny-llama-hd32", "--data.engine=vllm", "--data.vllm.kv_cache_gb=1",
                 "--data.vllm.max_model_len=1024", "--model.policy_optimizer=torch.optim.AdamW",
                 "--model.policy_optimizer.init_args.lr=0.05",
                 callbacks=(RecordEngine(folder),), search=False)  # vLLM samples from its own weights


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
