"""``RolloutBatch``: trajectories as right-padded tensors, plus what each search call retrieved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bridge_pl.policy import BranchedSequence
    from bridge_pl.rollout.engine import Trajectory


@dataclass
class RolloutBatch:
    """B trajectories (prompt + response) and S search calls made while generating them.

    Token tensors are ``[B, T]``, right-padded. ``action_mask[b, t] = 1`` exactly where token t was
    sampled by the policy (0 on prompt, retrieved observations, env messages and padding). π_old's log-probs
    are not stored: with one update per batch they are the update's own first forward, detached
    (:class:`~bridge_pl.batch_losses.BatchLosses`).

    Search calls are flattened over the batch: call s belongs to trajectory ``search_traj[s]``; its K′
    FAISS candidates are ``search_candidates[s]`` (retriever rows, -1 = padding); the k passages shown are
    ``search_order[s]`` (positions into the candidate row, in the order shown) with log-prob
    ``search_logprob[s]`` under the retriever's sampling distribution.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    rewards: torch.Tensor  # [B] float
    group_ids: torch.Tensor  # [B] long: trajectories of one prompt share a group (GRPO)
    turns: torch.Tensor  # [B] long
    valid_actions: torch.Tensor  # [B] long
    invalid_actions: torch.Tensor  # [B] long
    search_traj: torch.Tensor  # [S] long
    search_candidates: torch.Tensor  # [S, K'] long
    search_order: torch.Tensor  # [S, k] long
    search_logprob: torch.Tensor  # [S] float
    search_queries: list[str]
    responses: list[str]
    answers: list[str | None]
    golds: list[list[str]]
    questions: list[str]
    example_ids: list[str]
    metadata: list[dict[str, Any]]
    policy_version: int
    retriever_version: int
    dataset: str = "train"
    sampling: dict[str, float] = field(default_factory=dict)  # rollout-side stats (dynamic sampling), logged
    # the policy's tokens were drawn from softmax(logits / temperature); the RL losses score them at the same
    # temperature, so ratios, advantages' gradients and the KL are those of the sampling policy (1.0: greedy)
    temperature: float = 1.0
    # LM credit (docs/method.md section 2): the search calls scored by the policy, and for each of them one
    # packed sequence: its context, one branch per candidate slot (that passage alone), the gold answer.
    credit_searches: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    credit_sequences: list[BranchedSequence] = field(default_factory=list)
    # [B, T] float: the generation engine's log-prob of each sampled token (at ``temperature``), 0 elsewhere
    sampler_logprobs: torch.Tensor | None = None
    # [B]: the option letter the reward read from each multiple-choice answer (None: no option named, or a free-text
    # question); metrics and predictions files score these letters, never the answers again. Empty: all None.
    choices: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [None] * self.batch_size
        if len(self.choices) != self.batch_size:
            raise ValueError(f"RolloutBatch: {len(self.choices)} choices for {self.batch_size} trajectories")

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_searches(self) -> torch.Tensor:
        """``[B]`` search calls per trajectory."""
        return torch.bincount(self.search_traj, minlength=self.batch_size)

    @property
    def search_valid(self) -> torch.Tensor:
        """``[S, K']`` bool: which candidate slots hold a real passage."""
        return self.search_candidates >= 0

    def shown_rows(self, s: int) -> list[int]:
        """Retriever rows of the passages shown for search call ``s``, in order."""
        return self.search_candidates[s, self.search_order[s]].tolist()

    @classmethod
    def from_trajectories(
        cls,
        trajectories: list[Trajectory],
        *,
        pad_token_id: int,
        answers: list[str | None],
        rewards: list[float],
        golds: list[list[str]],
        questions: list[str],
        example_ids: list[str],
        metadata: list[dict[str, Any]],
        policy_version: int,
        retriever_version: int,
        dataset: str = "train",
        sampling: dict[str, float] | None = None,
        temperature: float = 1.0,
        choices: list[str | None] | None = None,
    ) -> RolloutBatch:
        """Pad trajectories (from :class:`~bridge_pl.rollout.engine.HFRolloutEngine`) into a batch; ``choices``: the
        letter each multiple-choice answer was read as (None: all None)."""
        B = len(trajectories)
        T = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
        input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(B, T, dtype=torch.long)
        action_mask = torch.zeros(B, T, dtype=torch.float32)
        sampler_logprobs = torch.zeros(B, T, dtype=torch.float32)
        for b, traj in enumerate(trajectories):
            p, r = len(traj.prompt_ids), len(traj.response_ids)
            input_ids[b, : p + r] = torch.tensor(traj.prompt_ids + traj.response_ids, dtype=torch.long)
            attention_mask[b, : p + r] = 1
            action_mask[b, p : p + r] = torch.tensor(traj.action_mask, dtype=torch.float32)
            if traj.sampler_logprobs:
                sampler_logprobs[b, p : p + r] = torch.tensor(traj.sampler_logprobs, dtype=torch.float32)

        calls = [(b, call) for b, traj in enumerate(trajectories) for call in traj.searches]
        K = max((len(c.outcome.candidate_rows) for _, c in calls), default=0)
        k = max((len(c.outcome.passage_rows) for _, c in calls), default=0)
        candidates = torch.full((len(calls), K), -1, dtype=torch.long)
        order = torch.zeros(len(calls), k, dtype=torch.long)
        for s, (_, call) in enumerate(calls):
            cand = call.outcome.candidate_rows
            candidates[s, : len(cand)] = torch.tensor(cand, dtype=torch.long)
            position = {row: i for i, row in enumerate(cand)}
            shown = [position[row] for row in call.outcome.passage_rows]
            order[s, : len(shown)] = torch.tensor(shown, dtype=torch.long)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            action_mask=action_mask,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            group_ids=torch.tensor([t.prompt_index for t in trajectories], dtype=torch.long),
            turns=torch.tensor([t.turns for t in trajectories], dtype=torch.long),
            valid_actions=torch.tensor([t.valid_actions for t in trajectories], dtype=torch.long),
            invalid_actions=torch.tensor([t.invalid_actions for t in trajectories], dtype=torch.long),
            search_traj=torch.tensor([b for b, _ in calls], dtype=torch.long),
            search_candidates=candidates,
            search_order=order,
            search_logprob=torch.tensor([c.outcome.logprob for _, c in calls], dtype=torch.float32),
            search_queries=[c.query for _, c in calls],
            responses=[t.response_text for t in trajectories],
            answers=answers,
            golds=golds,
            questions=questions,
            example_ids=example_ids,
            metadata=metadata,
            policy_version=policy_version,
            retriever_version=retriever_version,
            dataset=dataset,
            sampling=dict(sampling or {}),
            temperature=temperature,
            sampler_logprobs=sampler_logprobs if all(t.sampler_logprobs for t in trajectories) else None,
            choices=list(choices or []),
        )

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch], pad_token_id: int) -> RolloutBatch:
        """One batch holding ``batches`` in order, as if generated together (e.g. the per-rank shards of one
        data-parallel step): tokens right-padded to the longest, group ids kept apart, search and credit indices
        offset. The batches must come from the same policy and retriever versions and sampling temperature;
        ``sampling`` stats are dropped.
        """
        if not batches:
            raise ValueError("RolloutBatch.concat: no batches")
        versions = {(b.policy_version, b.retriever_version, b.dataset, b.temperature) for b in batches}
        if len(versions) > 1:
            raise ValueError("RolloutBatch.concat: batches from different (policy version, retriever version, "
                             f"dataset, temperature): {sorted(versions)}")
        T = max(b.input_ids.shape[1] for b in batches)
        K = max(b.search_candidates.shape[1] for b in batches)
        k = max(b.search_order.shape[1] for b in batches)

        def right_pad(x: torch.Tensor, width: int, value) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        group_offsets, traj_offsets, search_offsets = [], [], []
        groups = trajs = searches = 0
        for b in batches:
            group_offsets.append(groups)
            traj_offsets.append(trajs)
            search_offsets.append(searches)
            groups += int(b.group_ids.max()) + 1 if b.batch_size else 0
            trajs += b.batch_size
            searches += b.search_traj.numel()

        def joined(name: str) -> list:
            return [item for b in batches for item in getattr(b, name)]

        return cls(
            input_ids=torch.cat([right_pad(b.input_ids, T, pad_token_id) for b in batches]),
            attention_mask=torch.cat([right_pad(b.attention_mask, T, 0) for b in batches]),
            action_mask=torch.cat([right_pad(b.action_mask, T, 0.0) for b in batches]),
            rewards=torch.cat([b.rewards for b in batches]),
            group_ids=torch.cat([b.group_ids + o for b, o in zip(batches, group_offsets)]),
            turns=torch.cat([b.turns for b in batches]),
            valid_actions=torch.cat([b.valid_actions for b in batches]),
            invalid_actions=torch.cat([b.invalid_actions for b in batches]),
            search_traj=torch.cat([b.search_traj + o for b, o in zip(batches, traj_offsets)]),
            search_candidates=torch.cat([right_pad(b.search_candidates, K, -1) for b in batches]),
            search_order=torch.cat([right_pad(b.search_order, k, 0) for b in batches]),
            search_logprob=torch.cat([b.search_logprob for b in batches]),
            search_queries=joined("search_queries"),
            responses=joined("responses"),
            answers=joined("answers"),
            golds=joined("golds"),
            questions=joined("questions"),
            example_ids=joined("example_ids"),
            metadata=joined("metadata"),
            policy_version=batches[0].policy_version,
            retriever_version=batches[0].retriever_version,
            dataset=batches[0].dataset,
            temperature=batches[0].temperature,
            credit_searches=torch.cat([b.credit_searches + o for b, o in zip(batches, search_offsets)]),
            credit_sequences=joined("credit_sequences"),
            sampler_logprobs=(torch.cat([right_pad(b.sampler_logprobs, T, 0.0) for b in batches])
                              if all(b.sampler_logprobs is not None for b in batches) else None),
            choices=joined("choices"),
        )
