"""bridge_pl.rl against hand-computed numbers; masked positions must never matter."""

import math

import pytest
import torch

from bridge_pl import rl

NAN = float("nan")


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


# x = [[1, 2, (100)], [3, (nan), 4]]: action values 1, 2, 3, 4.
X = t([1.0, 2.0, 100.0], [3.0, NAN, 4.0])
M = torch.tensor([[1, 1, 0], [1, 0, 1]])


def test_masked_sum_and_mean():
    assert rl.masked_sum(X, M).item() == 10.0  # 1+2+3+4
    assert rl.masked_sum(X, M, dim=1).tolist() == [3.0, 7.0]
    assert rl.masked_mean(X, M).item() == 2.5  # 10/4
    assert rl.masked_mean(X, M, dim=1).tolist() == [1.5, 3.5]
    # An empty row has mean 0, not NaN.
    assert rl.masked_mean(X, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=1).tolist() == [1.0, 0.0]


def test_masked_var_and_whiten():
    # mean 2.5; squared deviations 2.25+0.25+0.25+2.25 = 5; unbiased 5/3, biased 5/4.
    assert rl.masked_var(X, M).item() == pytest.approx(5 / 3)
    assert rl.masked_var(X, M, unbiased=False).item() == pytest.approx(1.25)
    with pytest.raises(ValueError, match="at least 2"):
        rl.masked_var(X, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    # (x - 2.5) / sqrt(5/3): 1.5/1.290994 = 1.161895, 0.5/1.290994 = 0.387298.
    expected = t([-1.161895, -0.387298, 0.0], [0.387298, 0.0, 1.161895])
    torch.testing.assert_close(rl.masked_whiten(X, M, eps=0.0), expected, atol=1e-6, rtol=0)
    unshifted = rl.masked_whiten(X, M, shift_mean=False, eps=0.0)
    torch.testing.assert_close(unshifted, (expected + 2.5) * M, atol=1e-6, rtol=0)


def test_grpo_advantages_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    # group 0: [1,0,0], mean 1/3, unbiased var (4/9+1/9+1/9)/2 = 1/3, std 0.577350:
    #   2/3/0.577350 = 1.154701, -1/3/0.577350 = -0.577350.
    # group 1: [1,1] std 0 -> 0/(0+eps) = 0. group 2: one sample -> 0.
    expected = torch.tensor([1.154701, -0.577350, -0.577350, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rl.grpo_advantages(scores, groups), expected, atol=1e-5, rtol=0)
    # Without std scaling: score - group mean.
    expected_raw = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rl.grpo_advantages(scores, groups, scale_by_std=False), expected_raw)


def test_importance_weighted_grpo_advantages_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1])
    weights = torch.tensor([0.8, 1.2, 1.2, 1.0, 1.1])
    # group 0: weighted baseline (0.8 * 1) / (0.8 + 1.2 + 1.2 + 1.0) = 0.190476; unweighted std of [1,0,0,0]:
    #   mean 0.25, unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5. A = w (R - b) / 0.5:
    #   0.8 * 0.809524 / 0.5 = 1.295238, 1.2 * -0.190476 / 0.5 = -0.457143, 1.0 * -0.190476 / 0.5 = -0.380952.
    # group 1: one sample -> 0.
    expected = torch.tensor([1.295238, -0.457143, -0.457143, -0.380952, 0.0])
    advantages = rl.grpo_advantages(scores, groups, eps=0.0, weights=weights)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    assert abs(float(advantages[:4].sum())) < 1e-6  # the group still sums to 0
    assert abs(float((weights * rl.grpo_advantages(scores, groups, eps=0.0))[:4].sum())) > 0.1  # scaling alone: not
    assert torch.equal(rl.grpo_advantages(scores, groups, weights=torch.ones(5)), rl.grpo_advantages(scores, groups))


def test_a_group_of_equal_scores_gets_exactly_zero_advantage_whatever_the_weights():
    """Σ w R / Σ w rounds away from R for rewards like 0.1 and 0.15 (these weights: by 1 ulp), and the old code
    divided that rounding by the group's std + eps (0 + 1e-6): both trajectories got ~-0.015, a same-signed push
    from no signal at all (found as a 1- vs 2-process disagreement of the bridge θ loss)."""
    scores = torch.tensor([0.15, 0.15, 0.1, 0.1, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    weights = torch.tensor([0.9985026717185974, 1.1072887182235718, 0.9960373640060425, 1.1585779190063477, 1.2, 0.8])
    advantages = rl.grpo_advantages(scores, groups, weights=weights)
    assert advantages[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert advantages[4] > 0 > advantages[5]  # a group with spread keeps its signal
    nan = rl.grpo_advantages(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]), weights=torch.ones(2))
    assert nan.isnan().all()  # a broken reward still reaches the non-finite guard, not a silent 0


def test_grpo_advantages_interleaved_arbitrary_ids():
    scores = torch.tensor([2.0, 1.0, 4.0, 5.0])
    groups = torch.tensor([7, -3, 7, -3])
    # group 7: [2,4] mean 3, std sqrt(2); group -3: [1,5] mean 3, std sqrt(8): all +-1/sqrt(2).
    expected = torch.tensor([-0.707107, -0.707107, 0.707107, 0.707107])
    torch.testing.assert_close(rl.grpo_advantages(scores, groups, eps=0.0), expected, atol=1e-6, rtol=0)
    assert rl.grpo_advantages(scores, groups, scale_by_std=False).tolist() == [-1.0, -2.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="integer"):
        rl.grpo_advantages(scores, groups.float())


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    out = rl.broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, -1.0, -1.0]]


