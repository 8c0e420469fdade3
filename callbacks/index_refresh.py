"""``IndexRefresh``: keep a trainable passage tower's FAISS index fresh enough (docs/method.md section 6).

Two strategies:

- ``"rebuild"``: re-encode the corpus and rebuild the index every ``every_n_steps`` steps, or on a
  piecewise ``schedule`` (``[[start_step, every_n], ...]``, e.g. ``[[0, 500], [5000, 3000]]``). Between
  refreshes the index is stale by design, so the callback sets ``retriever.allow_stale``.
- ``"rerank"``: set ``retriever.rerank_stale`` so each search over-retrieves ``over_retrieve * k``
  candidates from the stale index and reranks them with the current passage tower (Atlas); a schedule,
  if given, still rebuilds now and then.

Steps are ``trainer.global_step``; a refresh is due once ``interval`` steps have passed since the last.
Each refresh logs ``index_refresh/seconds`` (wall time of the re-encode + rebuild) and
``index_refresh/topk_overlap`` (mean fraction of a fixed probe set's top-k rows kept by the refresh).

Multi-process: every rank re-encodes and rebuilds its own index (no shared file system needed, and it
is the path a sharded tower needs, where every rank must take part in each forward), then the ranks'
index fingerprints are compared and a mismatch raises.
"""

from __future__ import annotations

import time
from typing import Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from bridge_pl.config import require_choice
from bridge_pl.retrieval.dense import DenseRetriever
from bridge_pl.retrieval.index import topk_overlap

RefreshStrategy = Literal["rebuild", "rerank"]


class IndexRefresh(pl.Callback):
    """Re-encode + rebuild the dense index on a schedule while the passage tower trains.

    Args:
        every_n_steps: refresh interval in trainer steps.
        schedule: piecewise intervals ``[[start_step, every_n], ...]`` (instead of ``every_n_steps``).
        strategy: ``"rebuild"`` or ``"rerank"`` (module docstring).
        over_retrieve: candidates per wanted passage for ``"rerank"``.
        probe_queries: fixed queries for the top-k overlap metric; default: the titles of the first
            ``probe_size`` passages.
        probe_size / probe_k: size of the default probe set and its ``k``.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        schedule: list[list[int]] | None = None,
        strategy: RefreshStrategy = "rebuild",
        over_retrieve: int = 4,
        probe_queries: list[str] | None = None,
        probe_size: int = 32,
        probe_k: int = 10,
    ) -> None:
        require_choice("IndexRefresh option 'strategy'", strategy, RefreshStrategy)
        if every_n_steps is not None and schedule is not None:
            raise ValueError("IndexRefresh: give either 'every_n_steps' or 'schedule', not both")
        if strategy == "rebuild" and every_n_steps is None and schedule is None:
            raise ValueError("IndexRefresh(strategy='rebuild') needs 'every_n_steps' or 'schedule'")
        if every_n_steps is not None:
            schedule = [[0, every_n_steps]]
        self.schedule = self._check_schedule(schedule or [])
        self.strategy = strategy
        if over_retrieve < 1 or probe_size < 1 or probe_k < 1:
            raise ValueError("IndexRefresh options 'over_retrieve', 'probe_size' and 'probe_k' must be >= 1")
        self.over_retrieve = over_retrieve
        self.probe_queries = probe_queries
        self.probe_size = probe_size
        self.probe_k = probe_k
        self.retriever: DenseRetriever | None = None  # set in on_train_start when the callback has work
        self.last_refresh_step = 0
        self.refreshes = 0
        self._said_noop = False
        self._resumed = False  # state restored from a checkpoint (load_state_dict)

    @staticmethod
    def _check_schedule(schedule: list[list[int]]) -> list[tuple[int, int]]:
        out = []
        for entry in schedule:
            if len(entry) != 2 or entry[0] < 0 or entry[1] < 1:
                raise ValueError(f"IndexRefresh 'schedule' entries must be [start_step >= 0, every_n >= 1], "
                                 f"got {entry!r}")
            out.append((int(entry[0]), int(entry[1])))
        if [s for s, _ in out] != sorted({s for s, _ in out}):
            raise ValueError(
                f"IndexRefresh 'schedule' start steps must be strictly increasing, got {schedule!r}"
            )
        return out

    def interval(self, step: int) -> int | None:
        """Refresh interval in force at ``step`` (``None``: no refreshes yet / at all)."""
        current = None
        for start, every_n in self.schedule:
            if step >= start:
                current = every_n
        return current

    def due(self, step: int) -> bool:
        interval = self.interval(step)
        return interval is not None and step - self.last_refresh_step >= interval

    # ---- hooks --------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not on_fit_start: by now a resumed run has its weights and global_step back.
        retriever = getattr(pl_module, "retriever", None)
        reason = None
        if not isinstance(retriever, DenseRetriever):
            reason = f"the retriever ({type(retriever).__name__}) is not a DenseRetriever"
        elif not retriever.passage_tower_trains:
            reason = "the passage tower is frozen (query-side training), so the index never goes stale"
        if reason is not None:
            if not self._said_noop:
                rank_zero_info(f"IndexRefresh does nothing: {reason}.")
                self._said_noop = True
            self.retriever = None
            return
        self.retriever = retriever
        if self.strategy == "rerank":
            retriever.rerank_stale, retriever.rerank_factor = True, self.over_retrieve
        else:
            retriever.allow_stale = True
        if self._resumed:
            # The checkpoint restored the index as it was (BridgeModule keeps the weights it was encoded
            # with) and this callback's schedule: carry on exactly as the interrupted run would have.
            pass
        elif retriever.index.fingerprint != retriever.fingerprint():  # e.g. weights loaded from an adapter
            rank_zero_info("IndexRefresh: the index predates the passage tower's weights; rebuilding it now.")
            retriever.refresh_index()
        if self.probe_queries is None:
            self.probe_queries = [p.title or p.text[:200] for p in retriever.passages[: self.probe_size]]
        if not self._resumed:
            self.last_refresh_step = trainer.global_step

    def state_dict(self) -> dict[str, int]:
        return {"last_refresh_step": self.last_refresh_step, "refreshes": self.refreshes}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.last_refresh_step, self.refreshes = state_dict["last_refresh_step"], state_dict["refreshes"]
        self._resumed = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if self.retriever is not None and self.due(trainer.global_step):
            self.refresh(trainer, pl_module)

    def refresh(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Re-encode + rebuild now, check the ranks agree, and log time and probe top-k overlap."""
        assert self.retriever is not None and self.probe_queries is not None
        k = min(self.probe_k, len(self.retriever.passages))
        _, before = self.retriever.search(self.probe_queries, k)
        start = time.perf_counter()
        self.retriever.refresh_index()
        seconds = time.perf_counter() - start
        _, after = self.retriever.search(self.probe_queries, k)
        fingerprint = self.retriever.index.fingerprint
        if trainer.world_size > 1 and trainer.strategy.broadcast(fingerprint, src=0) != fingerprint:
            raise RuntimeError(
                f"IndexRefresh: rank {trainer.global_rank} built index {fingerprint!r}, unlike rank 0; "
                "the passage towers differ across ranks"
            )
        self.last_refresh_step = trainer.global_step
        self.refreshes += 1
        pl_module.log("index_refresh/seconds", seconds, on_step=True, on_epoch=False)
        pl_module.log("index_refresh/topk_overlap", topk_overlap(before, after), on_step=True, on_epoch=False)

