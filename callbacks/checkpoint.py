"""``ValidatedCheckpoint``: Lightning's ``ModelCheckpoint`` whose iteration-triggered save waits for the validation
that follows the same iteration.

Why: Lightning counts the validation after an iteration as done once that iteration is checkpointed, so a run
resumed (``--ckpt_path last``) from a checkpoint written before its validation never runs that validation, and its
dev point (``val/<dev>/em`` at that step, the curve the demo and ``compare_modes`` report) is lost. Written after the
validation instead, the checkpoint holds that point, and a crash during the validation resumes from the previous
checkpoint and does the iteration and the validation again. Checkpoint callbacks run last among the callbacks
(Lightning orders them so), so every callback's validation state is in the file.

Everything else is ``ModelCheckpoint``'s (``every_n_train_steps``, ``save_last``, ``save_top_k``, ``monitor``,
``--ckpt_path last``); a monitored ``val/...`` metric is available at every save that follows a validation.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from bridge_pl.checkpoint_io import validation_follows


def option_problem(keep_last: object, monitor: object) -> str | None:
    """What is wrong with :class:`ValidatedCheckpoint`'s ``keep_last`` (with its ``monitor``), naming the option and
    the values it takes; None when it is fine."""
    if keep_last is None:
        return None
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        return (f"option keep_last must be an integer >= 1 (the newest N iteration checkpoints kept) or null "
                f"(ModelCheckpoint's own save_top_k), got {keep_last!r}")
    if monitor not in (None, "step"):
        return ("options keep_last and monitor exclude each other (keep_last monitors the step; got "
                f"monitor={monitor!r})")
    return None


class ValidatedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) that saves an iteration followed by a validation after that validation.

    Args:
        keep_last: keep the newest N iteration checkpoints (besides ``last.ckpt``), so that a resume finding the
            newest damaged falls back to a whole one (``monitor="step"``, ``mode="max"``, ``save_top_k=N``); None:
            ``ModelCheckpoint``'s own ``monitor`` / ``save_top_k``. The CLI checks it with the other options, before
            anything loads (:meth:`init_args_problem`, called by ``bridge_pl.checkpoint_io.callback_problems``).
    """

    @staticmethod
    def init_args_problem(init_args: object) -> str | None:
        """What is wrong with the parsed ``init_args`` of a config entry naming this class (see
        :func:`option_problem`); None when they are fine."""
        return option_problem(getattr(init_args, "keep_last", None), getattr(init_args, "monitor", None))

    def __init__(self, *args, keep_last: int | None = None, **kwargs) -> None:
        if problem := option_problem(keep_last, kwargs.get("monitor")):
            raise ValueError(f"ValidatedCheckpoint {problem}")
        if keep_last is not None:
            kwargs.update(monitor="step", mode="max", save_top_k=keep_last)
        super().__init__(*args, **kwargs)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if not validation_follows(trainer):
            self._save_iteration(trainer, pl_module, batch_idx)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            # the iteration's own save, deferred to here (skipped if this step is saved already)
            self._save_iteration(trainer, pl_module, trainer.fit_loop.epoch_loop.batch_idx)

    def _save_iteration(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        with warnings.catch_warnings():
            # Lightning warns that a manually optimized module is saved after its optimizer step, not before: for an
            # RL iteration that is the state a resumed run must start from
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, None, None, batch_idx)
