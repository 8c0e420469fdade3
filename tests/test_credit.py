"""bridge_pl.retrieval.credit: Plackett-Luce sampling/log-probs and the LM-supervised retrieval loss."""

import itertools
import math

import pytest
import torch

from bridge_pl.retrieval import credit

LOGITS = torch.tensor([[1.0, 0.0, -0.5, 2.0]], dtype=torch.float64)


def _pl_prob_by_hand(u: list[float], order: tuple[int, ...]) -> float:
    """Sequential softmax over the remaining candidates (the PL definition, no shortcuts)."""
    remaining, prob = list(range(len(u))), 1.0
    for d in order:
        prob *= math.exp(u[d]) / sum(math.exp(u[j]) for j in remaining)
        remaining.remove(d)
    return prob


def _all_orders(num_candidates: int, k: int) -> torch.Tensor:
    return torch.tensor(list(itertools.permutations(range(num_candidates), k)))


@pytest.mark.parametrize("k", [2, 4])
def test_plackett_luce_logprob_matches_enumeration(k):
    orders = _all_orders(4, k)  # 12 orderings for k=2, 24 for k=4
    logp = credit.plackett_luce_logprob(LOGITS.expand(len(orders), 4), orders)
    expected = torch.tensor([_pl_prob_by_hand(LOGITS[0].tolist(), tuple(o)) for o in orders.tolist()])
    torch.testing.assert_close(logp.exp(), expected.to(logp.dtype))
    # All orderings (k=4), and all ordered prefixes of length 2, each form a distribution.
    assert logp.exp().sum().item() == pytest.approx(1.0)


def test_plackett_luce_logprob_hand_value():
    # u = [0, ln 2, ln 3]: order (2, 1) -> 3/6 * 2/3 = 1/3.
    u = torch.tensor([[0.0, math.log(2), math.log(3)]])
    assert credit.plackett_luce_logprob(u, torch.tensor([[2, 1]])).exp().item() == pytest.approx(1 / 3)


def test_plackett_luce_with_padding_and_gradient():
    # Slot 3 is padding: the PL distribution is the one over slots 0..2 alone, whatever logit slot 3 has.
    valid = torch.tensor([[True, True, True, False]])
    logits = torch.tensor([[1.0, 0.0, -0.5, 50.0]], dtype=torch.float64, requires_grad=True)
    orders = _all_orders(3, 2)
    logp = credit.plackett_luce_logprob(logits.expand(len(orders), 4), orders, valid.expand(len(orders), 4))
    expected = torch.tensor([_pl_prob_by_hand([1.0, 0.0, -0.5], tuple(o)) for o in orders.tolist()])
    torch.testing.assert_close(logp.exp(), expected.to(logp.dtype))
    logp[0].backward()
    assert logits.grad[0, 3] == 0 and torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="invalid"):
        credit.plackett_luce_logprob(logits, torch.tensor([[0, 3]]), valid)
    with pytest.raises(ValueError, match="repeats"):
        credit.plackett_luce_logprob(logits, torch.tensor([[1, 1]]), valid)


def test_gumbel_topk_frequencies_match_plackett_luce():
    n = 20000
    gen = torch.Generator().manual_seed(0)
    samples = credit.gumbel_topk(LOGITS.expand(n, 4), 2, generator=gen)
    assert samples.dtype == torch.int64 and samples.shape == (n, 2)
    orders = _all_orders(4, 2)
    probs = credit.plackett_luce_logprob(LOGITS.expand(len(orders), 4), orders).exp()
    codes = samples[:, 0] * 4 + samples[:, 1]
    freq = torch.bincount(codes, minlength=16).double() / n
    # Binomial std <= sqrt(0.25/20000) = 0.0035; 0.01 is about 3 standard deviations at worst.
    torch.testing.assert_close(freq[orders[:, 0] * 4 + orders[:, 1]], probs, atol=0.01, rtol=0)


def test_gumbel_topk_reproducible_and_never_samples_padding():
    logits = torch.tensor([[5.0, 0.0, 9.0, 1.0], [0.0, 0.0, 0.0, 0.0]]).repeat(500, 1)
    valid = torch.tensor([[True, True, False, True], [False, True, True, False]]).repeat(500, 1)
    a = credit.gumbel_topk(logits, 2, torch.Generator().manual_seed(3), valid)
    b = credit.gumbel_topk(logits, 2, torch.Generator().manual_seed(3), valid)
    assert torch.equal(a, b)
    assert valid.gather(1, a).all()
    assert (a[:, 0] != a[:, 1]).all()
    with pytest.raises(ValueError, match="at least 3 valid"):
        credit.gumbel_topk(logits, 3, valid=valid)
    with pytest.raises(ValueError, match="k=5"):
        credit.gumbel_topk(logits, 5)


