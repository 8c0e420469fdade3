"""``bridge``'s solver on the tiny policy and retriever: the diagnostics through the real θ step, the coupling of a
later policy epoch at its own θ, the θ-coupling ablation's cheaper LM credit, and ψ's own copy of a trainable passage
tower (docs/method.md sections 4.1, 4.5)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import searching, tiny_module

from bridge_pl.batch_losses import lower_level_loss
from bridge_pl.module import BridgeModule
from bridge_pl.rollout.batch import RolloutBatch

LAM = 2.0
BASE = ("--model.mode=bridge", "--data.reward=plugins.DistinctWordsReward", "--data.n_samples=4",
        "--model.rl.kl_coef=0", "--model.retrieval.credit_queries=4")


def rollout(module: BridgeModule, data) -> RolloutBatch:
    """One training rollout of 2 questions by the tiny policy steered to search, then LoRA B ~ N(0, 0.05²) and
    ψ = φ + N(0, 0.05²) (so that θ's gradient reaches every adapter weight and the coupling is not 0)."""
    torch.manual_seed(0)
    with searching(module.policy):
        batch = data.rollout(module, data.load(data.train_source, limit=2), training=True, dataset="train")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for p in module.psi.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return batch


@pytest.fixture(scope="module")
def bridge(tmp_path_factory) -> tuple[BridgeModule, RolloutBatch]:
    module, data = tiny_module(tmp_path_factory.mktemp("bridge"), *BASE)
    return module, rollout(module, data)


def run_iteration(module: BridgeModule, batch: RolloutBatch) -> dict[str, float]:
    """``solver.step`` on ``batch`` with fresh optimizers, as ``training_step`` runs it; the logs with the batch's
    stats, as ``training_step`` logs them. The module's weights are restored afterwards."""
    saved = copy.deepcopy(module.state_dict())
    try:
        optimizers, _ = module.configure_optimizers()
        problem = module.problem(batch)
        logs = module.solver.step(problem, module.updates_from(optimizers, backward=torch.Tensor.backward))
        return logs | problem.stats
    finally:
        module.load_state_dict(saved)


def test_the_iteration_logs_the_diagnostics(bridge):
    module, batch = bridge
    logs = run_iteration(module, batch)
    assert logs["policy/skipped"] == 0.0
    f, c, cos = (logs[f"bridge/{k}"] for k in ("grad_norm_rl", "grad_norm_coupling", "cos_step_rl"))
    assert f > 0 and c > 0
    # ‖g_F + g_C‖² = ‖g_F‖² + ‖g_C‖² + 2⟨g_F, g_C⟩, with ⟨g_F, g_C⟩ = cos · ‖g_F + g_C‖ ‖g_F‖ − ‖g_F‖²
    total = logs["grad_norm/policy"]
    assert total**2 == pytest.approx(f**2 + c**2 + 2 * (cos * total * f - f**2), rel=1e-4)
    assert logs["bridge/policy_clipped"] == float(total > module.solver_config.grad_clip_policy)
    assert logs["bridge/phi_psi_distance"] > 0 and "bridge/lower_gap" in logs


def with_gold(module: BridgeModule, batch: RolloutBatch) -> tuple[RolloutBatch, torch.Tensor]:
    """A copy of ``batch`` whose questions' gold passages are the first candidates of their credit searches (the other
    questions none), and the ``[S', K']`` mask of the credit candidates that are then gold."""
    batch = copy.copy(batch)
    ids = [[module.retriever.passage(r).id if r >= 0 else None for r in row]
           for row in batch.search_candidates[batch.credit_searches].tolist()]
    traj = batch.search_traj[batch.credit_searches].tolist()
    gold: dict[int, set[str]] = {}
    for t, row in zip(traj, ids):
        gold.setdefault(t, set()).add(row[0])
    batch.metadata = [dict(m, gold_passages=[sorted(gold.get(t, ()))]) for t, m in enumerate(batch.metadata)]
    mask = torch.tensor([[i in gold[t] for i in row] for t, row in zip(traj, ids)])
    return batch, mask


def test_gold_weight_is_the_mean_coupling_weight_on_gold_candidates(bridge):
    module, batch = bridge
    batch, gold = with_gold(module, batch)
    problem = module.problem(batch)
    weights = problem.coupling_search_weights(LAM) * batch.credit_searches.numel()  # w_s(d), not divided by S′
    assert problem.stats["bridge/gold_weight_mean"] == pytest.approx(float(weights[gold].mean()), rel=1e-6)
    batch.metadata = [dict(m, gold_passages=[]) for m in batch.metadata]  # no gold known: no key
    problem = module.problem(batch)
    problem.coupling_search_weights(LAM)
    assert "bridge/gold_weight_mean" not in problem.stats and "bridge/lower_gap" in problem.stats


def spec_coupling_gradient(module: BridgeModule, batch: RolloutBatch, problem) -> torch.Tensor:
    """∇θ λ[G(θ, φ) − G(θ, ψ)] at the current θ, Q(θ) not detached: autograd through ℓ_θ at this θ."""
    params = module.policy.trainable_parameters()
    ell = module.policy.branch_loglik(batch.credit_sequences, module.rl_config.micro_batch_tokens)
    valid = batch.search_valid[batch.credit_searches]
    phi, psi = (problem._scores(batch.credit_searches, e).detach() for e in (None, module.psi))
    retrieval = module.retrieval_config
    f = LAM * (lower_level_loss(phi, ell, valid, retrieval, detach_teacher=False)
               - lower_level_loss(psi, ell, valid, retrieval, detach_teacher=False))
    return torch.cat([g.flatten() for g in torch.autograd.grad(f, params)])


def test_a_later_epoch_couples_at_its_own_theta(bridge):
    """After θ moved (a second policy epoch), the coupling's gradient is that of λ[G(θ,φ) − G(θ,ψ)] at the new θ,
    its teacher Q(θ) included, not the one of the θ that sampled the batch."""
    module, batch = bridge
    saved = copy.deepcopy(module.state_dict())
    try:
        problem = module.problem(batch, keep_credit_graph=False)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # θ moves, as after the first epoch's step
            for p in module.policy.trainable_parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        params = module.policy.trainable_parameters()
        lib = torch.cat([x.flatten() for x in torch.autograd.grad(sum(problem.coupling_loss_parts(LAM)), params)])
        spec = spec_coupling_gradient(module, batch, problem)
        stale_teacher = problem.coupling_search_weights(LAM)  # Q of the sampling θ, ℓ of the new one
        ell = module.policy.branch_loglik(batch.credit_sequences, module.rl_config.micro_batch_tokens)
        stale = torch.cat([x.flatten() for x in torch.autograd.grad((stale_teacher * ell).sum(), params)])
    finally:
        module.load_state_dict(saved)
    assert float((lib - spec).norm() / spec.norm()) < 1e-4
    assert float((stale - spec).norm() / spec.norm()) > 1e-3  # the test tells the two teachers apart


def test_theta_coupling_zero_runs_no_credit_backward(tmp_path):
    module, data = tiny_module(tmp_path, *BASE, "--model.solver.theta_coupling=0",
                               "--model.policy.init_args.gradient_checkpointing=true")
    batch = rollout(module, data)
    problem = module.problem(batch)
    assert problem._credit_graph is None and not problem.lm_scores.requires_grad  # a no-grad teacher forward
    assert list(problem.coupling_loss_parts(0.0)) == []
    assert "bridge/lower_gap" in problem.stats


def test_psi_has_its_own_copy_of_a_trainable_passage_tower(tmp_path):
    """G depends on the trainable passage tower too: ψ minimises G over its own copy of it, and φ's is not touched."""
    module, data = tiny_module(tmp_path, *BASE, "--model.retriever.init_args.passage_tower=trainable")
    retriever = module.retriever
    assert module.psi_passage is not None and module.psi_passage is not retriever.passage_encoder
    optimizers = dict(zip(["policy", "phi", "psi"], module.configure_optimizers()[0]))
    in_psi = {id(p) for g in optimizers["psi"].param_groups for p in g["params"]}
    assert {id(p) for p in module.psi_passage.parameters()} <= in_psi
    assert not in_psi & {id(p) for p in retriever.passage_encoder.parameters()}
    batch = rollout(module, data)
    problem = module.problem(batch)
    problem.lower_loss("psi").backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.psi_passage.parameters())
    assert all(p.grad is None for p in retriever.passage_encoder.parameters())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_credit_graph_is_kept_only_over_a_checkpointing_policy(bridge, checkpointing: bool):
    """Uncheckpointed, a kept LM-credit graph would hold every layer's activations through the update: the coupling
    recomputes ℓ_θ instead (``BridgeModule.keeps_credit_graph``, which the memory account records too)."""
    module, batch = bridge
    saved = module.policy.gradient_checkpointing
    module.policy.gradient_checkpointing = checkpointing
    try:
        assert module.keeps_credit_graph is checkpointing
        assert (module.problem(batch)._credit_graph is not None) is checkpointing
    finally:
        module.policy.gradient_checkpointing = saved
