"""Process memory as the kernel and glibc see it, and a ledger of it per phase (Linux; elsewhere the readings are
missing, not wrong).

Readings (bytes):

- ``rss()``: the resident set now (``VmRSS`` of ``/proc/self/status``);
- ``peak_rss()``: the kernel's high-water mark of it (``VmHWM``), since the process started or since the last
  ``reset_peak()`` (writing ``5`` to ``/proc/self/clear_refs``, which sets the mark to the current RSS);
- ``heap()``: glibc's ``mallinfo2()`` summed over its arenas: ``in_use`` (``uordblks + hblkhd``: live ``malloc``
  blocks, mmapped ones included), ``free`` (``fordblks``: freed blocks the arenas keep instead of returning them to the
  OS; an upper bound on what a ``malloc_trim(0)`` would give back, since trimming cannot return a page holding part
  of a live block), ``mmapped`` (``hblkhd``) and ``arena`` (bytes the arenas took from the OS). What RSS holds beyond
  ``in_use + free`` is not glibc's heap: file-backed mappings (loaded libraries, memory-mapped weights and indexes),
  Python's own small-object arenas, thread stacks, and whatever a library maps itself;
- ``release_heap()``: ``gc.collect()`` then glibc's ``malloc_trim(0)``; the RSS after. It changes what later code
  sees (the freed pages must be faulted in again), so a measurement calls it only when asked.

:class:`PhaseLedger` charges memory to named phases that a caller opens and closes, nested or in sequence: at each
boundary the high-water mark since the previous boundary goes to the phase that ran until then, and the mark is
reset. ``benchmarks/iteration_bench.py`` and ``callbacks.MemoryAccount`` use these readings.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GIB = 2**30


def status_kb(name: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...); OSError where there is none."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {name}")


def rss() -> int | None:
    """Resident set size in bytes; None where ``/proc`` has no reading."""
    try:
        return status_kb("VmRSS") * 1024
    except OSError:
        return None


def peak_rss() -> int | None:
    """The kernel's RSS high-water mark in bytes (since start or the last :func:`reset_peak`); None without one."""
    try:
        return status_kb("VmHWM") * 1024
    except OSError:
        return None


def reset_peak() -> bool:
    """Set the kernel's RSS high-water mark to the current RSS (Linux); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        status_kb("VmHWM")
        return True
    except OSError:
        return False


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    with contextlib.suppress(OSError):
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return None


_LIBC = _libc()


def heap() -> dict[str, int] | None:
    """glibc's ``mallinfo2()`` (all arenas): ``in_use``, ``free``, ``mmapped``, ``arena`` in bytes (module doc);
    None without glibc 2.33+."""
    fn = getattr(_LIBC, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    info = fn()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks, "mmapped": info.hblkhd,
            "arena": info.arena}


def release_heap() -> int | None:
    """``gc.collect()`` and glibc's ``malloc_trim(0)`` (where there is one); the RSS in bytes after."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
    return rss()


