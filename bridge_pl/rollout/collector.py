"""``RolloutCollector``: QA examples in, a scored :class:`RolloutBatch` out.

It owns everything one rollout takes: the generation backend and its lifetime, the sampling generator, the
prompts, generation, scoring, dynamic sampling (refills come from a source the caller hands in) and the LM-credit
sequences. ``RolloutDataModule`` calls it right before each step; the warm start, benchmarks and experiments call it
directly.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from bridge_pl.distributed import process_rank, world_size
from bridge_pl.records import QAExample
from bridge_pl.rewards import ExactMatchReward, RewardFunction
from bridge_pl.rollout.agent import RolloutAgent
from bridge_pl.rollout.backends import EngineName, build_engine
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.rollout.engine import MultiTurnEngine, Trajectory
from bridge_pl.rollout.env import SearchEnv
from bridge_pl.rollout.lm_credit import lm_credit_sequences
from bridge_pl.rollout.prompts import PromptBuilder
from bridge_pl.rollout.scoring import Score, score_trajectories
from bridge_pl.rollout.vllm_engine import VLLMConfig
from bridge_pl.seeding import derive_seed

Refill = Callable[[int], list[QAExample]]  # sampling round (1, 2, ...) -> fresh training prompts


@dataclass(frozen=True)
class Limits:
    """The turn and token budgets and the sampling settings every backend takes (``data.<name>``)."""

    max_turns: int = 3
    max_new_tokens_per_turn: int = 64
    max_response_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class GroupSampling:
    """How training groups are sampled: ``n_samples`` trajectories per prompt; with ``filter_groups`` (DAPO's
    dynamic sampling) only groups whose rewards differ are kept, refilling until ``batch_size`` groups or
    ``max_sampling_rounds`` rollouts."""

    n_samples: int = 4
    batch_size: int = 4
    filter_groups: bool = False
    max_sampling_rounds: int = 1


@dataclass
class RolloutCollector:
    """Rolls out an agent's current policy and retriever on QA examples and scores the trajectories.

    Args:
        prompts: how a question becomes its prompt.
        limits: budgets and sampling settings of the backend.
        groups: GRPO group size and dynamic sampling.
        engine: ``hf``, ``vllm`` or ``auto`` (see :func:`~bridge_pl.rollout.backends.build_engine`); built at the
            first rollout, closed by :meth:`close`.
        vllm: the vLLM backend's settings.
        reward: the reward of free-text answers (multiple-choice ones are rewarded by their letter).
        seed: seeds sampling (retrieval and generation) and the LM-credit choice; None: the run's
            ``seed_everything`` seed (0 without one).
    """

    prompts: PromptBuilder = field(default_factory=PromptBuilder)
    limits: Limits = field(default_factory=Limits)
    groups: GroupSampling = field(default_factory=GroupSampling)
    engine_name: EngineName = "auto"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    reward: RewardFunction = field(default_factory=ExactMatchReward)
    seed_setting: int | None = None

    def __post_init__(self) -> None:
        self.engine: MultiTurnEngine | None = None
        self.generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None  # restored from a checkpoint, applied at the first rollout

    @property
    def seed(self) -> int:
        """The seed setting, or the seed Lightning's ``seed_everything`` set for this run (0 without one)."""
        return self.seed_setting if self.seed_setting is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    # ---- state ----------------------------------------------------------------------------------
    def generator_state(self) -> torch.Tensor | None:
        """The sampling generator's state (None before the first rollout)."""
        return self.generator.get_state() if self.generator is not None else None

    def load_generator_state(self, state: torch.Tensor | None) -> None:
        """Restore the sampling generator (applied at the first rollout if it is not built yet)."""
        self._generator_state = state
        if self.generator is not None and state is not None:
            self.generator.set_state(state)

    def close(self) -> None:
        """Release the backend (a vLLM engine's memory)."""
        if self.engine is not None:
            self.engine.close()

    # ---- one rollout ----------------------------------------------------------------------------
    def collect(self, agent: RolloutAgent, examples: Sequence[QAExample], training: bool, dataset: str,
                position: int = 0, refill: Refill | None = None) -> RolloutBatch:
        """The scored batch of ``examples`` rolled out with ``agent``'s current policy and retriever.

        Training: ``n_samples`` sampled trajectories per prompt with Plackett-Luce retrieval (and dynamic sampling,
        :meth:`sample_groups`, drawing refills from ``refill``), plus LM-credit sequences when the agent trains its
        retriever; else one greedy trajectory per prompt with deterministic top-k retrieval. ``position`` (the
        data position) seeds the LM-credit choice. A training batch's ``sampling`` stats include ``seconds``, the
        wall time of the whole rollout.
        """
        start = time.perf_counter()
        examples = list(examples)
        if training:
            trajectories, per_trajectory, scores, sampling = self.sample_groups(agent, examples, refill)
        else:
            trajectories = self.generate(agent, examples, training=False)
            per_trajectory = [examples[t.prompt_index] for t in trajectories]
            scores, sampling = self.score(agent.policy.tokenizer, trajectories, per_trajectory), {}
        policy_version, retriever_version = agent.versions()
        batch = RolloutBatch.from_trajectories(
            trajectories, pad_token_id=agent.policy.tokenizer.pad_token_id,
            answers=[score.answer for score in scores], rewards=[score.reward for score in scores],
            choices=[score.choice for score in scores], golds=[ex.golden_answers for ex in per_trajectory],
            questions=[ex.question for ex in per_trajectory], example_ids=[ex.id for ex in per_trajectory],
            metadata=[ex.metadata for ex in per_trajectory], policy_version=policy_version,
            retriever_version=retriever_version, dataset=dataset, sampling=sampling,
            temperature=self.limits.temperature if training else 1.0,
        )
        if training:
            self._add_lm_credit(batch, trajectories, per_trajectory, agent, position)
            batch.sampling["seconds"] = time.perf_counter() - start
        return batch

    def generate(self, agent: RolloutAgent, examples: Sequence[QAExample], training: bool) -> list[Trajectory]:
        """The trajectories of ``examples``: ``n_samples`` sampled each, or one greedy (the backend is built at the
        first call)."""
        policy = agent.policy
        if self.engine is None:
            self.start_engine(agent)
        return self.engine.rollout(
            policy, [self.prompts.ids(policy.tokenizer, ex.question, ex.metadata.get("options")) for ex in examples],
            search_fn=lambda queries: agent.retrieve(queries, stochastic=training, generator=self.generator),
            n_samples=self.groups.n_samples if training else 1, greedy=not training, generator=self.generator,
        )

    def start_engine(self, agent: RolloutAgent) -> None:
        """Build the backend for ``agent``'s policy (for vLLM: its weights pushed) and the sampling generator; the
        first rollout calls it (``callbacks.MemoryAccount`` measures it as a phase of its own)."""
        policy = agent.policy
        env = SearchEnv(self.prompts.env, policy.tokenizer)
        self.engine = build_engine(self.engine_name, env, policy, asdict(self.limits), self.vllm, self.seed,
                                   world_size())
        self.generator = torch.Generator(device=agent.device).manual_seed(
            derive_seed(self.seed, "rollout", process_rank()))
        if self._generator_state is not None:
            self.generator.set_state(self._generator_state)

    def score(self, tokenizer, trajectories: Sequence[Trajectory], examples: Sequence[QAExample]) -> list[Score]:
        """A :class:`~bridge_pl.rollout.scoring.Score` per trajectory (``examples[i]``: trajectory i's question)."""
        return score_trajectories(trajectories, examples, tokenizer, self.prompts.env, self.reward)

    def sample_groups(self, agent: RolloutAgent, examples: list[QAExample], refill: Refill | None = None):
        """The training groups: ``(trajectories, example per trajectory, Score per trajectory, stats)``.

        Without ``filter_groups``: one group of ``n_samples`` per prompt. With it (DAPO's dynamic sampling):
        groups whose rewards are all equal carry no GRPO signal and are dropped; while fewer than ``batch_size``
        groups are kept, ``refill(round)`` gives fresh prompts to sample, for at most ``max_sampling_rounds``
        rounds (no ``refill``: one round). If no group has signal, the first round is kept as it is (the θ step is
        then skipped, the retriever still learns). Stats: ``sampled_groups``, ``sampled_groups_with_signal``
        (share, before filtering), ``sampling_rounds``.
        """
        settings = self.groups
        kept: list[list[tuple[Trajectory, QAExample, Score]]] = []
        first: list[list[tuple[Trajectory, QAExample, Score]]] = []
        sampled = with_signal = rounds = 0
        prompts = examples
        while True:
            trajectories = self.generate(agent, prompts, training=True)
            per_trajectory = [prompts[t.prompt_index] for t in trajectories]
            scores = self.score(agent.policy.tokenizer, trajectories, per_trajectory)
            groups: dict[int, list[tuple[Trajectory, QAExample, Score]]] = {}
            for item in zip(trajectories, per_trajectory, scores):
                groups.setdefault(item[0].prompt_index, []).append(item)
            rounds += 1
            sampled += len(groups)
            signal = [g for g in groups.values() if len({score.reward for _, _, score in g}) > 1]
            with_signal += len(signal)
            first = first or list(groups.values())
            if not settings.filter_groups:
                kept = list(groups.values())
                break
            kept += signal
            if len(kept) >= settings.batch_size or rounds >= settings.max_sampling_rounds or refill is None:
                break
            prompts = refill(rounds)
        if settings.filter_groups:
            kept = kept[: settings.batch_size] or first
        flat = [(replace(t, prompt_index=g), ex, r) for g, group in enumerate(kept) for t, ex, r in group]
        stats = {"sampled_groups": float(sampled), "sampled_groups_with_signal": with_signal / max(1, sampled),
                 "sampling_rounds": float(rounds)}
        return [t for t, _, _ in flat], [ex for _, ex, _ in flat], [r for _, _, r in flat], stats

    def _add_lm_credit(self, batch: RolloutBatch, trajectories: list[Trajectory], examples: list[QAExample],
                       agent: RolloutAgent, position: int) -> None:
        """LM-credit sequences for up to ``agent.credit_queries()`` search calls, chosen by a generator seeded by
        ``position`` (none when the agent's retriever is fixed or the batch made no search)."""
        calls, wanted = batch.search_traj.numel(), agent.credit_queries()
        if calls == 0 or wanted == 0:
            return
        rng = random.Random(derive_seed(self.seed, "credit", position))
        chosen = sorted(rng.sample(range(calls), min(calls, wanted)))
        batch.credit_searches = torch.tensor(chosen, dtype=torch.long)
        batch.credit_sequences = lm_credit_sequences(trajectories, examples, chosen, batch.search_candidates,
                                                     self.engine.env, agent.policy.tokenizer, agent.passage)
