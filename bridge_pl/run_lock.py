"""One run per directory: ``<default_root_dir>/.bridge-pl.lock``, held (``flock``) for the life of the process.

The file names its holder (pid, host, start time, command). The operating system drops the lock when the process
ends, however it ends, so the lock of a killed run is stale by construction: the next run takes it over and says so.

:func:`write_problem` checks, before any model loads, that a run can write where it will write.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from bridge_pl.files import umask_mode

LOCK_NAME = ".bridge-pl.lock"


class RunDirectoryInUse(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""


class FolderNotWritable(OSError):
    """A folder a run writes to that does not take files; the message names it and why."""


def write_problem(folder: str | Path) -> str | None:
    """Why files cannot be created in ``folder`` (or, while it does not exist, in the nearest existing folder above
    it, where it would be created), naming that folder and the reason; None when they can. The check creates an
    unnamed temp file there (nothing is left behind)."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot write to {folder}: {existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = os.strerror(error.errno).lower() if error.errno else str(error)
        return f"cannot write to {existing}: {reason}"
    return None


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {when}"


class RunLock:
    """Holds ``folder``'s lock from :meth:`acquire` until :meth:`release` or the end of the process."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns a note when it took over the lock of a run that ended without releasing it.

        Raises:
            RunDirectoryInUse: another live process holds it (the message names its pid and start time).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, umask_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise RunDirectoryInUse(
                f"run directory {self.path.parent} is in use by another bridge-pl run ({_describe(holder)}; lock "
                f"file {self.path}); wait for it to end or set another trainer.default_root_dir") from None
        previous = self._holder(fd)
        note = None
        if previous.get("pid") is not None and not previous.get("released"):
            note = (f"took over the lock of {self.path.parent} from a run that ended without releasing it "
                    f"({_describe(previous)})")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        return note

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            holder = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
        except ValueError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def release(self) -> None:
        """Mark the lock released and drop it (the file stays: removing it would let two runs lock two files)."""
        if self._fd is None:
            return
        holder = self._holder(self._fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps({**holder, "released": True}).encode(), 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
