"""The generation backend named by ``data.engine``: ``hf``, ``vllm``, or ``auto`` (vLLM where it can run)."""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from bridge_pl.rollout.engine import HFRolloutEngine, MultiTurnEngine
from bridge_pl.rollout.env import SearchEnv
from bridge_pl.rollout.vllm_engine import VLLMConfig, VLLMRolloutEngine, vllm_available

EngineName = Literal["auto", "hf", "vllm"]


def build_engine(name: EngineName, env: SearchEnv, policy, limits: dict, vllm: VLLMConfig, seed: int,
                 processes: int) -> MultiTurnEngine:
    """The ``name`` backend for ``policy``, built (and for vLLM synced) now; ``limits`` are the turn and token
    budgets and the sampling settings every backend takes.

    ``auto`` builds vLLM when it imports and the run has one process (``processes``), and falls back to ``hf``
    (with a warning) when vLLM cannot run the policy. In a run of several processes each rank builds its own
    engine (``vllm``) at its first rollout, together.
    """
    engine: MultiTurnEngine | None = None
    if name == "vllm" or (name == "auto" and processes == 1 and vllm_available()):
        engine = VLLMRolloutEngine(env, **limits, config=vllm, seed=seed)
        try:
            engine.sync(policy)
        except Exception as error:
            engine.close()
            if name == "vllm":
                raise
            rank_zero_warn(f"data.engine=auto: vLLM could not run this policy ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''}); generating with hf")
            engine = None
    engine = engine or HFRolloutEngine(env, **limits)
    rank_zero_info(f"data.engine: rollouts generate with the {engine.name} backend")
    return engine
