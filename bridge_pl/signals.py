"""SIGTERM, SIGINT (Ctrl-C) and SIGHUP: stop at the next safe point, exit 143 / 130 / 129 naming the checkpoint.

Lightning notes a SIGTERM and stops its loops at the next batch boundary by raising ``SIGTERMException`` (a
``SystemExit`` without a code, which would read as success); :class:`StopOnSignal` routes SIGINT the same way, saves
``last.ckpt`` at the end of the iteration when checkpointing is on, and tells ``bridge-pl`` (:func:`exit_line`) what
to print and which status to exit with. An iteration that a validation follows is not saved before that validation
(a resume would skip it, as ``callbacks.ValidatedCheckpoint`` explains): the run then stops at the newest whole
checkpoint, and a resume redoes the iteration. A second Ctrl-C stops at once, without a checkpoint.

A rollout in progress is abandoned at its next turn or decode step (``bridge_pl.rollout.engine.STOP_ROLLOUT``, which
raises ``RolloutAbandoned``), so that a long one does not hold up the stop: in a single-process run on the first
signal, with several processes on a second one (below). The iteration it belonged to is not saved; the run stops at
the newest whole checkpoint, which the exit line names, and a resume redoes that iteration.

With several processes the ranks decide together: a signal only marks the rank that got it, and at each iteration's
end (and after each validation) the ranks reduce their marks, so a signal that reaches one rank, or the ranks at
different moments, stops every rank at the same iteration with the same checkpoint. A validation is not cut short
(ranks may hold different numbers of evaluation batches, so there is no earlier point they all pass): a signal
before or during one stops the run when it ends, after the checkpoint callbacks have saved its iteration; a
``validate`` or ``test`` command then exits as stopped. A rank that abandoned a rollout would leave the others
waiting for it at their next collective, so the first signal never does: only a second SIGTERM or SIGHUP abandons the
rollout in progress, on the rank it reaches (send it to every rank, as a terminal's Ctrl-C and a scheduler do).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from bridge_pl.checkpoint_io import checkpoint_problem, newest_first, validation_follows
from bridge_pl.distributed import max_across_ranks
from bridge_pl.rollout.engine import STOP_ROLLOUT, RolloutAbandoned

_HANDLED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class StopOnSignal(pl.Callback):
    """Turns SIGTERM / SIGINT / SIGHUP into a stop at the next iteration boundary with a checkpoint, or at the
    rollout in progress's next turn without one (see the module doc)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the signal that stops the run (this rank's, or another's once agreed)
        self.received = 0  # signals this process got
        self.saved: Path | None = None
        self._trainer: pl.Trainer | None = None
        self._previous: dict[int, object] = {}

    def _install(self, trainer: pl.Trainer) -> None:
        # after Lightning registers its SIGTERM handler (which this one calls), so that Lightning's teardown
        # restores the handlers from before both
        if self._previous:
            return
        self._trainer = trainer
        STOP_ROLLOUT.clear()
        for signum in _HANDLED:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler)
        self._previous = {}
        STOP_ROLLOUT.clear()

    def _handle(self, signum: int, frame) -> None:
        self.received += 1
        second = self.received > 1
        if signum == signal.SIGINT and second:  # a second Ctrl-C: stop now
            sys.stderr.write("bridge-pl: interrupted again (Ctrl-C): stopped at once, nothing more was saved\n")
            raise SystemExit(128 + signum)
        self.signum = self.signum or signum
        if self._trainer is None:
            return
        alone = self._trainer.world_size == 1
        if alone or second:
            STOP_ROLLOUT.request(self.signum)  # the rollout in progress ends at its next turn or decode step
        if not second:
            _say(f"got {signal.Signals(signum).name}: " + (
                "stopping at the next safe point (a rollout in progress ends at its next step)" if alone else
                "every rank stops when this iteration ends (a second signal abandons the rollout in progress)"))
        if not alone:
            return  # the ranks decide together (_agree); Lightning's handler would run a collective in here
        previous = self._previous.get(signum)
        if signum == signal.SIGTERM and callable(previous):
            previous(signum, frame)  # Lightning's (and what was installed before it)
        self._trainer._signal_connector.received_sigterm = True  # Lightning's own stop at the batch boundary

    def _agree(self, trainer: pl.Trainer) -> bool:
        """Whether any rank got a signal (a collective with several processes); a rank that got none takes the
        others' signal for its exit status."""
        signum = max_across_ranks(self.signum or 0)
        self.signum = self.signum or signum or None
        return bool(signum)

    def _stop(self, trainer: pl.Trainer) -> None:
        trainer._signal_connector.received_sigterm = True  # Lightning stops at its next check, on every rank alike

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # the point where checkpoint callbacks save an iteration (a state a resume continues exactly)
        if not self._agree(trainer):
            return
        if validation_follows(trainer):
            if trainer.world_size > 1:
                return  # stops when the validation ends (on_validation_end), which saves this iteration
            self._stop(trainer)  # one process: the validation stops at its next batch; nothing saved here
            return
        self._stop(trainer)
        callback = trainer.checkpoint_callback
        if callback is not None and getattr(callback, "dirpath", None) is not None:
            self.saved = Path(callback.dirpath) / "last.ckpt"
            trainer.save_checkpoint(self.saved)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # several processes: in a fit, Lightning stops after this validation (its checkpoint callbacks save it
        # first); a validate command has no later check, so it stops here
        if trainer.world_size > 1 and self._agree(trainer):
            self._stop(trainer)
            if trainer.state.fn != TrainerFn.FITTING:
                raise SIGTERMException

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1 and self._agree(trainer):
            raise SIGTERMException

    def on_exception(self, trainer: pl.Trainer, pl_module, exception: BaseException) -> None:
        self._restore()  # Lightning skips the callbacks' teardown after an exception
        if isinstance(exception, (SIGTERMException, RolloutAbandoned)):
            exception.signum = self.signum or signal.SIGTERM
            exception.checkpoint = self.saved or self._newest_whole(trainer)
            exception.checkpointing = trainer.checkpoint_callback is not None
            exception.step = trainer.global_step

    @staticmethod
    def _newest_whole(trainer: pl.Trainer) -> Path | None:
        callback = trainer.checkpoint_callback
        folder = Path(callback.dirpath) if callback is not None and callback.dirpath else None
        if folder is None or not folder.is_dir():
            return None
        return next((p for p in newest_first(folder) if checkpoint_problem(p) is None), None)