def test_gae_skips_observation_tokens():
    # Tokens 2,3 are a retrieved observation: GAE runs over positions 0, 1, 4 only.
    rewards = t([0.0, 0.0, 5.0, 7.0, 1.0])
    values = t([0.5, 0.2, 9.0, 9.0, 0.4])
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    # gamma=0.9, lam=0.8 (gamma*lam=0.72):
    # t=4: delta = 1 + 0.9*0 - 0.4 = 0.6;       A = 0.6
    # t=1: delta = 0 + 0.9*0.4 - 0.2 = 0.16;    A = 0.16 + 0.72*0.6 = 0.592
    # t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32;   A = -0.32 + 0.72*0.592 = 0.10624
    # returns = A + V: 0.60624, 0.792, 1.0.
    adv, ret = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, t([0.10624, 0.592, 0.0, 0.0, 0.6]))
    torch.testing.assert_close(ret, t([0.60624, 0.792, 0.0, 0.0, 1.0]))
    # Anything at masked positions (NaN included) changes nothing.
    adv2, ret2 = rl.gae(t([0.0, 0.0, NAN, -3.0, 1.0]), t([0.5, 0.2, NAN, 1e6, 0.4]), mask, 0.9, 0.8)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)


def test_gae_batch_rows_independent_and_trailing_padding():
    # Row 0 as in the test above followed by padding; row 1 a single action token.
    rewards = t([0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    values = t([0.5, 0.2, 0.0, 0.0, 0.4, 3.0], [0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 0, 0, 0, 0]])
    adv, _ = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 1: delta = 2 - 0.5 = 1.5 (terminal, no bootstrap).
    torch.testing.assert_close(adv[0], t([0.10624, 0.592, 0.0, 0.0, 0.6, 0.0])[0])
    torch.testing.assert_close(adv[1], t([0.0, 1.5, 0.0, 0.0, 0.0, 0.0])[0])


def test_kl_penalty_estimators():
    logp, ref = t([-1.0]), t([-1.5])
    assert rl.kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)  # -1 - (-1.5)
    assert rl.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)  # 0.5 * 0.5^2
    # r = ref - logp = -0.5: exp(-0.5) + 0.5 - 1 = 0.606531 - 0.5 = 0.106531
    assert rl.kl_penalty(logp, ref, "k3").item() == pytest.approx(0.106531, abs=1e-6)
    # Clamp: r = 30 -> e^30 - 31 -> 10; r = -20 -> e^-20 + 19 -> 10. Gradients stay finite.
    logp = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    k3 = rl.kl_penalty(logp, torch.tensor([[30.0, -20.0, 200.0]]), "k3")
    assert k3.tolist() == [[10.0, 10.0, 10.0]]
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        rl.kl_penalty(logp, logp, "k4")


LOSS = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0])
LOSS_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third sequence has no action token


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", 7 / 3),  # (1+2+4)/3
        ("seq-mean-token-sum", 3.5),  # sums [3, 4], empty row excluded
        ("seq-mean-token-mean", 2.75),  # means [1.5, 4]
        ("seq-mean-token-sum-norm", 7 / 6),  # [3/3, 4/3] -> mean (1 + 4/3)/2
    ],
)
def test_agg_loss_modes(agg, expected):
    assert rl.agg_loss(LOSS, LOSS_MASK, agg).item() == pytest.approx(expected)


@pytest.mark.parametrize("agg", rl.AGG_MODES)
def test_agg_loss_no_action_tokens_is_zero_and_backwardable(agg):
    loss_mat = torch.ones(2, 3, requires_grad=True)
    out = rl.agg_loss(loss_mat, torch.zeros(2, 3), agg)
    assert out.item() == 0.0
    out.backward()
    assert loss_mat.grad.abs().sum() == 0


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        rl.agg_loss(LOSS, LOSS_MASK, "sum")


