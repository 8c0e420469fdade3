"""Progress without a terminal: ``bridge-pl fit`` with its stdout a pipe prints plain lines, one per warm-start step,
training iteration and evaluation, instead of drawing a bar."""

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import TINY

ROOT = Path(__file__).resolve().parents[1]


def test_a_fit_into_a_pipe_prints_one_line_per_step_iteration_and_evaluation(tmp_path):
    command = [sys.executable, "-m", "bridge_pl.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
               "--trainer.enable_progress_bar=true", "--trainer.callbacks+=callbacks.progress.BridgeProgressBar",
               "--trainer.callbacks+=callbacks.warm_start.WarmStart", "--trainer.callbacks.steps=2",
               "--trainer.callbacks.batch_size=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    number, seconds = r"\d\.\d{3}", r"\d+\.\d s"
    warm = [line for line in lines if line.startswith("WarmStart: step")]
    assert [line.split(",")[0] for line in warm] == ["WarmStart: step 1/2", "WarmStart: step 2/2"]
    assert re.fullmatch(rf"WarmStart: step 1/2, loss \d+\.\d{{3}}, {seconds}", warm[0])
    iterations = [line for line in lines if line.startswith("iteration ")]
    assert len(iterations) == 2
    for done, line in enumerate(iterations, 1):
        assert re.fullmatch(rf"iteration {done}/2: reward {number}, groups with signal {number}, {seconds}", line)
    evaluations = [line for line in lines if line.startswith("validation ")]
    assert len(evaluations) == 1
    assert re.fullmatch(rf"validation after iteration 2: world_dev EM {number}, {seconds}", evaluations[0])
    assert lines.index(warm[-1]) < lines.index(iterations[0]) < lines.index(iterations[1]) < lines.index(evaluations[0])
    assert "\r" not in run.stdout + run.stderr  # no bar redrawn in place, neither Lightning's nor the warm start's


def test_encoding_a_corpus_without_a_terminal_prints_a_plain_line(tmp_path, capsys):
    """The retriever's corpus encoding follows the same rule: no bar when stdout is not a terminal, plain lines on
    stdout (every 10 s, and one when the corpus is done)."""
    from bridge_pl.records import Passage
    from bridge_pl.retrieval.dense import DenseRetriever

    passages = [Passage(str(i), f"title {i}", f"passage number {i} of the corpus") for i in range(50)]
    retriever = DenseRetriever(corpus=passages, encoder="tiny-bert", cache_dir=str(tmp_path), batch_size=8)
    capsys.readouterr()
    retriever.prepare()
    out, err = capsys.readouterr()
    assert retriever.encoded_passages == 50
    (line,) = [line for line in out.splitlines() if line.startswith("encode passages")]
    assert re.fullmatch(r"encode passages: 50/50 psg \(100\.0%\), [\d,]+\.\d psg/s, ETA 00:00:00", line)
    assert "\r" not in out + err and "encode passages" not in err  # no bar drawn, on either stream
