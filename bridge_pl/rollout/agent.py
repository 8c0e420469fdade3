"""``RolloutAgent``: the one interface the rollout DataModule uses to ask the LightningModule for what it needs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from bridge_pl.records import Passage
from bridge_pl.rollout.engine import SearchOutcome

if TYPE_CHECKING:
    from bridge_pl.policy import Policy


class RolloutAgent(Protocol):
    """The policy, retrieval sampling, and what the solver needs from a batch (``BridgeModule`` implements it)."""

    policy: Policy

    @property
    def device(self) -> torch.device:
        """Where the rollout batch must land."""

    def retrieve(
        self, queries: list[str], stochastic: bool, generator: torch.Generator | None = None
    ) -> list[SearchOutcome]:
        """One outcome per query: the shown passages (sampled when ``stochastic``, else the top k)."""

    def passage(self, row: int) -> Passage:
        """The corpus passage at retriever row ``row``."""

    def versions(self) -> tuple[int, int]:
        """(policy version, retriever version): stamped on a batch, so a stale batch is refused in training."""

    def credit_queries(self) -> int:
        """How many search calls of a training batch need LM-credit sequences (0 when the retriever is fixed)."""
