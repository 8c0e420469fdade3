"""``MissReport``: why trajectories fail, retrieval miss vs reasoning miss, per training step and eval set.

Definitions and rates are those of :mod:`bridge_pl.miss_analysis` (failure attribution; "credit" in this repo is
the LM credit of candidate passages, which this report does not use). Logged names:

- every training step, over that step's rollout batch on all ranks: ``miss/failure_rate``,
  ``miss/retrieval_miss_rate``, ``miss/reasoning_miss_rate``, ``miss/gold_id_share``, ``miss/recall@k``;
- after each val/test epoch, per named dataset: ``<stage>/<dataset>/miss/<same names>``.

``gold_id_share`` records the method: 1 = every failed trajectory was judged by gold passage ids, 0 = all by
the gold-answer string in the retrieved text. A rate whose denominator is 0 (no failures; no gold ids for
recall) is not logged. Counts are summed across processes before dividing, so the rates are those of all
ranks' trajectories pooled.

``CreditReport`` is this callback's former name (it logged under ``credit/``), kept so configs that name
``callbacks.CreditReport`` still load; it warns and logs the ``miss/`` names.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from bridge_pl.miss_analysis import MissCounts, batch_verdicts
from bridge_pl.rollout.batch import RolloutBatch
from callbacks.qa_eval import eval_dataset_names


class MissReport(L.Callback):
    """Logs retrieval-miss / reasoning-miss rates and recall@k of gold passages.

    Args:
        log_train: log per training step (one small all-reduce per step under several processes).
        log_eval: log per val/test dataset after each eval epoch.
    """

    def __init__(self, log_train: bool = True, log_eval: bool = True) -> None:
        self.log_train, self.log_eval = log_train, log_eval
        self.last: dict[str, MissCounts] = {}  # "miss" / "<stage>/<dataset>" -> latest all-rank counts
        self.methods: dict[str, str] = {}  # "<stage>/<dataset>" -> gold_passages | answer_string | mixed

    @staticmethod
    def _pooled(trainer: L.Trainer, pl_module: L.LightningModule, counts: MissCounts) -> MissCounts:
        summed = trainer.strategy.reduce(counts.to_tensor(pl_module.device), reduce_op="sum")
        return MissCounts.from_tensor(summed)

    def _log(self, pl_module: L.LightningModule, prefix: str, counts: MissCounts, **kwargs) -> None:
        for name, value in counts.rates().items():
            pl_module.log(f"{prefix}/{name}", value, sync_dist=False, **kwargs)  # already pooled

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.log_train:
            return
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"MissReport needs RolloutBatch training batches, got {type(batch).__name__}")
        local = MissCounts.of(batch_verdicts(batch, pl_module.retriever.passage))
        counts = self.last["miss"] = self._pooled(trainer, pl_module, local)
        self._log(pl_module, "miss", counts, batch_size=batch.batch_size)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.log_eval and not trainer.sanity_checking:
            self.report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.log_eval:
            self.report(trainer, pl_module, "test")

    def report(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Pool and log the miss counts of every named ``stage`` dataset (a collective)."""
        for name in eval_dataset_names(trainer, pl_module, stage):
            key = f"{stage}/{name}"
            local = MissCounts()
            for batch in pl_module.last_eval_batches.get(key, []):
                local += MissCounts.of(batch_verdicts(batch, pl_module.retriever.passage))
            counts = self.last[key] = self._pooled(trainer, pl_module, local)
            self._log(pl_module, f"{key}/miss", counts)
            if counts.failed:
                share = counts.judged_by_gold_ids / counts.failed
                method = "gold_passages" if share == 1 else "answer_string" if share == 0 else "mixed"
                if self.methods.get(key) != method:
                    rank_zero_info(f"MissReport: {key} failures judged by {method}")
                self.methods[key] = method


class CreditReport(MissReport):
    """Deprecated: the former name of :class:`MissReport` (kept so configs naming ``callbacks.CreditReport`` load)."""

    def __init__(self, log_train: bool = True, log_eval: bool = True) -> None:
        rank_zero_warn("callbacks.CreditReport is now callbacks.MissReport, and logs under miss/ (not credit/); "
                       "rename it in your config", category=FutureWarning)
        super().__init__(log_train, log_eval)