def test_topk_order_respects_valid():
    logits = torch.tensor([[0.1, 3.0, 2.0, 9.0]])
    assert credit.topk_order(logits, 3).tolist() == [[3, 1, 2]]
    valid = torch.tensor([[True, True, True, False]])
    assert credit.topk_order(logits, 3, valid).tolist() == [[1, 2, 0]]


def test_probabilities_and_padding():
    valid = torch.tensor([[True, True, False]])
    scores = torch.tensor([[0.0, 2 * math.log(3), 100.0]])
    # tau=2: softmax([0, ln 3]) = [1/4, 3/4]; the padded slot has probability 0.
    log_p = credit.retriever_log_probs(scores, tau=2.0, valid=valid)
    torch.testing.assert_close(log_p.exp(), torch.tensor([[0.25, 0.75, 0.0]]))
    q = credit.teacher_probs(torch.tensor([[1.0, 1.0, 7.0]]), beta=0.5, valid=valid)
    torch.testing.assert_close(q, torch.tensor([[0.5, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="tau"):
        credit.retriever_log_probs(scores, tau=0.0)
    with pytest.raises(ValueError, match="at least 1 valid"):
        credit.teacher_probs(scores, 1.0, torch.zeros(1, 3, dtype=torch.bool))


def test_lm_supervised_kl_hand_computed():
    # P = softmax([0, 2 ln 3] / 2) = [1/4, 3/4]; Q = softmax([0, 0]) = [1/2, 1/2].
    # KL(Q||P) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3) = 0.143841.
    scores = torch.tensor([[0.0, 2 * math.log(3)]])
    kl = credit.lm_supervised_kl(scores, torch.zeros(1, 2), tau=2.0, beta=1.0)
    assert kl.shape == (1,)
    assert kl.item() == pytest.approx(0.143841, abs=1e-6)
    # A padded third slot, whatever its scores, changes nothing.
    padded = credit.lm_supervised_kl(
        torch.tensor([[0.0, 2 * math.log(3), 40.0]]),
        torch.tensor([[0.0, 0.0, -40.0]]),
        2.0,
        1.0,
        valid=torch.tensor([[True, True, False]]),
    )
    torch.testing.assert_close(padded, kl)


def test_lm_supervised_kl_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    lm_scores = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[1, 3:] = False

    def total(s, lm):
        return credit.lm_supervised_kl(s, lm, tau=0.7, beta=1.3, valid=valid, detach_teacher=False)

    assert torch.autograd.gradcheck(total, (scores, lm_scores))
    # Detached teacher: no gradient reaches lm_scores.
    credit.lm_supervised_kl(scores, lm_scores, 0.7, 1.3, valid).sum().backward()
    assert lm_scores.grad is None
    assert torch.isfinite(scores.grad).all() and (scores.grad[1, 3:] == 0).all()


def test_coupling_weights_reproduce_the_coupling_gradient():
    gen = torch.Generator().manual_seed(2)
    shape = (4, 6)
    lm_scores = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    phi = torch.randn(shape, generator=gen, dtype=torch.float64)
    psi = torch.randn(shape, generator=gen, dtype=torch.float64)
    valid = torch.ones(shape, dtype=torch.bool)
    valid[0, 4:] = False
    valid[3, 1] = False
    tau, beta, lam = 0.5, 2.0, 3.0

    g_phi = credit.lm_supervised_kl(phi, lm_scores, tau, beta, valid, detach_teacher=False).sum()
    g_psi = credit.lm_supervised_kl(psi, lm_scores, tau, beta, valid, detach_teacher=False).sum()
    (expected,) = torch.autograd.grad(lam * (g_phi - g_psi), lm_scores)

    weights = credit.coupling_weights(lm_scores, phi, psi, tau, beta, lam, valid)
    assert not weights.requires_grad
    assert (weights[~valid] == 0).all()
    (actual,) = torch.autograd.grad((weights * lm_scores).sum(), lm_scores)
    torch.testing.assert_close(actual, expected)
    # Same query encoder for phi and psi: no coupling.
    assert credit.coupling_weights(lm_scores, phi, phi, tau, beta, lam, valid).abs().max() == 0
