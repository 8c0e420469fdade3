"""Warm start: imperfect search demonstrations, the masked SFT loss, and the callback in a real fit."""

import logging
import random

import pytest
import torch
from helpers import fit_tiny

from bridge_pl.data import datamodule
from bridge_pl.demonstrations import Demonstration, demonstration_segments, sft_loss, tokenize_demonstration
from bridge_pl.metrics import QAMetrics
from bridge_pl.models import load_tokenizer
from bridge_pl.policy import Policy, length_sorted_groups
from bridge_pl.records import QAExample
from bridge_pl.rollout.engine import SearchOutcome
from bridge_pl.rollout.env import EnvConfig, SearchEnv
from callbacks import warm_start as warm_start_callback
from callbacks.warm_start import WarmStart


def _example() -> QAExample:
    return QAExample(
        id="q1", question="Where was the founder of Acme born?", golden_answers=["Lindo", "Lindo City"],
        metadata={"hop_queries": ["founder of Acme", "birthplace of Ada Vell"], "hops": ["Acme", "Ada Vell"]},
    )


def _segments(noise: float, seed: int = 0, example: QAExample | None = None, choice_answer: str = "letter"
              ) -> tuple[list[tuple[str, bool]], list[list[str]]]:
    env = SearchEnv(EnvConfig(), load_tokenizer("tiny-llama"))
    queries: list[list[str]] = []

    def retrieve(qs):
        queries.append(list(qs))
        return [SearchOutcome(candidate_rows=[0], passage_rows=[0], logprob=0.0, passages=[]) for _ in qs]

    segments = demonstration_segments(example or _example(), env, retrieve, random.Random(seed), noise, choice_answer)
    return segments, queries


def test_demonstration_follows_the_hops_and_trains_only_agent_text():
    segments, queries = _segments(noise=0.0)
    assert queries == [["founder of Acme", "birthplace of Ada Vell"]]
    # search turn, observation, search turn, observation, answer turn
    assert [trained for _, trained in segments] == [True, False, True, False, True]
    assert "<search> founder of Acme </search>" in segments[0][0]
    assert "<search> birthplace of Ada Vell </search>" in segments[2][0]
    assert "<information>" in segments[1][0] and "<information>" in segments[3][0]
    assert segments[-1][0].endswith("<answer> Lindo </answer>")


def test_a_multiple_choice_demonstration_answers_the_letter_or_the_option_text():
    options = {"A": "Mopek", "B": "Lindo", "C": "Vutrar", "D": "Daikek"}
    example = QAExample("q2", "Where was Ada Vell born?", ["B"], {"hop_queries": ["Ada Vell"], "options": options})

    def answer(choice_answer):
        segments, _ = _segments(noise=0.0, example=example, choice_answer=choice_answer)
        return segments[-1][0].rsplit("\n", 1)[-1]

    assert answer("letter") == "<answer> B </answer>"
    assert answer("text") == "<answer> Lindo </answer>"  # choice_letter reads it as B
    assert _example().gold_text == "Lindo"  # a free-text question answers its first gold answer either way
    with pytest.raises(ValueError, match="choice_answer"):
        WarmStart(choice_answer="option")


def test_noise_weakens_hop_queries_without_repeating_one():
    _, clean = _segments(noise=0.0)
    _, noisy = _segments(noise=1.0)
    # the first noisy hop searches the raw question; a second search of it would return the same passages,
    # so the second noisy hop searches its entity alone
    assert noisy == [[_example().question, "Ada Vell"]] and clean != noisy


def test_tokenized_demonstration_masks_prompt_and_observations():
    tok = load_tokenizer("tiny-llama")
    demo = tokenize_demonstration([1, 2, 3], [("<search> a </search>", True), ("<information> b", False)], tok)
    n_agent = len(tok("<search> a </search>", add_special_tokens=False)["input_ids"])
    n_obs = len(tok("<information> b", add_special_tokens=False)["input_ids"])
    assert demo.input_ids[:3] == [1, 2, 3] and demo.input_ids[-1] == tok.eos_token_id
    assert demo.loss_mask == [0, 0, 0] + [1] * n_agent + [0] * n_obs + [1]


