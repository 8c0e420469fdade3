"""Shared helpers for the end-to-end tests: build and run the real CLI on the tiny config."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from bridge_pl.cli import BridgeCLI

TESTS = Path(__file__).parent
CONFIGS = TESTS / "configs"
TINY = str(TESTS.parent / "configs" / "smoke.yaml")  # the smoke run users are given
STEER = 50.0


def load_script(folder: str, name: str):
    """The script ``<folder>/<name>.py`` (``benchmarks`` or ``experiments``, which are not packages) as a module."""
    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_cli(tmp_path: Path, *overrides: str, configs: tuple[str, ...] = (TINY,)) -> BridgeCLI:
    """Instantiate (not run) the CLI on the tiny config, writing under ``tmp_path``."""
    args = []
    for config in configs:
        args += ["--config", config]
    args += [f"--trainer.default_root_dir={tmp_path}", *overrides]
    return BridgeCLI(args=args, run=False)


def tiny_module(tmp_path: Path, *overrides: str):
    """``(module, datamodule)`` of the tiny config, set up for ``fit`` and wired together without a ``Trainer.fit``:
    what a test needs to call ``datamodule.rollout(module, ...)`` and build ``module.problem(batch)``."""
    cli = tiny_cli(tmp_path, *overrides)
    module, data = cli.model, cli.datamodule
    data.trainer = cli.trainer
    module.setup("fit")
    return module, data


@contextlib.contextmanager
def bigram_bias(model, table: dict[int, dict[int, float]], generation_only: bool = True):
    """While active, logits after input token ``src`` get ``+table[src][dst]`` on each token ``dst``.

    Only ``model``'s own forward is biased, and only inside rollout generation: the hook fails the test if it
    fires anywhere else (a loss forward, which must score the policy's real distribution, or any forward with
    gradients on). ``generation_only=False`` lifts that, for an engine test that recomputes a biased greedy
    decode with a plain full-prefix forward. ``table`` may be mutated in place while active.
    """

    def hook(module, args, kwargs, output):
        assert not generation_only or (not torch.is_grad_enabled() and _inside_rollout_engine()), (
            "bigram_bias fired outside HFRolloutEngine generation: a loss forward would see steered logits"
        )
        inputs = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        logits = output.logits
        inputs = inputs[:, -logits.shape[1]:]
        for src, dsts in table.items():
            rows, cols = (inputs == src).nonzero(as_tuple=True)
            for dst, bias in dsts.items():
                logits[rows, cols, dst] += bias
        return output

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield table
    finally:
        handle.remove()


def _inside_rollout_engine() -> bool:
    """Whether the current call stack runs through bridge_pl/rollout/engine.py."""
    frame = sys._getframe(1)
    while frame is not None:
        if Path(frame.f_code.co_filename).parts[-2:] == ("rollout", "engine.py"):
            return True
        frame = frame.f_back
    return False


def searching(policy, answers: tuple[str, ...] = ()):
    """Make the random tiny policy issue searches: bias its next-token logits during generation.

    After a newline (the end of the prompt, or of an observation) it writes ``<search> alpha|beta</search>``;
    the query word is sampled. With ``answers`` (single-token words with a leading space, e.g. ``" Paris"``),
    after an observation it answers instead: `` <answer>, W </answer>`` with W sampled from ``answers``, so the
    real exact-match reward varies within a group. Only the generation forward is biased (``Policy.forward``,
    used for the losses, is untouched), so every loss term sees real searches, retrievals and LM-credit
    sequences.
    """
    tok = policy.tokenizer

    def token(text):
        (only,) = tok(text, add_special_tokens=False)["input_ids"]
        return only

    lt, search, gt, close, alpha, beta = (token(s) for s in ["<", "search", ">", "</", " alpha", " beta"])
    table = {token("\n"): {lt: STEER}, token("\n\n"): {lt: STEER}, lt: {search: STEER}, search: {gt: STEER},
             gt: {alpha: STEER, beta: STEER}, alpha: {close: STEER}, beta: {close: STEER}, close: {search: STEER}}
    if answers:
        sp_lt, answer, gt_comma, sp_close, ans, wer = (
            token(s) for s in [" <", "answer", ">,", " </", "ans", "wer"]
        )
        words = [token(w) for w in answers]
        table |= {token("\n\n"): {sp_lt: STEER}, sp_lt: {answer: STEER}, answer: {gt_comma: STEER},
                  gt_comma: dict.fromkeys(words, STEER), sp_close: {ans: STEER}, ans: {wer: STEER},
                  wer: {gt: STEER}} | {w: {sp_close: STEER} for w in words}
    return bigram_bias(policy.hf_model, table)


def fit_tiny(tmp_path: Path, *overrides: str, callbacks: tuple[L.Callback, ...] = (), ckpt_path: str | None = None,
             configs: tuple[str, ...] = (TINY,), search: bool = True) -> BridgeCLI:
    """Instantiate the tiny CLI, add ``callbacks``, and fit (with the policy steered to search)."""
    cli = tiny_cli(tmp_path, *overrides, configs=configs)
    cli.trainer.callbacks.extend(callbacks)
    with searching(cli.model.policy) if search else contextlib.nullcontext():
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return cli


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """d``loss``/d``params``, flattened and concatenated into one vector."""
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def policy_loss_logprob_grads(policy, problem) -> torch.Tensor:
    """``[B, T]``: d(``problem.policy_loss()``)/d(log-prob) of every cell of the problem's batch, in batch order.

    Backpropagates the loss with the log-probs of each of the problem's micro-batches retained, then puts each
    micro-batch's rows back in their batch places (micro-batches group rows by length, not in batch order).
    """
    parts = []
    forward = policy.forward

    def capture(*args, **kwargs):
        out = forward(*args, **kwargs)
        if out[0].requires_grad:
            out[0].retain_grad()
            parts.append(out[0])
        return out

    policy.forward = capture
    try:
        problem.policy_loss().backward()
    finally:
        del policy.forward  # the class's method again
    grad = torch.zeros_like(problem.mask)
    with_tokens = [rows for rows in problem._row_groups if problem._part_weight(rows) > 0]  # the others run no forward
    for rows, logp in zip(with_tokens, parts, strict=True):
        grad[rows, : logp.shape[1]] = logp.grad
    return grad


def bridge_pl_process(*args: str) -> subprocess.Popen:
    """``bridge-pl ARGS`` started as a user starts it, in a subprocess that finds the test plug-ins (one thread
    per process); its stdout and stderr come together."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "bridge_pl.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(run: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    """Wait for ``run``: its exit status and output."""
    output, _ = run.communicate(timeout=timeout)
    return run.returncode, output


def rank_one(run: subprocess.Popen) -> int:
    """The pid of rank 1: the process Lightning started from rank 0."""
    children = Path(f"/proc/{run.pid}/task/{run.pid}/children")
    while run.poll() is None:  # rank 0 starts it once its models are loaded
        if pids := [int(p) for p in children.read_text().split()]:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"rank 0 ended before it started rank 1: {finish(run)[1][-3000:]}")


def step_log(root: Path, key: str) -> dict[int, dict]:
    """The last metrics ``plugins.StepLog`` logged at each step in ``root/steps.jsonl`` (``key="step"``: an
    iteration's losses; ``"val_step"``: a validation's metrics); an iteration or validation redone after a crash is
    logged twice."""
    rows = [json.loads(line) for line in (root / "steps.jsonl").read_text().splitlines()]
    return {row.pop(key): row for row in rows if key in row}


def assert_same_log(root: Path, reference: Path, key: str) -> list[int]:
    """``root``'s :func:`step_log` has the steps, metric names and values (nan where nan) of ``reference``'s;
    returns the steps."""
    got, want = step_log(root, key), step_log(reference, key)
    assert sorted(got) == sorted(want), key
    for step, metrics in want.items():
        assert got[step].keys() == metrics.keys()
        assert [got[step][k] for k in metrics] == pytest.approx(list(metrics.values()), rel=1e-4, abs=1e-6,
                                                                nan_ok=True)  # nan: no θ step
    return sorted(want)
