"""One tiny fit at a fixed seed, pinned: what every rollout batch holds and what every step logs.

``bridge-pl fit`` on the tiny config, steered to search and to answer (so rewards vary, dynamic sampling refills,
the retriever gets LM credit), two iterations and a validation. ``plugins.RolloutLog`` records each batch a step
consumes, ``plugins.StepLog`` the losses and metrics. Both must equal the files under ``tests/data/pinned/``,
recorded on the code this test was written against: a change that moves code around must leave them as they are.
A change that means to alter what a run does rewrites them (``python tests/test_pinned_fit.py``) and says why.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import TINY, assert_same_log

from bridge_pl.cli import main

PINNED = Path(__file__).parent / "data" / "pinned"
QA = [{"id": f"q{i}", "question": f"Which city is number {i}?", "golden_answers": ["Lyon" if i % 3 else "Paris"]}
      for i in range(12)]
CHOICE = [{"id": f"c{i}", "question": f"Which city is number {i}?", "golden_answers": ["AB"[i % 2]],
           "options": {"A": "Paris", "B": "Rome", "C": "Lyon"}} for i in range(4)]


def pinned_fit(root: Path) -> None:
    """The pinned run, writing ``rollouts.jsonl`` and ``steps.jsonl`` under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    qa = root / "qa.jsonl"
    qa.write_text("\n".join(json.dumps(row) for row in QA) + "\n")
    choice = root / "choice.jsonl"
    choice.write_text("\n".join(json.dumps(row) for row in CHOICE) + "\n")
    main(["fit", "--config", TINY, f"--trainer.default_root_dir={root}", f"--data.train={qa}",
          f'--data.val={{"cities": "{qa}", "choice": "{choice}", "world_dev": "world/dev"}}',
          "--data.filter_groups=true", "--data.max_sampling_rounds=3", "--data.n_samples=3",
          "--trainer.callbacks+=plugins.SearchSteer", '--trainer.callbacks.answers=[" Paris", " Rome"]',
          "--trainer.callbacks+=plugins.RolloutLog", f"--trainer.callbacks.path={root / 'rollouts.jsonl'}",
          "--trainer.callbacks+=plugins.StepLog", f"--trainer.callbacks.path={root / 'steps.jsonl'}"])


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_tiny_fit_rolls_out_and_logs_what_it_was_pinned_to(tmp_path):
    pinned_fit(tmp_path)
    got, want = _rows(tmp_path / "rollouts.jsonl"), _rows(PINNED / "rollouts.jsonl")
    assert [(r["stage"], r["step"], r["dataset"]) for r in got] == [(r["stage"], r["step"], r["dataset"]) for r in want]
    for g, w in zip(got, want):
        floats = ("rewards", "search_logprob", "sampler_logprob_sum")
        assert {k: v for k, v in g.items() if k not in floats} == {k: v for k, v in w.items() if k not in floats}
        for key in floats:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (g["stage"], g["step"], key)
    assert_same_log(tmp_path, PINNED, "step")
    assert_same_log(tmp_path, PINNED, "val_step")
    assert any(r["sampling"].get("sampling_rounds", 1) > 1 for r in got)  # the pin covers refills
    assert any(r["credit_searches"] for r in got)  # LM-credit sequences
    assert any(c is not None for r in got for c in r["choices"])  # and multiple-choice reading


if __name__ == "__main__":  # rewrite the pinned files
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as folder:
        pinned_fit(Path(folder))
        for name in ("rollouts.jsonl", "steps.jsonl"):
            shutil.copy(Path(folder) / name, PINNED / name)
