"""``BridgeProgressBar``: a progress bar whose postfix shows chosen logged metrics (reward, val EM, ...), and plain
progress lines where there is no terminal.

A ``RichProgressBar`` when ``rich`` is installed, else a ``TQDMProgressBar``. Both draw only on a terminal (the
rule of ``bridge_pl.terminal``): when stdout is a pipe or a file (``make demo > demo.log``, a job scheduler's log)
the bar is turned off and one line is printed per training iteration and per evaluation instead. Use it in YAML as
``trainer.callbacks: [{class_path: callbacks.progress.BridgeProgressBar}]``.
"""

from __future__ import annotations

import re
import time

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache

from bridge_pl.terminal import plain_line, stdout_is_terminal

_BASE = RichProgressBar if RequirementCache("rich") else TQDMProgressBar
_DATASET_EM = re.compile(r"^(val|test)/([^/]+)/em$")  # one dataset's EM, not the mean over datasets or by type


class BridgeProgressBar(_BASE):
    """Shows ``metrics`` (any names logged so far, e.g. ``reward``, ``val/em``, ``miss/retrieval_miss_rate``).

    Without a terminal it prints instead, per iteration, ``iteration i/N: reward R, groups with signal G, S s``
    (S: seconds since the previous line, the rollout included) and, per evaluation, each dataset's EM and the seconds
    it took.

    Args:
        metrics: logged metric names to show, in order; a name not logged yet is left out.
        plain: print plain lines instead of drawing a bar; default: when stdout is not a terminal.
        **kwargs: passed to the base progress bar.
    """

    def __init__(self, metrics: list[str] | None = None, plain: bool | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.metrics = list(metrics) if metrics is not None else ["reward", "val/em"]
        self.plain = not stdout_is_terminal() if plain is None else plain
        self._started = time.perf_counter()
        if self.plain:
            self.disable()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        logged = {**trainer.callback_metrics, **trainer.progress_bar_metrics}
        return {name: float(logged[name]) for name in self.metrics if name in logged}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started = time.perf_counter()  # an iteration's seconds include its rollout, made as its batch arrives

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.plain:
            plain_line(iteration_line(trainer.global_step, trainer.max_steps, trainer.callback_metrics,
                                      time.perf_counter() - self._started))
            self._started = time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._started = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not trainer.sanity_checking:
            self._evaluated(trainer, "val", f"validation after iteration {trainer.global_step}")
        self._started = time.perf_counter()

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_test_start(trainer, pl_module)
        self._started = time.perf_counter()

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_test_end(trainer, pl_module)
        self._evaluated(trainer, "test", f"test at iteration {trainer.global_step}")

    def _evaluated(self, trainer: L.Trainer, stage: str, what: str) -> None:
        if self.plain:
            plain_line(evaluation_line(stage, what, trainer.callback_metrics, time.perf_counter() - self._started))


def iteration_line(done: int, total: int, metrics: dict, seconds: float) -> str:
    """``iteration 3/8: reward 0.438, groups with signal 0.75, 91.2 s`` (``total`` < 0: no step limit, left out)."""
    of = f"/{total}" if total > 0 else ""
    parts = [f"{label} {float(metrics[key]):.3f}" for key, label in
             (("train/reward", "reward"), ("train/groups_with_signal", "groups with signal")) if key in metrics]
    return f"iteration {done}{of}: " + ", ".join([*parts, f"{seconds:.1f} s"])


def evaluation_line(stage: str, what: str, metrics: dict, seconds: float) -> str:
    """``validation after iteration 4: world_dev EM 0.260, 45.0 s``: each dataset's EM logged under ``stage``
    (``val`` or ``test``)."""
    ems = [f"{match[2]} EM {float(value):.3f}" for key, value in sorted(metrics.items())
           if (match := _DATASET_EM.match(key)) and match[1] == stage]
    return f"{what}: " + ", ".join([*ems, f"{seconds:.1f} s"])
