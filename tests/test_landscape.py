"""Loss-landscape probes: exact answers on quadratics, exact restore, the callback on the real module, DDP.

Run as a script (``python tests/test_landscape.py OUT_DIR STRATEGY...``) it is the 2-process job, one fit per
strategy, that ``test_two_processes_agree_with_one_process`` reads.
"""

import json
import math
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import searching, tiny_cli, tiny_module
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bridge_pl import loss_surface
from bridge_pl.batch_losses import BatchLosses
from bridge_pl.config import RetrievalSampling
from bridge_pl.policy import Policy
from callbacks.landscape import LossLandscape

# zero_row_norm > 0: LoRA B is all zero at init, so Li et al.'s rule alone would leave the policy slice flat
PROBE = dict(every_n_steps=1, slice_points=5, grid_points=3, power_iters=4, pl_steps=3, probe_queries=2,
             zero_row_norm=0.05)


def quadratic(eigenvalues: list[float], seed: int = 0):
    """L(x) = ½ xᵀHx − bᵀx, x = (W [2, 3] flattened, bias [2]), H = U diag(eigenvalues) Uᵀ, float64."""
    g = torch.Generator().manual_seed(seed)
    n = len(eigenvalues)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    hessian = u @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ u.T
    b = torch.randn(n, generator=g, dtype=torch.float64)
    weight = torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.randn(n - 6, generator=g, dtype=torch.float64).requires_grad_()
    params = [weight, bias]

    def loss() -> torch.Tensor:
        x = torch.cat([p.reshape(-1) for p in params])
        return 0.5 * x @ hessian @ x - b @ x

    return loss, params, hessian, b


def test_filter_normalized_direction():
    w = torch.randn(4, 3)
    w[2] = 0.0  # an all-zero row, like LoRA B at init
    params = [w, torch.randn(3), torch.randn(2, 2, 2)]
    d = loss_surface.filter_normalized_direction(params, torch.Generator().manual_seed(1))
    assert torch.allclose(d[0].norm(dim=1)[[0, 1, 3]], w.norm(dim=1)[[0, 1, 3]])
    assert torch.equal(d[0][2], torch.zeros(3)) and torch.equal(d[1], torch.zeros(3))  # zero row, 1-D param
    assert torch.allclose(d[2].reshape(2, -1).norm(dim=1), params[2].reshape(2, -1).norm(dim=1))
    again = loss_surface.filter_normalized_direction(params, torch.Generator().manual_seed(1), zero_row_norm=0.5)
    assert torch.equal(again[0][[0, 1, 3]], d[0][[0, 1, 3]]) and math.isclose(float(again[0][2].norm()), 0.5)


def test_slices_match_the_closed_form_and_restore_exactly():
    loss, params, hessian, b = quadratic([6.0, 3.0, 1.0, 0.5, 0.2, 0.1, 0.05, 0.01])
    before = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(0)
    delta = loss_surface.filter_normalized_direction(params, g)
    eta = loss_surface.filter_normalized_direction(params, g)
    alphas = torch.linspace(-1, 1, 5, dtype=torch.float64)
    x0 = torch.cat([p.detach().reshape(-1) for p in params])
    dx, dy = (torch.cat([t.reshape(-1) for t in d]) for d in (delta, eta))

    def exact(a: float, c: float) -> float:
        x = x0 + a * dx + c * dy
        return float(0.5 * x @ hessian @ x - b @ x)

    grid = loss_surface.grid_2d(loss, params, (delta, eta), alphas, alphas[:3])
    assert grid.shape == (5, 3)
    expected = [exact(a, c) for a in alphas.tolist() for c in alphas[:3].tolist()]
    assert grid.reshape(-1).tolist() == pytest.approx(expected)
    curve = loss_surface.slice_1d(loss, params, delta, alphas)
    assert curve.tolist() == pytest.approx([exact(a, 0.0) for a in alphas.tolist()])
    assert all(torch.equal(p, q) for p, q in zip(params, before))

    def failing() -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        loss_surface.slice_1d(failing, params, delta, alphas)
    assert all(torch.equal(p, q) for p, q in zip(params, before))  # restored on error too


def test_sharpness_is_the_top_eigenvalue():
    loss, params, hessian, _ = quadratic([6.0, 3.0, 1.0, 0.5, 0.2, 0.1, 0.05, 0.01])
    before = [p.detach().clone() for p in params]
    top, history = loss_surface.top_hessian_eigenvalue(loss, params, torch.Generator().manual_seed(0), iters=60,
                                                    tol=1e-12)
    assert top == pytest.approx(6.0, rel=1e-6) and len(history) > 1
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    v = [torch.ones_like(p) for p in params]
    hv = torch.cat([t.reshape(-1) for t in loss_surface.finite_difference_hvp(loss, params, v, 1e-3)])
    assert torch.allclose(hv, hessian @ torch.ones(8, dtype=torch.float64))


