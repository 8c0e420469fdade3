"""The small shared pieces: seed derivation, eval mode, joining rollout batches."""

import pytest
import torch
from torch import nn

from bridge_pl.eval_mode import eval_mode
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.seeding import derive_seed


def test_derive_seed_is_stable_and_separates_uses():
    assert derive_seed(0, "refill", 3, 1) == derive_seed(0, "refill", 3, 1)
    seeds = {derive_seed(s, use, n) for s in (0, 1) for use in ("epoch", "refill", "credit") for n in range(20)}
    assert len(seeds) == 2 * 3 * 20  # no two uses, positions or run seeds share a stream
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(0, "epoch", 1) != derive_seed(1, "epoch", 0)  # not a sum of its parts


def test_eval_mode_restores_every_submodules_own_flag():
    model = nn.Sequential(nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.5)))
    model.train()
    model[1].eval()  # a frozen part kept in eval inside a training model
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, False, False]


def _batch(lengths: list[int], searches_per_traj: int, groups: list[int]) -> RolloutBatch:
    B, T = len(lengths), max(lengths)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    S = B * searches_per_traj
    return RolloutBatch(
        input_ids=torch.where(mask.bool(), 7, 0), attention_mask=mask, action_mask=mask.float(),
        rewards=torch.arange(B, dtype=torch.float32), group_ids=torch.tensor(groups),
        turns=torch.ones(B, dtype=torch.long),
        valid_actions=torch.ones(B, dtype=torch.long), invalid_actions=torch.zeros(B, dtype=torch.long),
        search_traj=torch.arange(B).repeat_interleave(searches_per_traj),
        search_candidates=torch.arange(S * 3).view(S, 3), search_order=torch.zeros(S, 2, dtype=torch.long),
        search_logprob=torch.zeros(S), search_queries=[f"q{s}" for s in range(S)], responses=[""] * B,
        answers=[None] * B, golds=[["a"]] * B, questions=["?"] * B, example_ids=[str(b) for b in range(B)],
        metadata=[{}] * B, policy_version=2, retriever_version=1, credit_searches=torch.tensor([S - 1]),
    )


def test_concat_pads_and_offsets_groups_searches_and_credit():
    a, b = _batch([3, 5], 1, [0, 0]), _batch([4], 2, [0])
    joined = RolloutBatch.concat([a, b], pad_token_id=9)
    assert joined.input_ids.shape == (3, 5) and joined.input_ids[2, 4] == 9 and joined.attention_mask[2, 4] == 0
    assert joined.group_ids.tolist() == [0, 0, 1]  # b's group 0 is not a's
    assert joined.search_traj.tolist() == [0, 1, 2, 2]  # b's searches point at b's trajectory
    assert joined.credit_searches.tolist() == [1, 3]  # each batch's last search
    assert joined.search_queries == ["q0", "q1", "q0", "q1"] and joined.num_searches.tolist() == [1, 1, 2]


def test_concat_refuses_batches_sampled_at_different_temperatures():
    a, b = _batch([3], 1, [0]), _batch([4], 1, [0])
    a.temperature, b.temperature = 0.7, 0.7
    assert RolloutBatch.concat([a, b], pad_token_id=9).temperature == 0.7
    b.temperature = 1.0
    with pytest.raises(ValueError, match="temperature"):
        RolloutBatch.concat([a, b], pad_token_id=9)