@dataclass
class PhaseRecord:
    """One run of a phase (bytes, seconds). ``peak``: the highest RSS while it ran (its nested phases excluded);
    ``rss_start`` / ``rss_end``: RSS when it began / ended; ``in_use`` / ``free``: glibc's heap at its end
    (:func:`heap`); ``rss_released``: RSS after :func:`release_heap` at its end (only when the ledger releases);
    ``info``: what the caller attached (e.g. a batch's shape)."""

    phase: str
    index: int  # the how-many-th run of this phase, from 0
    step: int | None = None
    start: float = 0.0  # seconds since the ledger started
    seconds: float = 0.0
    rss_start: int | None = None
    peak: int | None = None
    rss_end: int | None = None
    in_use: int | None = None
    free: int | None = None
    rss_released: int | None = None
    info: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class PhaseLedger:
    """Memory per phase: :meth:`enter` / :meth:`leave` a nested phase, :meth:`switch` the bottom one.

    Every moment belongs to the innermost open phase; a phase that a nested one interrupts resumes after it, in the
    same record. At each boundary the kernel's high-water mark is read (charged to the phase that ran until then)
    and reset. The bottom phase starts as ``first``; its high-water mark is not reset at construction, so ``first``'s
    peak counts from the start of the process. ``release``: call :func:`release_heap` at the end of every phase
    (this changes what later phases see; off by default).
    """

    def __init__(self, first: str = "setup", release: bool = False) -> None:
        self.release = release
        self.records: list[PhaseRecord] = []
        self._t0 = time.perf_counter()
        self._counts: dict[str, int] = {}
        self._stack: list[PhaseRecord] = [self._open(first, None)]
        self._resets = True  # whether reset_peak works (known after the first boundary)
        self._segment_start = time.perf_counter()

    @property
    def current(self) -> str:
        """The innermost open phase."""
        return self._stack[-1].phase

    @property
    def innermost(self) -> PhaseRecord:
        """The record of the innermost open phase (its ``info`` may still be added to)."""
        return self._stack[-1]

    def _open(self, phase: str, step: int | None) -> PhaseRecord:
        index = self._counts.get(phase, 0)
        self._counts[phase] = index + 1
        return PhaseRecord(phase, index, step, start=time.perf_counter() - self._t0, rss_start=rss())

    def _boundary(self) -> None:
        """Charge the high-water mark and time since the last boundary to the innermost open phase; reset."""
        now = time.perf_counter()
        record = self._stack[-1]
        record.seconds += now - self._segment_start
        mark = peak_rss() if self._resets else rss()
        if mark is not None:
            record.peak = mark if record.peak is None else max(record.peak, mark)
        self._resets = reset_peak()
        self._segment_start = time.perf_counter()

    def _close(self, record: PhaseRecord) -> PhaseRecord:
        record.rss_end = rss()
        if (info := heap()) is not None:
            record.in_use, record.free = info["in_use"], info["free"]
        if self.release:
            record.rss_released = release_heap()
            reset_peak()  # the next phase starts from the released RSS
        self.records.append(record)
        return record

    def enter(self, phase: str, step: int | None = None) -> None:
        """Open ``phase`` inside the current one."""
        self._boundary()
        self._stack.append(self._open(phase, step))

    def leave(self, info: dict | None = None, keep: bool = True) -> PhaseRecord | None:
        """Close the innermost phase (``info`` attached to its record) and return its record; the one it interrupted
        resumes. ``keep=False``: no record; its time and peak go to the phase it interrupted."""
        if len(self._stack) == 1:
            raise RuntimeError("PhaseLedger.leave: no nested phase is open")
        self._boundary()
        record = self._stack.pop()
        if not keep:
            outer = self._stack[-1]
            outer.seconds += record.seconds
            if record.peak is not None:
                outer.peak = record.peak if outer.peak is None else max(outer.peak, record.peak)
            self._counts[record.phase] -= 1
            return None
        record.info.update(info or {})
        self._close(record)
        self._segment_start = time.perf_counter()  # the close's own reading is nobody's time
        return record

    @property
    def depth(self) -> int:
        """Open phases, the bottom one included (0 once finished)."""
        return len(self._stack)

    def switch(self, phase: str, step: int | None = None) -> PhaseRecord | None:
        """Close the bottom phase and open ``phase`` in its place (nothing if it is ``phase`` already); the closed
        record. Only when no nested phase is open."""
        if len(self._stack) != 1:
            raise RuntimeError(f"PhaseLedger.switch({phase!r}) inside {self.current!r}")
        if self._stack[0].phase == phase:
            return None
        self._boundary()
        record = self._close(self._stack[0])
        self._stack[0] = self._open(phase, step)
        self._segment_start = time.perf_counter()
        return record

    def finish(self) -> list[PhaseRecord]:
        """Close every open phase (innermost first); all records, in the order they closed."""
        while len(self._stack) > 1:
            self.leave()
        self._boundary()
        self._close(self._stack[0])
        self._stack = []
        return self.records

    @property
    def finished(self) -> bool:
        return not self._stack
