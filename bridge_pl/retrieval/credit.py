"""Stochastic retrieval and LM-supervised retrieval credit (docs/method.md sections 2-4), as tensor functions.

Shapes: ``S`` search queries, ``K`` FAISS candidates per query (K' in docs/method.md), ``k`` passages shown.
``valid`` is an optional ``[S, K]`` bool mask of real candidate slots (a query may have fewer than ``K``
candidates; the rest is padding). Invalid slots get probability exactly 0 everywhere: they are never
sampled, never enter a normaliser, and get zero gradient.

- Training retrieval is a policy: an ordered list of ``k`` candidates is drawn from the Plackett-Luce
  distribution with logits ``u = score / tau`` (:func:`gumbel_topk`), and its log-probability
  (:func:`plackett_luce_logprob`) carries the policy-gradient credit back to the query encoder.
- The lower-level loss is ``G_s = KL(Q_s || P_s)`` between the LM teacher ``Q = softmax(lm_scores / beta)``
  and the retriever ``P = softmax(scores / tau)`` (:func:`lm_supervised_kl`).
- :func:`coupling_weights` turns the first-order BRIDGE coupling ``lam * (grad G(phi) - grad G(psi))`` with
  respect to the LM scores into detached per-candidate weights, so the policy needs one weighted backward.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

import torch


def _valid_mask(logits: torch.Tensor, valid: torch.Tensor | None, min_valid: int = 1) -> torch.Tensor:
    """Check shapes and return a ``[S, K]`` bool mask with at least ``min_valid`` true entries per row."""
    if logits.dim() != 2:
        raise ValueError(f"credit: logits/scores must be [S, K]; got shape {tuple(logits.shape)}")
    if valid is None:
        valid = torch.ones_like(logits, dtype=torch.bool)
    elif valid.shape != logits.shape:
        raise ValueError(f"credit: valid has shape {tuple(valid.shape)}, expected {tuple(logits.shape)}")
    valid = valid.bool()
    if logits.shape[0] and int(valid.sum(dim=-1).min()) < min_valid:
        raise ValueError(
            f"credit: every query needs at least {min_valid} valid candidate(s); "
            f"the fewest in this batch is {int(valid.sum(dim=-1).min())}"
        )
    return valid


def _mask_logits(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~valid, float("-inf"))


def _check_k(k: int, num_candidates: int) -> None:
    if not 1 <= k <= num_candidates:
        raise ValueError(f"credit: k={k} passages requested from {num_candidates} candidates per query")


def _check_temperature(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"credit: temperature {name} must be > 0; got {value}")


def gumbel_topk(
    logits: torch.Tensor,
    k: int,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """An exact Plackett-Luce sample of ``k`` ordered candidates per query, without replacement.

    Gumbel-top-k: perturb every logit with independent Gumbel(0, 1) noise and take the ``k`` largest, in
    order. Every row needs at least ``k`` valid candidates.

    Args:
        logits: ``[S, K]`` PL logits (``score / tau``); not differentiated.
        k: list length.
        generator: torch RNG on ``logits.device``, for reproducible sampling.
        valid: ``[S, K]`` bool mask of real candidates.

    Returns:
        ``[S, k]`` int64 candidate slots, first drawn first.
    """
    _check_k(k, logits.shape[-1])
    valid = _valid_mask(logits, valid, min_valid=k)
    work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=work_dtype)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(work_dtype).tiny)))
    perturbed = _mask_logits(logits.detach().to(work_dtype) + gumbel, valid)
    return perturbed.topk(k, dim=-1).indices


def topk_order(logits: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` highest-logit valid candidates per query, best first: ``[S, k]`` int64 (evaluation)."""
    _check_k(k, logits.shape[-1])
    valid = _valid_mask(logits, valid, min_valid=k)
    return _mask_logits(logits.detach(), valid).topk(k, dim=-1).indices


