"""What each trajectory scored: its answer, read from what the policy wrote, and its reward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from bridge_pl.records import QAExample
from bridge_pl.rewards import RewardFunction, choice_letter, choice_scores, extract_answer
from bridge_pl.rollout.engine import Trajectory
from bridge_pl.rollout.env import EnvConfig


class Score(NamedTuple):
    """What one trajectory scored: its ``answer`` (a multiple-choice one as the option letter it names, as written
    when it names none; None: no answer), its ``reward``, and ``choice``, the letter its multiple-choice answer was
    read as (None: no option named, or a free-text question)."""

    answer: str | None
    reward: float
    choice: str | None


def policy_text(trajectory: Trajectory, tokenizer) -> str:
    """The text of the tokens the policy generated (observations and env messages left out)."""
    ids = [i for i, m in zip(trajectory.response_ids, trajectory.action_mask) if m]
    return tokenizer.decode(ids, skip_special_tokens=True)


def score_trajectories(trajectories: Sequence[Trajectory], examples: Sequence[QAExample], tokenizer, env: EnvConfig,
                       reward: RewardFunction) -> list[Score]:
    """A :class:`Score` per trajectory (``examples[i]`` is trajectory i's question), from one decode of what the
    policy wrote (env messages quote the answer tags too, so they are left out).

    A multiple-choice answer is read once, here, as an option letter (its ``choice``) and rewarded 1 for the gold
    letter; the metrics and the predictions files score that letter. A free-text answer gets ``reward``.
    """
    tags = dict(open_tag=env.open_tag("answer"), close_tag=env.close_tag("answer"))
    scores = []
    for trajectory, example in zip(trajectories, examples):
        text = policy_text(trajectory, tokenizer)
        answer = extract_answer(text, **tags)
        if options := example.metadata.get("options"):
            letter = choice_letter(answer, options)
            scores.append(Score(letter or answer, choice_scores(letter, example.golden_answers)["em"], letter))
        else:
            scores.append(Score(answer, reward(text, example.golden_answers), None))
    return scores