def test_sft_loss_is_the_mean_nll_of_masked_tokens():
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    demos = [Demonstration([5, 6, 7, 8], [0, 1, 0, 1]), Demonstration([9, 10], [0, 1])]
    loss = sft_loss(policy, demos)
    pad = policy.tokenizer.pad_token_id
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, pad, pad]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    logp = policy(ids, attn)[0].detach()
    expected = -(logp[0, 1] + logp[0, 3] + logp[1, 1]) / 3
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_sft_loss_split_by_token_budget_adds_up_to_the_batch_mean():
    """The warm start backpropagates one token-budget group at a time: same loss, same gradient as one batch."""
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    demos = [Demonstration([5, 6, 7, 8, 9], [0, 1, 1, 0, 1]), Demonstration([9, 10], [0, 1]),
             Demonstration([11, 12, 13], [0, 0, 1])]
    params = policy.trainable_parameters()
    whole = sft_loss(policy, demos)
    whole_grads = torch.autograd.grad(whole, params)
    tokens = sum(sum(d.loss_mask) for d in demos)
    groups = length_sorted_groups([len(d.input_ids) for d in demos], token_budget=5)
    assert len(groups) > 1
    parts = [sft_loss(policy, [demos[i] for i in group], normalizer=tokens) for group in groups]
    part_grads = torch.autograd.grad(sum(parts), params)
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), abs=1e-6)
    for a, b in zip(whole_grads, part_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_warm_start_trains_saves_and_a_later_run_starts_from_it(tmp_path, caplog):
    warm = WarmStart(steps=6, batch_size=2, lr=1e-2, save_to=str(tmp_path / "adapter"))
    with caplog.at_level(logging.INFO):
        cli = fit_tiny(tmp_path / "fit", "--trainer.max_steps=1", "--trainer.val_check_interval=1", callbacks=(warm,))
    assert set(warm.em) == {"before", "after"} and set(warm.em["after"]) == {"world_dev"}
    final = float(cli.trainer.callback_metrics["val/world_dev/em"])
    before, after = warm.em["before"]["world_dev"], warm.em["after"]["world_dev"]
    summary = (f"world_dev EM {before:.3f} before the warm start -> {after:.3f} after it -> {final:.3f} after RL "
               f"(step 1): warm start {after - before:+.3f}, RL {final - after:+.3f}")
    assert summary in caplog.text
    policy = cli.model.policy
    assert policy.reference_adapter is not None  # RL's KL reference is the warm-started policy
    assert set(policy.reference_adapter) == set(policy.trained_state_dict())
    reloaded = Policy("tiny-llama", dtype="float32", adapter=str(tmp_path / "adapter"))
    # the adapter was saved right after the warm start; one RL step has moved the live policy since
    warm_state = reloaded.trained_state_dict()
    assert set(warm_state) == set(policy.trained_state_dict())
    assert any(v.abs().sum() > 0 for k, v in warm_state.items() if "lora_B" in k)  # trained (lora_B starts at 0)
    lora = [p for n, p in reloaded.model.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for p in lora)  # loaded trainable (is_trainable=True), not frozen


def test_warm_start_forwards_run_in_the_trainers_precision_context(tmp_path, monkeypatch):
    """Under ``bf16-mixed`` the supervised forwards and both evaluations compute under autocast, as Lightning's steps
    and the validation rollouts do (the EM after the warm start is step 0 of the ``val/<dataset>/em`` curve)."""
    autocast: dict[str, set[bool]] = {}

    def recorded(name, fn):
        def call(*args, **kwargs):
            autocast.setdefault(name, set()).add(torch.is_autocast_enabled("cpu"))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(warm_start_callback, "sft_loss", recorded("sft forwards", sft_loss))

    class RecordedMetrics(QAMetrics):  # scored inside the evaluation's context, right after each rollout batch
        def update_from_rollouts(self, batch):
            autocast.setdefault("evaluations", set()).add(torch.is_autocast_enabled("cpu"))
            super().update_from_rollouts(batch)

    monkeypatch.setattr(datamodule, "QAMetrics", RecordedMetrics)  # the warm start evaluates through the datamodule
    warm = WarmStart(steps=2, batch_size=1)
    fit_tiny(tmp_path, "--trainer.max_steps=1", "--trainer.precision=bf16-mixed", callbacks=(warm,))
    assert autocast == {"sft forwards": {True}, "evaluations": {True}}
    assert set(warm.em) == {"before", "after"}


def test_adapter_option_errors_name_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="policy.adapter"):
        Policy("tiny-llama", dtype="float32", adapter=str(tmp_path))
    with pytest.raises(ValueError, match="policy.adapter"):
        Policy("tiny-llama", dtype="float32", lora=False, adapter=str(tmp_path))


def test_the_summary_without_the_evaluation_before_starts_at_the_warm_started_policy():
    assert WarmStart._summary("world_dev EM", None, 0.25, 0.375, 5) == (
        "WarmStart: world_dev EM 0.250 after the warm start -> 0.375 after RL (step 5): RL +0.125")
    assert WarmStart._summary("world_dev EM", 0.0, 0.25, 0.375, 5) == (
        "WarmStart: world_dev EM 0.000 before the warm start -> 0.250 after it -> 0.375 after RL (step 5): "
        "warm start +0.250, RL +0.125")


def test_without_the_evaluation_before_only_the_warm_started_policy_is_measured(tmp_path, caplog):
    warm = WarmStart(steps=1, batch_size=2, evaluate_before=False)
    with caplog.at_level(logging.INFO):
        cli = fit_tiny(tmp_path, "--trainer.max_steps=1", "--trainer.val_check_interval=1", callbacks=(warm,))
    assert set(warm.em) == {"after"}
    assert "before warm start" not in caplog.text
    after, final = warm.em["after"]["world_dev"], float(cli.trainer.callback_metrics["val/world_dev/em"])
    assert f"world_dev EM {after:.3f} after the warm start -> {final:.3f} after RL (step 1): RL {final - after:+.3f}" \
        in caplog.text