def test_pl_constant_of_a_quadratic():
    eigenvalues = [4.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 8.0]
    loss, params, hessian, b = quadratic(eigenvalues)
    with torch.no_grad():  # move the minimiser to 0 so G* = 0 (b = 0), start off an eigenvector
        b.zero_()
    before = [p.detach().clone() for p in params]
    losses, grad_sq = loss_surface.descent_trace(loss, params, lr=0.1, steps=200)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert losses[0] > losses[-1] and len(losses) == len(grad_sq) == 201
    # ‖∇G‖² = xᵀH²x ≥ 2 λmin · ½ xᵀHx, tight once the slowest eigen-direction dominates
    mu = loss_surface.pl_estimate(losses, grad_sq, g_star=0.0)
    assert 1.0 - 1e-9 <= mu < 1.001
    assert loss_surface.pl_estimate(losses, grad_sq) >= mu  # min observed G ≥ G*: an overstatement
    # along an eigenvector the ratio is exactly its eigenvalue
    u = torch.linalg.eigh(hessian).eigenvectors[:, 2]
    with torch.no_grad():
        params[0].copy_(u[:6].reshape(2, 3))
        params[1].copy_(u[6:])
    losses, grad_sq = loss_surface.descent_trace(loss, params, lr=0.1, steps=5)
    assert loss_surface.pl_estimate(losses, grad_sq, g_star=0.0) == pytest.approx(3.0)


def test_pl_edge_cases():
    assert math.isnan(loss_surface.pl_estimate([], []))
    assert math.isnan(loss_surface.pl_estimate([1.0, 1.0], [0.5, 0.5]))  # no point above the floor
    assert loss_surface.pl_estimate([3.0, 2.0, 1.0], [8.0, 2.0, 0.0]) == pytest.approx(1.0)  # min(8/4, 2/2)
    with pytest.raises(ValueError, match="finite"):
        loss_surface.pl_estimate([1.0, float("nan")], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 losses but 1"):
        loss_surface.pl_estimate([1.0, 2.0], [1.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"every_n_steps": 0}, "every_n_steps"), ({"targets": ["critic"]}, "targets"),
     ({"teacher": "oracle"}, "teacher"), ({"span": 0.0}, "span"), ({"grid_points": 1}, "grid_points")],
)
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossLandscape(**kwargs)


def test_answer_teacher_marks_passages_holding_a_gold_answer():
    """ℓ = 1 where a gold occurs as whole words (``rewards.contains_answer``): "Parisian" does not hold "paris"."""
    texts = ["Paris is the capital of France.", "Parisian dogs bark.", "The capital is PARIS!"]
    retriever = types.SimpleNamespace(
        search=lambda queries, k: (torch.zeros(len(queries), k), torch.tensor([[0, 1, -1], [2, 1, 0]])),
        passage=lambda r: types.SimpleNamespace(contents=texts[r]),
    )
    module = types.SimpleNamespace(retriever=retriever, retrieval_config=RetrievalSampling(candidates=3))
    batch = types.SimpleNamespace(questions=["q1", "q1", "q2"], golds=[["paris"], ["paris"], ["the Paris"]])
    queries, _, teacher = LossLandscape(teacher="answer")._g_probe(module, batch)
    assert queries == ["q1", "q2"]
    assert teacher.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]]


def test_lm_teacher_is_the_solvers_teacher_of_the_batch(tmp_path):
    """By default G is probed on the batch's LM-credit searches with ℓ_θ as the solver computes it."""
    module, data = tiny_module(tmp_path, "--model.mode=bridge")
    with searching(module.policy):
        batch = data.rollout(module, data.load("world/train")[:2], training=True, dataset="train")
    assert batch.credit_searches.numel() > 0
    queries, rows, teacher = LossLandscape(probe_queries=3)._g_probe(module, batch)
    problem = module.problem(batch, keep_credit_graph=False)
    n = len(queries)
    assert queries == [batch.search_queries[i] for i in batch.credit_searches[:n].tolist()]
    assert torch.equal(rows, batch.search_candidates[batch.credit_searches[:n]])
    assert torch.allclose(teacher, problem.lm_scores[:n], atol=1e-6)


@pytest.mark.parametrize("target", ["policy", "retriever"])
def test_a_probe_builds_only_what_its_target_uses(tmp_path, monkeypatch, target):
    """F's probe data costs a policy pass over the whole batch (π_old), G's a branch pass over the credit searches:
    a probe of one target runs neither pass of the other."""
    module, data = tiny_module(tmp_path, "--model.mode=bridge")
    with searching(module.policy):
        batch = data.rollout(module, data.load("world/train")[:2], training=True, dataset="train")
    assert batch.credit_searches.numel() > 0
    calls = {"old_logprobs": 0, "branch_loglik": 0}
    for owner, name in [(BatchLosses, "old_logprobs"), (Policy, "branch_loglik")]:
        original = getattr(owner, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    probe = LossLandscape(targets=[target])._build_probe(module, batch)
    assert (probe.policy is not None, probe.retriever is not None) == (target == "policy", target == "retriever")
    assert calls == {"old_logprobs": int(target == "policy"), "branch_loglik": int(target == "retriever")}


class CheckedLandscape(LossLandscape):
    """Asserts that each probe leaves parameters, buffers, train/eval flags and the global RNGs unchanged."""

    def run(self, trainer, pl_module):
        state = {k: v.clone() for k, v in pl_module.state_dict().items() if isinstance(v, torch.Tensor)}  # not the
        # policy's extra state (its KL-reference adapter, which no probe touches)
        flags = [m.training for m in pl_module.modules()]
        rngs = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        results = super().run(trainer, pl_module)
        after = pl_module.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in state.items())
        assert flags == [m.training for m in pl_module.modules()]
        assert torch.equal(rngs[0], torch.get_rng_state())
        assert np.array_equal(rngs[1], np.random.get_state()[1]) and rngs[2] == random.getstate()
        self.results = {**getattr(self, "results", {}), trainer.global_step: self.last}
        return results


