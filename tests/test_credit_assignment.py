"""Properties the method claims, on real rollouts of the tiny policy under the real exact-match reward.

- the retriever's shown lists are an action: after a φ step, θ's surrogate weights each trajectory by
  P_φnew(D_i) / P_φold(D_i), so ``retriever_first`` and ``policy_first`` make different θ updates;
- the ``unmasked`` ablation trains on observation tokens with their real π_old (ratio 1 at the start);
- a batch without reward variance leaves θ untouched (no Adam step on KL/coupling noise);
- mini-batches: one AdamW step per part, each part its own loss, every ratio to the policy that sampled.
"""

import copy
import json
from dataclasses import replace

import pytest
import torch
from helpers import flat_grad, policy_loss_logprob_grads, searching, tiny_module

from bridge_pl import rl
from bridge_pl.bilevel import make_solver

WORDS = (" Paris", " Rome")


@pytest.fixture
def city_qa(tmp_path):
    """Four questions whose gold answer is Paris, as a FlashRAG jsonl file."""
    path = tmp_path / "qa.jsonl"
    rows = [{"id": f"q{i}", "question": f"Which city is number {i}?", "golden_answers": ["Paris"]} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _module_and_batch(tmp_path, *overrides, answers=WORDS, qa=None, questions=2):
    module, data = tiny_module(tmp_path, "--data.n_samples=4", *([f"--data.train={qa}"] if qa else []), *overrides)
    torch.manual_seed(0)
    with searching(module.policy, answers=answers):
        batch = data.rollout(module, data.load(data.train_source)[:questions], training=True, dataset="train")
    return module, batch


def _step(module, batch, mode):
    """One iteration of ``mode``'s solver on ``batch`` (the optimizers configure_optimizers builds; no trainer)."""
    return _step_problem(module, module.problem(batch), mode)


def _step_problem(module, problem, mode):
    module.solver = make_solver(mode)
    optimizers, _ = module.configure_optimizers()
    logs = module.solver.step(problem, module.updates_from(optimizers, backward=torch.Tensor.backward))
    return logs | problem.stats


def _lora(module):
    return {k: v.detach().clone() for k, v in module.policy.trained_state_dict().items()}


def test_retriever_first_and_policy_first_make_different_policy_updates(tmp_path, city_qa):
    module, batch = _module_and_batch(tmp_path, "--model.mode=retriever_first", qa=city_qa)
    assert 0 < batch.rewards.sum() < batch.batch_size  # the real EM reward varies: GRPO has a signal
    assert batch.credit_searches.numel() > 0
    start = copy.deepcopy(module.state_dict())
    thetas, logs = {}, {}
    for mode in ("policy_first", "retriever_first"):
        module.load_state_dict(start)
        logs[mode] = _step(module, batch, mode)
        thetas[mode] = _lora(module)
    # θ first: φ has not moved, every trajectory keeps weight 1; φ first: the shown lists' probabilities moved
    assert logs["policy_first"]["retriever/ratio_mean"] == 1.0
    assert logs["retriever_first"]["retriever/ratio_mean"] != 1.0
    assert any(not torch.equal(thetas["policy_first"][k], thetas["retriever_first"][k]) for k in thetas["policy_first"])


def test_after_a_phi_step_each_groups_policy_advantages_still_sum_to_zero(tmp_path, city_qa):
    """The retriever ratios reweight trajectories, but around the ratio-weighted group baseline: a group's
    shared tokens (format, first search) get no net push from the weights alone."""
    module, batch = _module_and_batch(tmp_path, "--model.mode=retriever_first", qa=city_qa)
    module.solver = make_solver("retriever_first")
    optimizers, _ = module.configure_optimizers()
    problem = module.problem(batch)
    before = problem.policy_advantages()
    module.solver._phi_steps_on_lower(problem, module.updates_from(optimizers, backward=torch.Tensor.backward))
    ratios = problem.retriever_ratios()
    assert not torch.allclose(ratios, torch.ones_like(ratios))  # φ moved the shown lists' probabilities
    seq = (problem.policy_advantages() * problem.mask).sum(-1) / problem.mask.sum(-1).clamp(min=1)  # per trajectory
    for group in batch.group_ids.unique():
        rows = batch.group_ids == group
        assert abs(float(seq[rows].sum())) < 1e-5
    assert not torch.allclose(problem.policy_advantages(), before)


def test_unmasked_ablation_trains_observation_tokens_from_their_real_old_logprobs(tmp_path, city_qa):
    module, batch = _module_and_batch(tmp_path, "--model.mode=frozen", "--model.rl.mask_observations=false", qa=city_qa)
    problem = module.problem(batch, keep_credit_graph=False)
    observations = problem.mask.bool() & (batch.action_mask == 0)
    assert observations.sum() > 50  # the ablation's loss covers retrieved tokens
    grad = policy_loss_logprob_grads(module.policy, problem)
    # π_old is the real policy on every loss token: the ratio starts at exactly 1, nothing is clipped
    assert problem.stats["policy/approx_kl"] == 0.0 and problem.stats["policy/clip_fraction"] == 0.0
    in_loss = problem.mask.bool()
    rows_with_signal = problem.seq_advantages != 0
    # with ratio 1 every loss token of a trajectory gets the same gradient -A_i / N, observations included
    expected = -problem.seq_advantages[:, None].expand_as(grad) / problem.mask.sum()
    assert torch.allclose(grad[in_loss], expected[in_loss], atol=1e-7)
    assert grad[observations & rows_with_signal[:, None]].abs().min() > 0


def test_lm_credit_of_a_multiple_choice_question_scores_the_gold_option_text(tmp_path):
    path = tmp_path / "mc.jsonl"
    options = {"A": "Rome", "B": "Paris", "C": "Lyon", "D": "Oslo"}
    rows = [{"id": f"q{i}", "question": f"Which city is number {i}?", "options": options, "golden_answers": ["B"]}
            for i in range(2)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    module, batch = _module_and_batch(tmp_path, "--model.mode=bridge", "--data.max_response_tokens=400",
                                      answers=(), qa=str(path))
    target = module.policy.tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    assert batch.credit_sequences and all(seq.target == target for seq in batch.credit_sequences)


def test_a_batch_without_reward_variance_leaves_the_policy_untouched(tmp_path, city_qa):
    module, batch = _module_and_batch(tmp_path, "--model.mode=bridge", answers=(" Rome",), qa=city_qa)
    assert batch.rewards.sum() == 0  # every answer wrong under EM: no group has variance
    before = _lora(module)
    logs = _step(module, batch, "bridge")
    assert logs["policy/skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in _lora(module).items())


def test_lm_credit_scores_the_answer_after_the_context_the_policy_had(tmp_path, city_qa):
    """ℓ_θ(d): context = prompt + trajectory up to the search (earlier observations kept) + only d + <answer>;
    target = the gold answer's tokens alone (docs/method.md section 2)."""
    module, batch = _module_and_batch(tmp_path, "--model.mode=bridge", "--model.retrieval.credit_queries=64",
                                      "--data.max_response_tokens=400", answers=(), qa=city_qa)
    tok = module.policy.tokenizer
    answer_open = tok("<answer>", add_special_tokens=False)["input_ids"]
    target = tok(" Paris", add_special_tokens=False)["input_ids"]
    later_searches = 0
    for s, seq in zip(batch.credit_searches.tolist(), batch.credit_sequences, strict=True):
        traj = int(batch.search_traj[s])
        assert seq.target == target  # no closing tag in the scored tokens
        context = batch.input_ids[traj, : len(seq.prefix)].tolist()
        assert seq.prefix == context  # exactly what the policy had seen and written when it searched
        assert tok.decode(seq.prefix).rstrip().endswith("</search>")
        earlier = int((batch.search_traj[:s] == traj).sum())
        response = seq.prefix[int(batch.action_mask[traj].argmax()) :]  # the instruction names the tags too
        assert tok.decode(response).count("<information>") == earlier  # earlier observations are kept
        later_searches += earlier > 0
        for row, branch in zip(batch.search_candidates[s].tolist(), seq.branches, strict=True):
            assert branch[-len(answer_open):] == answer_open
            assert module.retriever.passage(row).title in tok.decode(branch)
    assert later_searches > 0, "want a second search whose context holds the first observation"


def test_token_budget_micro_batches_sum_to_the_full_batch_loss(tmp_path, city_qa):
    """Micro-batching by a token budget is gradient accumulation: same loss and same gradient as one batch."""
    module, batch = _module_and_batch(tmp_path, "--model.mode=frozen", qa=city_qa)
    params = module.policy.trainable_parameters()
    results = {}
    for budget in (10**6, 600):  # one micro-batch; about one trajectory per micro-batch
        module.rl_config = replace(module.rl_config, micro_batch_tokens=budget)
        problem = module.problem(batch, keep_credit_graph=False)
        parts = list(problem.policy_loss_parts())
        loss = sum(parts)
        results[budget] = (len(parts), loss.detach(), flat_grad(loss, params))
    assert results[10**6][0] == 1 and results[600][0] > 2
    assert torch.allclose(results[600][1], results[10**6][1], atol=1e-6)
    assert torch.allclose(results[600][2], results[10**6][2], atol=1e-6, rtol=1e-4)


def test_minibatches_step_on_each_part_with_the_sampling_policy_as_pi_old(tmp_path, city_qa):
    """``model.rl.minibatches=2``: two AdamW steps, each on half of the batch (two GRPO groups here) with that
    half's own token-mean loss; the second step's ratio is to the policy that sampled the batch, not to θ after
    the first step, so the clip is live there. One mini-batch makes a different update."""
    module, batch = _module_and_batch(tmp_path, "--model.mode=frozen", qa=city_qa, questions=4)
    start = copy.deepcopy(module.state_dict())
    sampled = module.problem(batch, keep_credit_graph=False).old_logprobs()  # the sampling policy, θ0
    thetas = {}
    for minibatches in (1, 2):
        module.load_state_dict(start)
        module.rl_config = replace(module.rl_config, minibatches=minibatches)
        problem = module.problem(batch, keep_credit_graph=False)
        assert problem.signal_minibatches() == list(range(minibatches)), "both halves need reward variance"
        if minibatches == 2:  # on a copy: these forwards would take π_old at θ0 themselves
            check = module.problem(batch, keep_credit_graph=False)
            tokens = check.mask.sum(-1)
            shares = [tokens[:8].sum() / tokens.sum(), tokens[8:].sum() / tokens.sum()]
            params = module.policy.trainable_parameters()
            halves = [flat_grad(sum(check.policy_loss_parts(k)), params) for k in (0, 1)]
            whole = flat_grad(check.policy_loss(), params)
            assert torch.allclose(shares[0] * halves[0] + shares[1] * halves[1], whole, atol=1e-7, rtol=1e-4)
            assert not torch.allclose(halves[0], whole, atol=1e-6, rtol=0.1)
        logs = _step_problem(module, problem, "frozen")
        assert logs["policy/steps"] == minibatches
        assert torch.allclose(problem.old_logprobs(), sampled, atol=1e-5)  # π_old was taken before any step
        # the second half is scored after the first step: its ratio moved off 1
        assert (logs["policy/approx_kl"] != 0) == (minibatches == 2)
        thetas[minibatches] = _lora(module)
    assert any(not torch.equal(thetas[1][k], thetas[2][k]) for k in thetas[1])


def test_a_minibatch_without_signal_is_skipped_and_the_stats_are_those_of_the_rows_that_stepped(tmp_path, city_qa):
    module, batch = _module_and_batch(tmp_path, "--model.mode=frozen", "--model.rl.minibatches=2", qa=city_qa)
    probe = module.problem(batch, keep_credit_graph=False)
    assert probe.signal_minibatches() == [0], "want the second group's rewards equal"
    rows = torch.arange(batch.batch_size // 2)  # the first part: the first group
    cols = (rows, slice(0, int(batch.attention_mask[rows].sum(-1).max())))
    with torch.no_grad():
        entropy = probe._forward_rows(cols, entropy=True)[1]
    logs = _step(module, batch, "frozen")
    assert logs["policy/steps"] == 1
    assert logs["policy/entropy"] == pytest.approx(float(rl.masked_mean(entropy, probe.mask[cols])), rel=1e-5)
