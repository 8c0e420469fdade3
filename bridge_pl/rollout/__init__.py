"""Rollouts: the collector (QA examples in, a scored batch out), the search environment (tag grammar, replies)
and the batched multi-turn engines."""

from bridge_pl.rollout.engine import HFRolloutEngine, SearchCall, SearchOutcome, Trajectory
from bridge_pl.rollout.env import Action, EnvConfig, SearchEnv

__all__ = ["Action", "EnvConfig", "HFRolloutEngine", "SearchCall", "SearchEnv", "SearchOutcome", "Trajectory"]