def plackett_luce_logprob(
    logits: torch.Tensor, order: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probability of ordered lists under Plackett-Luce: ``[S, K], [S, k] -> [S]``.

    ``log P(d_1..d_k) = sum_i [u_{d_i} - logsumexp_{d valid, not in d_1..d_{i-1}} u_d]``; differentiable
    w.r.t. ``logits``. ``order`` must hold distinct valid slots per row.
    """
    valid = _valid_mask(logits, valid)
    if order.dim() != 2 or order.shape[0] != logits.shape[0]:
        raise ValueError(f"credit: order must be [S, k] with S={logits.shape[0]}; got {tuple(order.shape)}")
    num_candidates = logits.shape[1]
    if order.numel() and (int(order.min()) < 0 or int(order.max()) >= num_candidates):
        raise ValueError(f"credit: order holds slots outside [0, {num_candidates})")
    picked = torch.nn.functional.one_hot(order, num_candidates).bool()  # [S, k, K]
    if bool((picked.sum(dim=1) > 1).any()):
        raise ValueError("credit: order repeats a candidate within a list (sampling is without replacement)")
    if not bool(valid.gather(1, order).all()):
        raise ValueError("credit: order picks an invalid (padding) candidate slot")
    # taken[s, i, d]: d was drawn before position i.
    taken = picked.cumsum(dim=1) - picked.long() > 0
    remaining = valid[:, None, :] & ~taken
    u = logits[:, None, :].expand(picked.shape).masked_fill(~remaining, float("-inf"))
    return (logits.gather(1, order) - torch.logsumexp(u, dim=-1)).sum(dim=-1)


def retriever_log_probs(scores: torch.Tensor, tau: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``log P_phi(d | s) = log_softmax_d(score / tau)``: ``[S, K]``, ``-inf`` on invalid slots."""
    _check_temperature("tau", tau)
    valid = _valid_mask(scores, valid)
    return torch.log_softmax(_mask_logits(scores / tau, valid), dim=-1)


def teacher_probs(lm_scores: torch.Tensor, beta: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """LM teacher ``Q(d | s) = softmax_d(lm_score / beta)``: ``[S, K]``, 0 on invalid slots.

    ``lm_scores`` is the mean log-likelihood of the gold answer with only ``d`` retrieved (nats/token).
    """
    _check_temperature("beta", beta)
    valid = _valid_mask(lm_scores, valid)
    return torch.softmax(_mask_logits(lm_scores / beta, valid), dim=-1)


def _kl_terms(log_q: torch.Tensor, log_p: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``KL(Q || P)`` per row from log-probs that are ``-inf`` on invalid slots (skipped, not NaN)."""
    zero = torch.zeros((), dtype=log_q.dtype, device=log_q.device)
    log_q, log_p = torch.where(valid, log_q, zero), torch.where(valid, log_p, zero)
    q = torch.where(valid, log_q.exp(), zero)
    return (q * (log_q - log_p)).sum(dim=-1)


def lm_supervised_kl(
    scores: torch.Tensor,
    lm_scores: torch.Tensor,
    tau: float,
    beta: float,
    valid: torch.Tensor | None = None,
    detach_teacher: bool = True,
) -> torch.Tensor:
    """LM-supervised retrieval loss per query ``G_s = KL(Q_s || P_s)`` in nats: ``[S, K] x2 -> [S]``.

    ``P = softmax(scores / tau)`` (retriever, differentiable), ``Q = softmax(lm_scores / beta)`` (teacher).
    With ``detach_teacher=False`` gradients also flow into ``lm_scores`` (second-order ``implicit`` mode).
    """
    if lm_scores.shape != scores.shape:
        raise ValueError(
            f"credit: lm_scores shape {tuple(lm_scores.shape)} != scores shape {tuple(scores.shape)}"
        )
    _check_temperature("beta", beta)
    valid = _valid_mask(scores, valid)
    if detach_teacher:
        lm_scores = lm_scores.detach()
    log_q = torch.log_softmax(_mask_logits(lm_scores / beta, valid), dim=-1)
    return _kl_terms(log_q, retriever_log_probs(scores, tau, valid), valid)


@torch.no_grad()
def coupling_weights(
    lm_scores: torch.Tensor,
    phi_scores: torch.Tensor,
    psi_scores: torch.Tensor,
    tau: float,
    beta: float,
    lam: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Detached weights ``w`` ``[S, K]`` of the first-order BRIDGE coupling term (docs/method.md 4, step 5).

    ``w_s(d) = (lam / beta) Q_s(d) [log P_psi(d|s) - log P_phi(d|s) - (G_s(phi) - G_s(psi))]``, so that
    ``d/d lm_scores sum_{s,d} w_s(d) lm_scores_s(d) = lam * d/d lm_scores (sum_s G_s(phi) - sum_s G_s(psi))``:
    backpropagating ``(w * lm_scores).sum()`` through the LM that produced ``lm_scores`` gives the
    coupling gradient for theta. (For a mean over queries instead of a sum, divide ``w`` by ``S``.)
    Invalid slots get weight 0.
    """
    for name, x in (("phi_scores", phi_scores), ("psi_scores", psi_scores)):
        if x.shape != lm_scores.shape:
            raise ValueError(
                f"credit: {name} shape {tuple(x.shape)} != lm_scores shape {tuple(lm_scores.shape)}"
            )
    valid = _valid_mask(lm_scores, valid)
    q = teacher_probs(lm_scores, beta, valid)
    log_p_phi = retriever_log_probs(phi_scores, tau, valid)
    log_p_psi = retriever_log_probs(psi_scores, tau, valid)
    g_phi = lm_supervised_kl(phi_scores, lm_scores, tau, beta, valid)
    g_psi = lm_supervised_kl(psi_scores, lm_scores, tau, beta, valid)
    gap = torch.where(valid, log_p_psi - log_p_phi, torch.zeros((), dtype=q.dtype, device=q.device))
    weights = (lam / beta) * q * (gap - (g_phi - g_psi)[:, None])
    return torch.where(valid, weights, torch.zeros_like(weights))


def gold_candidate_mask(
    candidate_ids: Sequence[Sequence[str | None]], gold_ids: Sequence[Set[str] | None]
) -> torch.Tensor:
    """``[S, K]`` bool: candidate slot (s, d) holds one of search s's gold passage ids.

    ``candidate_ids[s][d]`` is the id of that slot's passage (None for padding); ``gold_ids[s]`` the ids of the
    gold passages of search s's question, or None where they are unknown (its row is then all False).
    """
    rows = [[gold is not None and i is not None and i in gold for i in row]
            for row, gold in zip(candidate_ids, gold_ids, strict=True)]
    return torch.tensor(rows, dtype=torch.bool) if rows else torch.zeros(0, 0, dtype=torch.bool)
