"""Rollouts: the search environment (tag grammar, replies) and the batched multi-turn engine."""

from bridge_pl.rollout.engine import HFRolloutEngine, SearchCall, SearchOutcome, Trajectory
from bridge_pl.rollout.env import Action, EnvConfig, SearchEnv

__all__ = ["Action", "EnvConfig", "HFRolloutEngine", "SearchCall", "SearchEnv", "SearchOutcome", "Trajectory"]