# One sequence, 4 tokens, the last is masked (NaN there). Ratios 1.5, 0.5, 4; advantages +1, -2, -1.
def _policy_inputs():
    old = t([0.0, 0.0, 0.0, NAN])
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(4.0), NAN]], dtype=torch.float64)
    adv = t([1.0, -2.0, -1.0, NAN])
    mask = torch.tensor([[1, 1, 1, 0]])
    return logp.requires_grad_(), old, adv, mask


def test_policy_loss_clipped_surrogate():
    logp, old, adv, mask = _policy_inputs()
    # t0: max(-1.5, -1*1.2) = -1.2 (clipped); t1: max(2*0.5, 2*0.8) = 1.6 (clipped);
    # t2: max(1*4, 1*1.2) = 4 (unclipped). token-mean: (-1.2 + 1.6 + 4)/3 = 4.4/3.
    loss = rl.policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(4.4 / 3)
    loss.backward()
    # Only t2 has a gradient: d(-A*ratio)/dlogp = -A*ratio = 4, divided by 3 tokens. Masked: 0, not NaN.
    torch.testing.assert_close(logp.grad, t([0.0, 0.0, 4 / 3, 0.0]))


def test_policy_loss_asymmetric_and_dual_clip():
    logp, old, adv, mask = _policy_inputs()
    # clip_high=0.28: t0 -> max(-1.5, -1.28) = -1.28; t1 1.6; t2 4. Sum 4.32 / 3.
    assert rl.policy_loss(logp, old, adv, mask, clip_high=0.28).item() == pytest.approx(4.32 / 3)
    # dual clip c=3 bounds A<0 tokens at -c*A: t1 min(1.6, 6) = 1.6; t2 min(4, 3) = 3. (-1.2+1.6+3)/3.
    loss = rl.policy_loss(logp, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.4 / 3)
    loss.backward()
    assert logp.grad.abs().sum() == 0  # every token is clipped one way or the other
    with pytest.raises(ValueError, match="dual_clip"):
        rl.policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_policy_loss_stats():
    logp, old, adv, mask = _policy_inputs()
    stats = rl.policy_loss_stats(logp, old, adv, mask, dual_clip=3.0)
    assert stats.clip_fraction.item() == pytest.approx(2 / 3)  # t0, t1
    assert stats.dual_clip_fraction.item() == pytest.approx(1 / 3)  # t2
    # mean(old - logp) = -(ln 1.5 + ln 0.5 + ln 4)/3 = -ln(3)/3
    assert stats.approx_kl.item() == pytest.approx(-math.log(3) / 3)
    assert not stats.approx_kl.requires_grad


def test_truncated_is_weights_hand_computed():
    # π_old / π_sampler per token: e^0.5, e^-1, e^2 (above the cap 3), masked (NaN there)
    old = t([0.5, -1.0, 2.0, NAN])
    sampler = t([0.0, 0.0, 0.0, NAN])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = rl.truncated_is_weights(old, sampler, mask, cap=3.0)
    torch.testing.assert_close(out.weights, t([math.exp(0.5), math.exp(-1.0), 3.0, 0.0]))
    assert out.mean_abs_gap.item() == pytest.approx(3.5 / 3)
    assert out.truncated_share.item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="cap"):
        rl.truncated_is_weights(old, sampler, mask, cap=0.5)


def test_policy_loss_token_weights_scale_each_tokens_term():
    logp, old, adv, mask = _policy_inputs()
    # the per-token losses -1.2, 1.6, 4 (see above), weighted 2, 1, 0.5: (-2.4 + 1.6 + 2) / 3
    weights = t([2.0, 1.0, 0.5, NAN])
    loss = rl.policy_loss(logp, old, adv, mask, token_weights=weights)
    assert loss.item() == pytest.approx(1.2 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([0.0, 0.0, 2 / 3, 0.0]))  # t2's gradient 4/3 halved


def test_value_loss_clipped():
    values = t([1.0, 1.2, NAN])
    old = t([0.5, 1.0, 0.0])
    returns = t([2.0, 1.0, 5.0])
    mask = torch.tensor([[1, 1, 0]])
    # t0: (1-2)^2 = 1; v_clip = 0.5+0.2 = 0.7, (0.7-2)^2 = 1.69 -> 0.5*1.69 = 0.845
    # t1: (1.2-1)^2 = 0.04; v_clip = 1.2, same -> 0.02. Mean (0.845 + 0.02)/2 = 0.4325.
    assert rl.value_loss(values, old, returns, mask).item() == pytest.approx(0.4325)
    # No clip: 0.5 * mean(1, 0.04) = 0.26.
    assert rl.value_loss(values, old, returns, mask, clip=None).item() == pytest.approx(0.26)


def test_groups_with_signal_counts_groups_whose_rewards_differ():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 has one sample: no baseline, not counted
    assert float(rl.groups_with_signal(scores, groups)) == pytest.approx(1 / 3)
    assert float(rl.groups_with_signal(torch.zeros(4), torch.tensor([5, 5, 9, 9]))) == 0.0
