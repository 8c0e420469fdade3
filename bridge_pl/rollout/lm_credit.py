"""The packed LM-credit sequences of a training batch's search calls (docs/method.md section 2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from bridge_pl.policy import BranchedSequence
from bridge_pl.records import Passage, QAExample
from bridge_pl.rollout.engine import Trajectory
from bridge_pl.rollout.env import SearchEnv


def lm_credit_sequences(trajectories: Sequence[Trajectory], examples: Sequence[QAExample], searches: Sequence[int],
                        candidates: torch.Tensor, env: SearchEnv, tokenizer, passage: Callable[[int], Passage],
                        ) -> list[BranchedSequence]:
    """One :class:`BranchedSequence` per search call in ``searches`` (indices into the batch's calls, flattened
    over ``trajectories`` in order); ``candidates`` [S, K'] holds every call's candidate rows (-1: empty slot).

    Context = the prompt and the trajectory up to this search's observation (earlier observations kept); one branch
    per candidate slot = an observation holding only that candidate, then the answer open tag; target = the first
    gold answer, or on a multiple-choice question the gold option's text (its tokens alone are scored: a passage
    can support the text, while the letter is only its place in the prompt's list).
    """

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    calls = [(t, call) for t, trajectory in enumerate(trajectories) for call in trajectory.searches]
    answer_open = ids(env.config.open_tag("answer"))
    sequences = []
    for s in searches:
        t, call = calls[s]
        trajectory = trajectories[t]
        prefix = trajectory.prompt_ids + trajectory.response_ids[: call.position]
        branches = [ids(env.observation([passage(row)])) + answer_open if row >= 0 else answer_open
                    for row in candidates[s].tolist()]
        sequences.append(BranchedSequence(prefix, branches, ids(f" {examples[t].gold_text}")))
    return sequences