# Short prompts and responses: with the tiny policy's 49k-token vocabulary, a forward costs ~T × 49k logits.
FAST = ("--trainer.limit_val_batches=0", "--model.mode=bridge", "--data.instruction=Question: {question}",
        "--data.use_chat_template=false", "--data.max_response_tokens=40")


def _fit(root: Path, callback: LossLandscape, *overrides: str, logger=None):
    cli = tiny_cli(root, *FAST, *overrides)
    if logger is not None:
        cli.trainer.logger = logger
    cli.trainer.callbacks.append(callback)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli


def test_probes_on_the_real_module(tmp_path):
    callback = CheckedLandscape(**PROBE)
    logger = TensorBoardLogger(tmp_path, name="tb")
    _fit(tmp_path, callback, logger=logger)
    assert callback.probed_steps == [0, 1, 2]  # every step, plus the final weights at fit end
    numbers = callback.results[0]
    assert math.isfinite(numbers["landscape/policy/sharpness"]) and numbers["landscape/policy/slice_rise"] > 0
    assert numbers["landscape/retriever/sharpness"] > 0 and numbers["landscape/retriever/pl_mu"] > 0
    saved = np.load(Path(logger.log_dir) / "landscape" / "step2.npz")
    assert saved["policy_grid"].shape == (3, 3) and saved["retriever_slice"].shape == (5,)
    assert saved["retriever_pl_losses"].shape == (4,) and int(saved["step"]) == 2
    assert float(saved["retriever_slice"][2]) == pytest.approx(float(saved["retriever_loss"]))  # α = 0
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert {"landscape/policy", "landscape/retriever"} <= set(events.Tags()["images"])
    steps = [e.step for e in events.Scalars("landscape/retriever/pl_mu")]
    assert steps == [0, 1, 2]


STRATEGIES = ["ddp_find_unused_parameters_true", "fsdp2"]


@pytest.fixture(scope="module")
def one_process_probe(tmp_path_factory) -> dict:
    """The step-0 probe scalars of a 1-process fit, the reference of every 2-process strategy."""
    one = CheckedLandscape(**PROBE)
    _fit(tmp_path_factory.mktemp("one"), one, "--trainer.max_steps=1")
    return one.results[0]


@pytest.fixture(scope="module")
def two_process_probes(tmp_path_factory) -> Path:
    """``out/<strategy>/rank{0,1}.json``: the 2-process fits of ``STRATEGIES``, one after the other in one pair of
    processes (a process's start, its imports and the process group, is much of each fit's time)."""
    out = tmp_path_factory.mktemp("two")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(out), *STRATEGIES], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_processes_agree_with_one_process(one_process_probe, two_process_probes, strategy):
    """DDP (full weights on each rank) and FSDP2 (each rank moves its shards) probe the same curves as one process,
    and leave every rank's weights bit-identical."""
    ranks = [json.loads((two_process_probes / strategy / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["restored"] and ranks[1]["restored"]
    assert ranks[0]["0"] == ranks[1]["0"]
    assert ranks[0]["0"] == pytest.approx(one_process_probe, rel=1e-5, abs=1e-7)


def two_process_main(out: Path, strategy: str) -> None:
    """2-process CPU fit of the tiny config under ``strategy``; each rank records its step-0 probe scalars and
    whether its weights (its shards, under FSDP2) came back bit-identical."""
    from bridge_pl.distributed import reshard

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    callback = LossLandscape(**PROBE)
    steps: dict = {"restored": True}
    run = callback.run

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def recording_run(trainer, pl_module):
        reshard(pl_module.policy.model)  # FSDP2: compare the shards (gathered units expose full copies)
        before = [local(p.detach()).clone() for p in pl_module.parameters()]
        results = run(trainer, pl_module)
        steps["restored"] &= all(torch.equal(a, local(p.detach())) for a, p in zip(before, pl_module.parameters()))
        steps[str(trainer.global_step)] = dict(callback.last)
        return results

    callback.run = recording_run
    cli = _fit(out, callback, "--trainer.max_steps=1", "--trainer.devices=2", f"--trainer.strategy={strategy}")
    (out / f"rank{cli.trainer.global_rank}.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        two_process_main(Path(sys.argv[1]) / name, name)
