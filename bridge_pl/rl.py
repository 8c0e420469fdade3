"""Pure tensor functions for policy-gradient RL on token sequences: advantages, losses, KL estimators.

Shapes: ``[B]`` is one value per sequence, ``[B, T]`` one value per token. ``mask`` is always the
*action* mask: 1 on policy-generated tokens, 0 on the prompt, on retrieved ``<information>`` tokens and
on padding. Masked tokens never contribute to any result, whatever values they hold (NaN included): every
function selects with :func:`torch.where` before arithmetic, so neither values nor gradients leak.

Empty selections (no action token) give 0, not NaN, except the variance, which raises (a whitening
statistic from fewer than two tokens is meaningless and would silently blow advantages up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from bridge_pl.config import KLKind, LossAgg

AGG_MODES: tuple[str, ...] = get_args(LossAgg)
KL_KINDS: tuple[str, ...] = get_args(KLKind)

# exp() of a log-ratio beyond this overflows float32 (and its gradient becomes inf*0 = NaN). Both users
# below saturate long before it, so clamping the log-ratio here changes no value that matters.
MAX_LOG_RATIO = 20.0


def _select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on action tokens, exactly 0 elsewhere (NaN/inf at masked positions are dropped)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _check_same_shape(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.shape != mask.shape:
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not match mask shape {tuple(mask.shape)}")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over action tokens; over all elements (scalar) or along ``dim``."""
    _check_same_shape("masked_sum: x", x, mask)
    selected = _select(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over action tokens (scalar, or along ``dim``). An empty selection gives 0."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all action tokens (scalar); ``unbiased`` divides by ``n - 1``.

    Raises ValueError when there are too few action tokens (0, or 1 with ``unbiased``).
    """
    n = int(mask.bool().sum())
    if n < (2 if unbiased else 1):
        raise ValueError(
            f"masked_var: {n} action token(s) selected; need at least {2 if unbiased else 1} "
            f"(unbiased={unbiased})"
        )
    centered = x - masked_mean(x, mask)
    return masked_sum(centered * centered, mask) / (n - 1 if unbiased else n)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over action tokens.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Masked positions are 0.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _select(whitened, mask)


def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO outcome advantages: each score minus its group's mean, optionally over the group's std.

    With importance ``weights`` w (e.g. the retriever ratios of trajectories sampled before φ stepped) the
    advantage is w_i (R_i − b_g) / σ_g with the weighted baseline b_g = Σ_g w_j R_j / Σ_g w_j. Then
    Σ_{i∈g} A_i = 0 as without weights: tokens every trajectory of a group shares (the format, a common first
    search) get no net push. Multiplying plain advantages by w instead leaves Σ_g w_i (R_i − mean_g) ≠ 0, a push
    on those shared tokens whose size and sign come from the weights alone. σ_g stays the unweighted std.

    Args:
        scores: ``[B]`` sequence rewards.
        group_ids: ``[B]`` integer group label (rollouts of the same prompt share it); any values, any order.
        scale_by_std: divide by ``(unbiased std within the group + eps)``.
        eps: added to the std.
        weights: ``[B]`` positive importance weights, or None (all 1: plain GRPO).

    Returns:
        ``[B]`` advantages. A group of one sample has no baseline and gets 0, as does a group whose scores are all
        equal (exactly 0, whatever the weights).
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"grpo_advantages: scores and group_ids must both be [B]; got {tuple(scores.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"grpo_advantages: group_ids must be an integer tensor, got {group_ids.dtype}")
    if weights is not None and weights.shape != scores.shape:
        raise ValueError(f"grpo_advantages: weights must be [B] like scores; got {tuple(weights.shape)}")
    if not scores.dtype.is_floating_point:
        scores = scores.float()
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, group, torch.ones_like(scores)
    )
    total = torch.zeros_like(count).index_add_(0, group, scores)
    centered = scores - (total / count)[group]
    n = count[group]
    advantages = centered
    if weights is not None:
        weights = weights.to(scores.dtype)
        weight_sum = torch.zeros_like(count).index_add_(0, group, weights)
        weighted_total = torch.zeros_like(count).index_add_(0, group, weights * scores)
        advantages = weights * (scores - (weighted_total / weight_sum)[group])
    if scale_by_std:
        sq = torch.zeros_like(count).index_add_(0, group, centered * centered)
        std = (sq[group] / (n - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std + eps)
    # A group whose scores are all equal has no signal: exactly 0, not the rounding of R − b_g (b_g's weighted sum
    # is inexact for rewards like 0.1) divided by eps, which gave a whole group a same-signed push of ~0.01.
    low, high = _group_range(scores, group, n_groups)
    # (a group of one sample is such a group; a NaN score compares unequal and stays NaN, for the non-finite guard)
    return torch.where((high == low)[group], torch.zeros_like(advantages), advantages)


def _group_range(values: torch.Tensor, group: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max ``[G]`` of ``values`` ``[B]`` (``group``: indices 0..G-1); NaN propagates."""
    low = values.new_full((n_groups,), torch.inf).scatter_reduce(0, group, values, "amin")
    high = values.new_full((n_groups,), -torch.inf).scatter_reduce(0, group, values, "amax")
    return low, high


def groups_with_signal(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Share of groups (of two or more samples) whose scores are not all equal: a scalar in [0, 1].

    GRPO learns only from those groups (the others get advantage 0). ``scores`` and ``group_ids`` are ``[B]``.
    """
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    if n_groups == 0:
        return scores.new_zeros((), dtype=torch.float32)
    values = scores.float()
    low, high = _group_range(values, group, n_groups)
    counted = values.new_zeros(n_groups).index_add_(0, group, torch.ones_like(values)) > 1
    return ((high > low) & counted).float().sum() / counted.float().sum().clamp(min=1)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence values ``[B]`` copied onto every action token of ``[B, T]``; 0 elsewhere."""
    if seq_values.dim() != 1 or mask.dim() != 2 or seq_values.shape[0] != mask.shape[0]:
        raise ValueError(
            f"broadcast_to_tokens: need seq_values [B] and mask [B, T]; got {tuple(seq_values.shape)} "
            f"and {tuple(mask.shape)}"
        )
    return _select(seq_values[:, None].expand(mask.shape), mask)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over action tokens only.

    Masked tokens are skipped as if absent: the next value and the running estimate carry across a
    retrieved observation, so the last action token before ``<information>`` bootstraps from the first
    action token after it (no discount is spent on observation tokens). Rewards and values at masked
    positions are ignored. The final action token bootstraps from 0 (episode end). No whitening here.

    Args:
        rewards: ``[B, T]`` per-token rewards (typically the outcome reward on the last action token,
            minus a KL penalty on each action token).
        values: ``[B, T]`` critic values.
        mask: ``[B, T]`` action mask.
        gamma: discount per action token.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, with ``returns = advantages + values`` on action
        tokens and 0 at masked positions.
    """
    _check_same_shape("gae: rewards", rewards, mask)
    _check_same_shape("gae: values", values, mask)
    act = mask.bool()
    rewards, values = _select(rewards, act), _select(values, act)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m = act[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        estimate = delta + gamma * lam * running
        running = torch.where(m, estimate, running)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = torch.where(m, estimate, torch.zeros_like(estimate))
    return advantages, _select(advantages + values, act)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs ``[B, T]`` (nats).

    ``k1``: ``logp - ref_logp`` (unbiased, high variance, can be negative).
    ``k2``: ``0.5 * (logp - ref_logp)^2``.
    ``k3``: ``exp(r) - r - 1`` with ``r = ref_logp - logp`` (unbiased, non-negative), clamped to [-10, 10].
    Elementwise; the caller masks/aggregates (e.g. :func:`agg_loss`).
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        r = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.exp(r) - r - 1).clamp(-10.0, 10.0)
    raise ValueError(f"kl_penalty: unknown kind {kind!r}; expected one of {KL_KINDS}")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over action tokens.

    - ``token-mean``: sum over all action tokens / number of action tokens (long sequences weigh more).
    - ``seq-mean-token-sum``: per-sequence sum, then mean over sequences.
    - ``seq-mean-token-mean``: per-sequence mean, then mean over sequences (the original GRPO).
    - ``seq-mean-token-sum-norm``: per-sequence sum divided by the padded length ``T`` (a constant, so
      no length bias; Dr. GRPO), then mean over sequences.

    "Mean over sequences" counts only sequences with at least one action token, so a sequence without
    any adds nothing and dilutes nothing. With no action token at all the result is 0 (still attached to
    the graph, so ``backward`` works).
    """
    _check_same_shape("agg_loss: loss_mat", loss_mat, mask)
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    if agg not in AGG_MODES:
        raise ValueError(f"agg_loss: unknown agg {agg!r}; expected one of {AGG_MODES}")
    if agg == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        per_seq = masked_sum(loss_mat, mask, dim=-1)
        if agg == "seq-mean-token-sum-norm":
            per_seq = per_seq / loss_mat.shape[-1]
    return masked_mean(per_seq, mask.bool().any(dim=-1))


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(
            f"policy loss: need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, "
            f"clip_high={clip_high}"
        )
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"policy loss: dual_clip must be > 1 (or None); got {dual_clip}")


@dataclass(frozen=True)
class _Surrogate:
    """Per-token pieces of the clipped surrogate, all ``[B, T]`` and 0 at masked positions."""

    loss: torch.Tensor
    clipped: torch.Tensor  # bool: the ratio clip binds (the gradient is zero there)
    dual_clipped: torch.Tensor  # bool: the dual-clip bound -c*A binds
    log_ratio: torch.Tensor


def _surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> _Surrogate:
    _check_clip(clip_low, clip_high, dual_clip)
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        _check_same_shape(f"policy loss: {name}", x, mask)
    act = mask.bool()
    log_ratio = _select(logp - old_logp, act)
    adv = _select(advantages, act)
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(act)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual_clipped = (adv < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return _Surrogate(
        loss=_select(loss, act),
        clipped=act & (clipped > unclipped),
        dual_clipped=act & dual_clipped,
        log_ratio=log_ratio,
    )


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate loss (to minimise), aggregated by :func:`agg_loss`.

    Per token, with ``ratio = exp(logp - old_logp)`` and advantage ``A``:
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``. The asymmetric range allows
    DAPO-style "clip-higher". With ``dual_clip = c > 1`` (Ye et al. 2020) the loss of tokens with
    ``A < 0`` is further bounded above by ``-c * A``, so a huge ratio on a bad token cannot dominate.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` the same under the policy that generated the rollout.
        advantages: ``[B, T]`` per-token advantages (see :func:`broadcast_to_tokens` for GRPO).
        mask: ``[B, T]`` action mask.
        token_weights: ``[B, T]`` constant per-token weights of the loss (e.g. :func:`truncated_is_weights`);
            None: 1.
    """
    terms = _surrogate(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip)
    loss = terms.loss if token_weights is None else terms.loss * token_weights.detach()
    return agg_loss(loss, mask, agg)


@dataclass(frozen=True)
class SamplerMismatch:
    """Truncated importance weights against the sampler and the size of the mismatch, detached.

    Attributes:
        weights: ``[B, T]`` ``min(exp(old_logp - sampler_logp), cap)`` on action tokens, 0 elsewhere.
        mean_abs_gap: token mean of ``|old_logp - sampler_logp|`` (nats).
        truncated_share: share of action tokens whose weight the cap bounded.
    """

    weights: torch.Tensor
    mean_abs_gap: torch.Tensor
    truncated_share: torch.Tensor


@torch.no_grad()
def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float | None) -> SamplerMismatch:
    """Truncated importance sampling (TIS) of tokens drawn by a sampler that differs from π_old.

    The rollout engine samples with its own numerics (another kernel, merged bfloat16 weights), so the tokens
    come from π_sampler, not from the π_old the surrogate's ratio starts at. Weighting each token's loss by
    ``min(π_old / π_sampler, cap)`` corrects the expectation, truncated so one token cannot dominate
    (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").

    Args:
        old_logp: ``[B, T]`` π_old log-probs of the sampled tokens (the trainer's forward).
        sampler_logp: ``[B, T]`` the sampler's log-probs of the same tokens, like ``old_logp`` under the full
            softmax at the sampling temperature (with top-p < 1, not renormalised over the nucleus: the gap is then the
            samplers' numerics, not the truncation).
        mask: ``[B, T]`` action mask.
        cap: C >= 1; None: no truncation (the plain ratios, for the gap alone).
    """
    if cap is not None and cap < 1:
        raise ValueError(f"truncated importance sampling: cap must be >= 1, got {cap}")
    for name, x in (("old_logp", old_logp), ("sampler_logp", sampler_logp)):
        _check_same_shape(f"truncated_is_weights: {name}", x, mask)
    act = mask.bool()
    gap = _select(old_logp - sampler_logp, act)
    ratio = torch.exp(gap.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    truncated = act & (ratio > cap) if cap is not None else torch.zeros_like(act)
    return SamplerMismatch(
        weights=_select(ratio if cap is None else ratio.clamp(max=cap), act),
        mean_abs_gap=masked_mean(gap.abs(), mask),
        truncated_share=masked_mean(truncated.to(old_logp.dtype), mask),
    )


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of a policy update, detached scalars.

    Attributes:
        clip_fraction: share of action tokens where the ratio clip binds (no gradient from them).
        dual_clip_fraction: share of action tokens where the dual-clip bound binds.
        approx_kl: token mean of ``old_logp - logp`` (k1 estimate of KL(old || new), nats).
    """

    clip_fraction: torch.Tensor
    dual_clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


@torch.no_grad()
def policy_loss_stats(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLossStats:
    """Clip fractions and approximate KL for the same inputs as :func:`policy_loss`."""
    terms = _surrogate(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip)
    dtype = logp.dtype
    return PolicyLossStats(
        clip_fraction=masked_mean(terms.clipped.to(dtype), mask),
        dual_clip_fraction=masked_mean(terms.dual_clipped.to(dtype), mask),
        approx_kl=masked_mean(-terms.log_ratio, mask),
    )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
) -> torch.Tensor:
    """Clipped PPO critic loss ``0.5 * max((v - R)^2, (v_clip - R)^2)``, aggregated by :func:`agg_loss`.

    ``v_clip = old_values + clamp(values - old_values, -clip, clip)``; ``clip=None`` gives the plain
    ``0.5 * (v - R)^2``. All inputs ``[B, T]``.
    """
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        _check_same_shape(f"value_loss: {name}", x, mask)
    if clip is not None and clip <= 0:
        raise ValueError(f"value_loss: clip must be > 0 or None; got {clip}")
    act = mask.bool()
    values, old_values, returns = _select(values, act), _select(old_values, act), _select(returns, act)
    loss = (values - returns).square()
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - returns).square())
    return agg_loss(0.5 * loss, mask, agg)