def _say(message: str) -> None:
    """Write ``bridge-pl: message`` to stderr from a signal handler (unbuffered: the handler may interrupt a write
    to the buffered stream)."""
    os.write(2, f"bridge-pl: {message}\n".encode())


def exit_line(stop: SIGTERMException | RolloutAbandoned, argv: list[str]) -> tuple[str, int]:
    """``(the one line to print, the exit status 128 + signal number)`` for a run stopped by a signal."""
    signum = getattr(stop, "signum", signal.SIGTERM)
    name = signal.Signals(signum).name
    command = argv[:1]
    stopped = f"stopped by {name} at step {getattr(stop, 'step', '?')}"
    if command != ["fit"]:
        return f"bridge-pl: {stopped}; nothing to resume", 128 + signum
    checkpoint = getattr(stop, "checkpoint", None)
    if not getattr(stop, "checkpointing", False):
        return (f"bridge-pl: {stopped}; checkpointing is off (trainer.enable_checkpointing), nothing was saved",
                128 + signum)
    if checkpoint is None:
        return f"bridge-pl: {stopped}; no checkpoint was written yet, a rerun starts from the beginning", 128 + signum
    args = [a for i, a in enumerate(argv)
            if not a.startswith("--ckpt_path") and (i == 0 or argv[i - 1] != "--ckpt_path")]
    resume = shlex.join(["bridge-pl", *args, "--ckpt_path=last"])
    return f"bridge-pl: {stopped}; checkpoint {checkpoint}; resume with: {resume}", 128 + signum
