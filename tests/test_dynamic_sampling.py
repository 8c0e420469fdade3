"""DAPO-style dynamic sampling on real rollouts of the tiny policy under the real exact-match reward."""

import json

import pytest
import torch
from helpers import searching, tiny_cli, tiny_module

from bridge_pl import rl


@pytest.fixture
def mixed_qa(tmp_path):
    """Eight questions: gold Paris for even ids (the steered policy says Paris or Rome), Lyon for odd ids
    (it never does, so those groups have reward 0 everywhere and no GRPO signal)."""
    path = tmp_path / "qa.jsonl"
    rows = [{"id": f"q{i}", "question": f"Which city is number {i}?", "golden_answers": ["Lyon" if i % 2 else "Paris"]}
            for i in range(8)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _training_batch(tmp_path, qa, *overrides, answers=(" Paris", " Rome")):
    module, data = tiny_module(tmp_path, f"--data.train={qa}", "--data.n_samples=4", *overrides)
    torch.manual_seed(0)
    examples = [ex for ex in data.load(data.train_source) if ex.golden_answers == ["Lyon"]][:2]
    with searching(module.policy, answers=answers):
        return data.rollout(module, examples, training=True, dataset="train")


def test_filtered_batches_hold_only_groups_with_signal_refilled_from_fresh_prompts(tmp_path, mixed_qa):
    batch = _training_batch(tmp_path, mixed_qa, "--data.filter_groups=true", "--data.max_sampling_rounds=8")
    # the two given prompts (gold Lyon) have no signal; refills brought Paris questions that do
    assert batch.batch_size == 2 * 4
    assert float(rl.groups_with_signal(batch.rewards, batch.group_ids)) == 1.0
    assert all(golds == ["Paris"] for golds in batch.golds)
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4
    assert batch.sampling["sampling_rounds"] >= 2
    assert batch.sampling["sampled_groups"] == 2 * batch.sampling["sampling_rounds"]
    assert 0 < batch.sampling["sampled_groups_with_signal"] < 1


def test_without_filtering_the_given_prompts_are_trained_as_they_are(tmp_path, mixed_qa):
    batch = _training_batch(tmp_path, mixed_qa)
    assert all(golds == ["Lyon"] for golds in batch.golds) and batch.rewards.sum() == 0
    assert batch.sampling.pop("seconds") > 0
    assert batch.sampling == {"sampled_groups": 2.0, "sampled_groups_with_signal": 0.0, "sampling_rounds": 1.0}


def test_when_no_round_finds_signal_the_first_round_is_kept(tmp_path, mixed_qa):
    batch = _training_batch(tmp_path, mixed_qa, "--data.filter_groups=true", "--data.max_sampling_rounds=2",
                            answers=(" Rome",))
    assert all(golds == ["Lyon"] for golds in batch.golds) and batch.batch_size == 8
    assert batch.sampling["sampling_rounds"] == 2 and batch.sampling["sampled_groups_with_signal"] == 0


def test_max_sampling_rounds_must_be_positive(tmp_path, mixed_qa, capsys):
    with pytest.raises(SystemExit):  # refused while parsing, before anything loads
        tiny_cli(tmp_path, f"--data.train={mixed_qa}", "--data.max_sampling_rounds=0")
    assert "data.max_sampling_rounds must be an integer >= 1" in capsys.readouterr().err


def test_type_mixture_draws_training_prompts_by_question_type(tmp_path):
    cli = tiny_cli(tmp_path, "--data.batch_size=8", '--data.type_mixture={"single": 3, "bridge": 1}')
    data = cli.datamodule
    batches = [b for b, _ in zip(iter(data.train_dataloader()), range(25))]
    types = [ex.metadata["type"] for b in batches for ex in b]
    assert set(types) == {"single", "bridge"} and 0.65 < types.count("single") / len(types) < 0.85
    data.consumed = 5  # resuming at position 5 yields the same batches as the uninterrupted stream
    assert [ex.id for ex in next(iter(data.train_dataloader()))] == [ex.id for ex in batches[5]]


def test_a_bad_type_mixture_is_refused(tmp_path):
    """Negative weights: refused when constructed (the CLI refuses them earlier, at parse time: test_bad_input);
    a question type the training set lacks: when the training stream starts."""
    from bridge_pl.data.datamodule import RolloutDataModule

    with pytest.raises(ValueError, match="weights >= 0"):
        RolloutDataModule(type_mixture={"single": -1.0})
    with pytest.raises(ValueError, match="lacks"):
        cli = tiny_cli(tmp_path, '--data.type_mixture={"trivia": 1}')
        next(iter(cli.datamodule.train_dataloader()))


def test_bridge_trains_end_to_end_on_filtered_batches(tmp_path):
    from helpers import fit_tiny

    cli = fit_tiny(tmp_path, "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--data.filter_groups=true",
                   "--data.max_sampling_rounds=2", "--data.n_samples=4", "--data.reward=plugins.DistinctWordsReward")
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and float(metrics["train/groups_with_signal"]) == 1.0
    assert 0 < float(metrics["rollout/sampled_groups_with_signal"]) <= 1 and float(metrics["policy/skipped"]) == 0
