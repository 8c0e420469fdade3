"""Files the project writes: atomically (temp file, then rename), with the umask's permissions, and optionally
with a digest beside them that is checked before the file is used."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def umask_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (``0o666 & ~umask``)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """Create ``path`` by ``write(file)`` into a temp file in the same folder, then rename (no torn files).

    The file gets the mode a plain ``open()`` would (``tempfile`` alone makes it 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def digest_path(path: str | Path) -> Path:
    """Where the digest of ``path`` is kept: ``<name>.b2`` beside it."""
    path = Path(path)
    return path.with_name(path.name + ".b2")


def file_digest(path: str | Path) -> str:
    """BLAKE2b hex digest of a file's bytes (read in 16 MiB chunks)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_digest(path: str | Path) -> Path:
    """Write the digest of the existing file ``path`` to :func:`digest_path` (atomically)."""
    digest = file_digest(path)
    return atomic_write(digest_path(path), lambda f: f.write(digest.encode()))


def write_verified(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """:func:`atomic_write`, then a ``<name>.b2`` digest beside it; :func:`is_verified` checks the pair.

    A write killed between the two leaves a file without a digest, which counts as damaged.
    """
    path = atomic_write(path, write)
    write_digest(path)
    return path


def is_verified(path: str | Path) -> bool:
    """Whether ``path`` and its digest (see :func:`write_verified`) exist and agree."""
    path, digest = Path(path), digest_path(path)
    return path.is_file() and digest.is_file() and digest.read_text().strip() == file_digest(path)
