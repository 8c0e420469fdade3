"""What reaches the user's screen while work runs: a progress bar on a terminal, plain lines without one.

The rule, everywhere in bridge-pl: a bar is drawn only when stdout is a terminal. When stdout is a pipe or a file
(``bridge-pl fit ... > run.log``, a job scheduler's log), work that takes a while prints plain lines instead, and
third-party bars (Hugging Face's "Loading weights") are turned off.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from lightning.pytorch.utilities import rank_zero_only


def stdout_is_terminal() -> bool:
    """Whether progress bars can draw: stdout is a terminal (not a pipe, a file or a scheduler's log)."""
    return sys.stdout.isatty()


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (the one process of a single-process run)."""
    return getattr(rank_zero_only, "rank", 0) == 0


@rank_zero_only
def plain_line(text: str) -> None:
    """Print one progress line on stdout, flushed at once (rank 0 only)."""
    print(text, flush=True)


class Progress:
    """Counts done/total with rate and ETA: a tqdm bar when ``stream`` is a terminal, else one plain line on
    ``stream`` every ``every_s`` seconds and one when the count reaches the total. ``stream`` defaults to stderr;
    with ``sys.stdout`` it follows the module's rule (a bar exactly when stdout is a terminal)."""

    def __init__(self, total: int, desc: str, unit: str, stream: TextIO | None = None, every_s: float = 10.0,
                 enabled: bool = True) -> None:
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.stream = stream or sys.stderr
        self.done = self._counted = 0
        self._start = self._last = time.monotonic()
        self._bar = None
        self.enabled = enabled
        if enabled and self.stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream)

    def skip(self, n: int) -> None:
        """``n`` items already done by an earlier run (not counted in the rate)."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def update(self, n: int) -> None:
        self.done += n
        self._counted += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.every_s or self.done >= self.total):
            self._last = now
            self.stream.write(self.line(now - self._start) + "\n")
            self.stream.flush()

    def line(self, elapsed: float) -> str:
        """``"desc: done/total unit (pct), rate unit/s, ETA h:mm:ss"``."""
        rate = self._counted / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left == left else "?"
        pct = 100.0 * self.done / max(self.total, 1)
        return (f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({pct:.1f}%), "
                f"{rate:,.1f} {self.unit}/s, ETA {eta}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def hf_bars_on_terminal_only() -> Iterator[None]:
    """Hugging Face's progress bars (transformers' "Loading weights", the hub's) off while the block runs when stdout
    is not a terminal (``transformers.utils.logging.disable_progress_bar``), back on after it. Hugging Face's own
    switch decides where it is set: ``HF_HUB_DISABLE_PROGRESS_BARS=1`` keeps them off on a terminal too, ``=0``
    keeps them on without one."""
    from huggingface_hub import constants
    from transformers.utils import logging as hf_logging

    turn_off = (not stdout_is_terminal() and constants.HF_HUB_DISABLE_PROGRESS_BARS is None
                and hf_logging.is_progress_bar_enabled())
    if turn_off:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if turn_off:
            hf_logging.enable_progress_bar()
