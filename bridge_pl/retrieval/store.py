"""On-disk corpus stores read by offset, so that no process holds the corpus in memory.

- :class:`PassageStore`: the passages as one JSON-lines file ``[id, title, text]`` per line plus an ``int64``
  offsets file ``[N + 1]`` (byte where row ``i`` starts; the last entry is the file size). Row ``i`` is read
  by offset (``pread``): only that line is read, through the page cache that every process opening the same
  files shares.
- :class:`EmbeddingStore`: the passage embeddings ``[N, D]`` as float16, in shards of ``chunk_rows`` rows
  (``emb-00000.f16``, raw little-endian, no header). Rows are read with ``pread`` (a few per query), so
  nothing is mapped into the process and its resident memory does not grow with the rows it has read.

A truncated or missing file is reported by :class:`StoreError` naming it; content digests (``<file>.b2``,
see :func:`bridge_pl.files.write_verified`) are checked by the build (resume) and on request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import overload

import numpy as np

from bridge_pl.files import write_verified
from bridge_pl.records import Passage

PASSAGES_FILE = "passages.jsonl"
OFFSETS_FILE = "passages.offsets.npy"
EMBEDDING_DTYPE = np.dtype("<f2")


class StoreError(ValueError):
    """A store file is missing, truncated or does not match its manifest; the message names the file."""


def write_passage_store(passages: Iterable[Passage], folder: str | Path) -> int:
    """Write ``passages`` (in row order) as ``folder/passages.jsonl`` + offsets; returns the row count.

    Each file is written to a temp file and renamed, with a ``.b2`` digest beside it.
    """
    folder = Path(folder)
    offsets = [0]

    def write_lines(f) -> None:
        for p in passages:
            line = (json.dumps([p.id, p.title, p.text], ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            offsets.append(offsets[-1] + len(line))

    write_verified(folder / PASSAGES_FILE, write_lines)
    write_verified(folder / OFFSETS_FILE, lambda f: np.save(f, np.asarray(offsets, dtype=np.int64)))
    return len(offsets) - 1


def _require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise StoreError(f"{path}: {what} is missing; rebuild it with `bridge-pl index build`")


class PassageStore(Sequence[Passage]):
    """Row-addressed passages read from a store written by :func:`write_passage_store`, by offset.

    Each row costs two ``pread`` calls (its two offsets, then its line): the process keeps no copy and maps
    nothing, so its resident memory does not grow with the rows read (a mapped file would bring in 64 KiB
    around each random read, Linux's fault-around); the page cache shares what was read between processes.

    Args:
        folder: the store's folder.
        rows: the row count the manifest records; a different count in the files is an error.
    """

    def __init__(self, folder: str | Path, rows: int | None = None) -> None:
        folder = Path(folder)
        self.path = folder / PASSAGES_FILE
        offsets_path = folder / OFFSETS_FILE
        _require_file(self.path, "the passage text store")
        _require_file(offsets_path, "the passage offsets file")
        try:
            with open(offsets_path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
                self._data_start = f.tell()
        except (ValueError, OSError) as error:
            raise StoreError(f"{offsets_path}: unreadable offsets file ({error})") from None
        if dtype != np.dtype("<i8") or len(shape) != 1 or shape[0] < 1:
            raise StoreError(f"{offsets_path}: expected a 1-D int64 array of N + 1 offsets, got {dtype} {shape}")
        self._rows = shape[0] - 1
        if rows is not None and self._rows != rows:
            raise StoreError(f"{offsets_path}: holds {self._rows} rows, the manifest says {rows}")
        if offsets_path.stat().st_size != self._data_start + 8 * shape[0]:
            raise StoreError(f"{offsets_path}: {offsets_path.stat().st_size} bytes, expected "
                             f"{self._data_start + 8 * shape[0]} (truncated); rebuild it with `bridge-pl index build`")
        self._offsets_fd = os.open(offsets_path, os.O_RDONLY)
        self._text_fd = os.open(self.path, os.O_RDONLY)
        size, end = self.path.stat().st_size, int(self._offsets(self._rows, 1)[0])
        if end != size:
            raise StoreError(f"{self.path}: {size} bytes, the offsets say {end} (truncated or replaced); "
                             "rebuild it with `bridge-pl index build`")

    def _offsets(self, row: int, count: int) -> np.ndarray:
        raw = os.pread(self._offsets_fd, 8 * count, self._data_start + 8 * row)
        return np.frombuffer(raw, dtype="<i8")

    def __len__(self) -> int:
        return self._rows

    def _row(self, row: int) -> Passage:
        if not -len(self) <= row < len(self):
            raise IndexError(f"passage row {row} out of range for a store of {len(self)}")
        row %= len(self)
        start, end = (int(x) for x in self._offsets(row, 2))
        ident, title, text = json.loads(os.pread(self._text_fd, end - start, start))
        return Passage(ident, title, text)

    @overload
    def __getitem__(self, row: int) -> Passage: ...
    @overload
    def __getitem__(self, row: slice) -> list[Passage]: ...

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [self._row(i) for i in range(*row.indices(len(self)))]
        return self._row(int(row))

    def __iter__(self) -> Iterator[Passage]:
        return (self._row(i) for i in range(len(self)))

    def __reduce__(self):  # copies and pickles reopen the files
        return type(self), (self.path.parent, len(self))

    def __del__(self) -> None:
        for name in ("_offsets_fd", "_text_fd"):
            if (fd := self.__dict__.pop(name, None)) is not None:
                os.close(fd)


def shard_path(folder: str | Path, shard: int) -> Path:
    """``folder/emb-00012.f16``: the file of shard ``shard``."""
    return Path(folder) / f"emb-{shard:05d}.f16"


def write_embedding_shard(folder: str | Path, shard: int, embeddings: np.ndarray) -> Path:
    """Write ``embeddings`` ``[rows, D]`` as float16 shard ``shard`` (atomic, with a ``.b2`` digest)."""
    data = np.ascontiguousarray(embeddings, dtype=EMBEDDING_DTYPE)
    return write_verified(shard_path(folder, shard), lambda f: f.write(data.tobytes()))


class EmbeddingStore:
    """``[N, D]`` float16 passage embeddings in shards of ``chunk_rows`` rows, read by offset.

    Args:
        folder: where the shards are.
        rows / dim / chunk_rows: ``N``, ``D`` and the rows per shard (the last shard may be shorter).
    """

    def __init__(self, folder: str | Path, rows: int, dim: int, chunk_rows: int) -> None:
        self.folder, self.rows, self.dim, self.chunk_rows = Path(folder), rows, dim, chunk_rows
        self.row_bytes = dim * EMBEDDING_DTYPE.itemsize
        self._fds: list[int] = []
        for shard in range(self.shards):
            path = shard_path(folder, shard)
            _require_file(path, f"embedding shard {shard}")
            want = self.shard_rows(shard) * self.row_bytes
            if path.stat().st_size != want:
                raise StoreError(f"{path}: {path.stat().st_size} bytes, expected {want} "
                                 f"({self.shard_rows(shard)} rows x {dim} float16); truncated, rebuild it "
                                 "with `bridge-pl index build`")
            self._fds.append(os.open(path, os.O_RDONLY))

    @property
    def shards(self) -> int:
        return -(-self.rows // self.chunk_rows)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.dim

    def shard_rows(self, shard: int) -> int:
        return min(self.chunk_rows, self.rows - shard * self.chunk_rows)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, rows: np.ndarray | Sequence[int]) -> np.ndarray:
        """``[K, D]`` float32 rows (any order, repeats allowed), each read from its shard by offset."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.rows):
            raise IndexError(f"embedding rows must be in [0, {self.rows}), got {rows.min()}..{rows.max()}")
        uniq, inverse = np.unique(rows, return_inverse=True)
        buf = bytearray(len(uniq) * self.row_bytes)
        for i, row in enumerate(uniq.tolist()):
            shard, within = divmod(row, self.chunk_rows)
            chunk = os.pread(self._fds[shard], self.row_bytes, within * self.row_bytes)
            buf[i * self.row_bytes:(i + 1) * self.row_bytes] = chunk
        out = np.frombuffer(buf, dtype=EMBEDDING_DTYPE).reshape(len(uniq), self.dim)
        return out[inverse].astype(np.float32)

    def shard(self, shard: int) -> np.ndarray:
        """Shard ``shard`` as a ``[rows, D]`` float32 array (read whole)."""
        data = np.fromfile(shard_path(self.folder, shard), dtype=EMBEDDING_DTYPE)
        return data.reshape(-1, self.dim).astype(np.float32)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", ()):
            os.close(fd)
        self._fds = []

    def __reduce__(self):  # copies and pickles reopen the files
        return type(self), (self.folder, self.rows, self.dim, self.chunk_rows)
