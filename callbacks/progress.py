"""``BridgeProgressBar``: a progress bar whose postfix shows chosen logged metrics (reward, val EM, ...).

A ``RichProgressBar`` when ``rich`` is installed, else a ``TQDMProgressBar``. Use it in YAML as
``trainer.callbacks: [{class_path: callbacks.progress.BridgeProgressBar}]``.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache

_BASE = RichProgressBar if RequirementCache("rich") else TQDMProgressBar


class BridgeProgressBar(_BASE):
    """Shows ``metrics`` (any names logged so far, e.g. ``reward``, ``val/em``, ``credit/retrieval_miss_rate``).

    Args:
        metrics: logged metric names to show, in order; a name not logged yet is left out.
        **kwargs: passed to the base progress bar.
    """

    def __init__(self, metrics: list[str] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.metrics = list(metrics) if metrics is not None else ["reward", "val/em"]

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        logged = {**trainer.callback_metrics, **trainer.progress_bar_metrics}
        return {name: float(logged[name]) for name in self.metrics if name in logged}
