"""FAISS inner-product indexes (flat / IVF / HNSW / IVF-PQ) that remember which passage encoder built them.

An index built under one passage-encoder fingerprint and searched under another is *stale*
(docs/method.md section 6): :meth:`DenseIndex.search` raises :class:`StaleIndexError` unless the caller
says the staleness is intended (``allow_stale=True``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import faiss
import numpy as np
import torch

from bridge_pl.config import require_choice
from bridge_pl.files import write_verified

IndexKind = Literal["flat", "ivf", "hnsw", "ivf_pq"]
# The settings each kind uses (the others are ignored by it).
KIND_OPTIONS: dict[str, tuple[str, ...]] = {
    "flat": (), "ivf": ("nlist", "nprobe"), "hnsw": ("hnsw_m", "ef_search", "ef_construction"),
    "ivf_pq": ("nlist", "nprobe", "m", "nbits", "opq"),
}
# Open flags for a saved index: FAISS maps flat codes, IVF lists and HNSW storage from the file (read-only), so
# processes opening one file share its pages instead of each reading a private copy.
MMAP_FLAGS = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


class StaleIndexError(RuntimeError):
    """The index was built with another passage encoder than the one now expected."""


def as_float32(x: np.ndarray | torch.Tensor, name: str = "embeddings") -> np.ndarray:
    """``[N, D]`` float32 C-contiguous numpy view/copy of a numpy array or (any-device) torch tensor."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [N, D] array, got shape {tuple(x.shape)}")
    return x


def topk_overlap(rows_a: torch.Tensor, rows_b: torch.Tensor) -> float:
    """Mean over queries of ``|A_i ∩ B_i| / k`` for two ``[Q, k]`` row sets (padding -1 never counts).

    Against exact rows this is recall@k of an approximate search.
    """
    if rows_a.shape != rows_b.shape or rows_a.dim() != 2:
        raise ValueError(
            f"topk_overlap wants two [Q, k] tensors, got {tuple(rows_a.shape)} and {tuple(rows_b.shape)}"
        )
    kept = [len((set(a.tolist()) & set(b.tolist())) - {-1}) for a, b in zip(rows_a, rows_b, strict=True)]
    return sum(kept) / max(rows_a.numel(), 1)


def default_nlist(n: int) -> int:
    """IVF cells for ``n`` vectors: ``clamp(4 * sqrt(n), 1, n // 39)`` (FAISS wants >= 39 points per cell)."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39))


def default_pq_m(dim: int) -> int:
    """The largest divisor of ``dim`` up to ``dim // 8`` (at least 1): ``ivf_pq``'s default ``m``."""
    return max([m for m in range(1, max(dim // 8, 1) + 1) if dim % m == 0])


def faiss_gpu_available() -> bool:
    """Whether this ``faiss`` build has GPU support and sees at least one GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class DenseIndex:
    """Maximum-inner-product search over ``[N, D]`` float32 embeddings.

    Args:
        dim: embedding width ``D``.
        kind: ``"flat"`` (exact, default; ``4 D`` bytes per vector), ``"ivf"`` (IndexIVFFlat: ``4 D + 8``),
            ``"hnsw"`` (IndexHNSWFlat: ``4 D + 8 hnsw_m``) or ``"ivf_pq"`` (IndexIVFPQ, optionally behind an
            OPQ rotation: ``m * nbits / 8 + 8`` bytes per vector). IVF kinds train on the first vectors added
            (or on :meth:`train`'s sample).
        fingerprint: identifies the passage encoder (and corpus) the vectors came from.
        nlist: IVF cells; default ``clamp(4 * sqrt(N), 1, N // 39)`` (FAISS wants >= 39 points per cell).
        nprobe: IVF cells visited per query (search cost grows with ``nprobe / nlist``).
        m / nbits: ``ivf_pq`` sub-quantizers (must divide ``D``; default the largest divisor of ``D`` up to
            ``D // 8``) and bits per sub-quantizer code (default 8: 256 centroids each).
        opq: ``ivf_pq`` with a learned OPQ rotation before the quantizers (a ``D x D`` float matrix more).
        hnsw_m: HNSW graph degree ``M``.
        ef_search / ef_construction: HNSW beam widths at search / build time.
        device: ``"cuda..."`` puts flat/IVF indexes on all GPUs when FAISS has GPU support;
            HNSW (CPU-only in FAISS) and CPU builds of FAISS stay on the CPU.
    """

    def __init__(
        self,
        dim: int,
        kind: IndexKind = "flat",
        fingerprint: str = "",
        nlist: int | None = None,
        nprobe: int = 32,
        hnsw_m: int = 32,
        ef_search: int = 128,
        ef_construction: int = 80,
        m: int | None = None,
        nbits: int = 8,
        opq: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        require_choice("DenseIndex kind", kind, IndexKind)
        if dim <= 0:
            raise ValueError(f"index dim must be positive, got {dim}")
        self.dim = dim
        self.kind = kind
        self.fingerprint = fingerprint
        self.nlist = nlist
        self.nprobe = nprobe
        self.hnsw_m = hnsw_m
        self.ef_search = ef_search
        self.ef_construction = ef_construction
        self.m = m
        self.nbits = nbits
        self.opq = opq
        self.device = str(device)
        self._cpu: faiss.Index | None = None  # master copy (saved); None until vectors are added
        self._searcher: faiss.Index | None = None  # the CPU index itself or its GPU clone

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def build(cls, embeddings: np.ndarray | torch.Tensor, fingerprint: str = "", **options) -> DenseIndex:
        """A new index over ``embeddings`` ``[N, D]``; ``options`` are the constructor's."""
        emb = as_float32(embeddings)
        index = cls(emb.shape[1], fingerprint=fingerprint, **options)
        index.add(emb)
        return index

    def _new_cpu_index(self, n: int) -> faiss.Index:
        if self.kind == "flat":
            return faiss.IndexFlatIP(self.dim)
        if self.kind == "hnsw":
            index = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.ef_construction
            return index
        nlist = self.nlist or default_nlist(n)
        if nlist > n:
            raise ValueError(f"index option 'nlist'={nlist} is larger than the corpus ({n} passages); "
                             f"use at most {max(1, n // 39)} (FAISS wants >= 39 passages per cell)")
        self.nlist = nlist
        if self.kind == "ivf":
            return faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        m = self.m or default_pq_m(self.dim)
        if m < 1 or self.dim % m:
            raise ValueError(f"index option 'm'={m} must divide the embedding width D={self.dim}")
        if not 1 <= self.nbits <= 16 or 2 ** self.nbits > n:
            raise ValueError(f"index option 'nbits'={self.nbits} must be in 1..16 with 2**nbits <= the corpus "
                             f"size ({n} passages)")
        self.m = m
        opq = f"OPQ{m}," if self.opq else ""
        # "np": no polysemous code training (slow, and only for Hamming-filtered search, which is not used)
        return faiss.index_factory(self.dim, f"{opq}IVF{nlist},PQ{m}x{self.nbits}np", faiss.METRIC_INNER_PRODUCT)

    def train(self, sample: np.ndarray | torch.Tensor, n_total: int) -> None:
        """Create the (empty) index for ``n_total`` vectors and train it on ``sample`` ``[S, D]`` (IVF kinds)."""
        emb = self._check_width(sample)
        self._cpu = self._new_cpu_index(n_total)
        if not self._cpu.is_trained:
            self._cpu.train(emb)
        self._searcher = None

    def _check_width(self, embeddings: np.ndarray | torch.Tensor) -> np.ndarray:
        emb = as_float32(embeddings)
        if emb.shape[1] != self.dim:
            raise ValueError(f"embeddings have width {emb.shape[1]}, index expects {self.dim}")
        return emb

    def add(self, embeddings: np.ndarray | torch.Tensor) -> None:
        """Append ``[N, D]`` vectors as rows ``ntotal..ntotal+N-1``; IVF trains on the first batch."""
        emb = self._check_width(embeddings)
        if self._cpu is None:
            self.train(emb, len(emb))
        self._cpu.add(emb)
        self._configure(self._cpu)
        self._searcher = None

    def _configure(self, index: faiss.Index) -> None:
        if self.kind in ("ivf", "ivf_pq"):
            faiss.extract_index_ivf(index).nprobe = self.nprobe
        elif self.kind == "hnsw":
            index.hnsw.efSearch = self.ef_search

    @property
    def ntotal(self) -> int:
        return 0 if self._cpu is None else int(self._cpu.ntotal)

    def to(self, device: str | torch.device) -> DenseIndex:
        """Search on ``device`` from now on (GPU only where FAISS supports it); returns ``self``."""
        if str(device) != self.device:
            self.device = str(device)
            self._searcher = None
        return self

    def _get_searcher(self) -> faiss.Index:
        if self._cpu is None:
            raise RuntimeError("the index is empty: call add() or build() first")
        if self._searcher is None:
            on_gpu = self.device.startswith("cuda") and self.kind != "hnsw" and faiss_gpu_available()
            # index_cpu_to_all_gpus copies nprobe from the CPU IVF index.
            self._searcher = faiss.index_cpu_to_all_gpus(self._cpu) if on_gpu else self._cpu
        return self._searcher

    # ---- searching ----------------------------------------------------------------------------
    def check_fresh(self, expected_fingerprint: str | None, allow_stale: bool = False) -> None:
        """Raise :class:`StaleIndexError` if ``expected_fingerprint`` differs from the recorded one."""
        if expected_fingerprint is None or allow_stale or expected_fingerprint == self.fingerprint:
            return
        raise StaleIndexError(
            f"the index was built with passage encoder {self.fingerprint!r} but the current one is "
            f"{expected_fingerprint!r}; refresh the index (callbacks.IndexRefresh) or pass allow_stale=True"
        )

    def search(
        self,
        queries: np.ndarray | torch.Tensor,
        k: int,
        expected_fingerprint: str | None = None,
        allow_stale: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` rows by inner product for ``queries`` ``[Q, D]``.

        Returns:
            scores: ``[Q, k]`` float32 inner products, best first; ``-inf`` where fewer than ``k`` hits.
            rows: ``[Q, k]`` int64 rows, ``-1`` where fewer than ``k`` hits (``k > N``, or an IVF/HNSW
            search that reached fewer than ``k`` vectors).
        """
        self.check_fresh(expected_fingerprint, allow_stale)
        if k <= 0:
            raise ValueError(f"search k must be positive, got {k}")
        q = as_float32(queries, "queries")
        if q.shape[1] != self.dim:
            raise ValueError(f"queries have width {q.shape[1]}, index expects {self.dim}")
        if len(q) == 0:
            return torch.empty(0, k, dtype=torch.float32), torch.empty(0, k, dtype=torch.long)
        scores, rows = self._get_searcher().search(q, k)
        scores = torch.from_numpy(np.ascontiguousarray(scores, dtype=np.float32))
        rows = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        return scores.masked_fill(rows < 0, float("-inf")), rows

    # ---- persistence --------------------------------------------------------------------------
    def settings(self) -> dict:
        """The constructor arguments (less ``device``) that describe this index; :meth:`open` takes them."""
        return {
            "dim": self.dim, "kind": self.kind, "fingerprint": self.fingerprint, "nlist": self.nlist,
            "nprobe": self.nprobe, "hnsw_m": self.hnsw_m, "ef_search": self.ef_search,
            "ef_construction": self.ef_construction, "m": self.m, "nbits": self.nbits, "opq": self.opq,
        }

    def save(self, path: str | Path) -> Path:
        """Write index + metadata as one ``.npz`` file, atomically (temp file, then rename)."""
        if self._cpu is None:
            raise RuntimeError("cannot save an empty index")
        blob = faiss.serialize_index(self._cpu)
        meta = np.frombuffer(json.dumps(self.settings()).encode(), np.uint8)
        return write_verified(path, lambda f: np.savez(f, index=blob, meta=meta))

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> DenseIndex:
        """Read an index written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"index file not found: {path}")
        with np.load(path) as data:
            meta = json.loads(data["meta"].tobytes().decode())
            blob = data["index"]
        index = cls(device=device, **meta)
        index._cpu = faiss.deserialize_index(blob)
        index._configure(index._cpu)
        return index

    def write(self, path: str | Path) -> Path:
        """Write the bare FAISS index (``faiss.write_index`` format, so :meth:`open` can map it), atomically,
        with a ``.b2`` digest; the settings are the caller's to keep (:meth:`settings`)."""
        if self._cpu is None:
            raise RuntimeError("cannot write an empty index")
        return write_verified(path, lambda f: faiss.write_index(self._cpu, faiss.PyCallbackIOWriter(f.write)))

    @classmethod
    def open(cls, path: str | Path, settings: dict, device: str | torch.device = "cpu") -> DenseIndex:
        """Open a file written by :meth:`write`, memory-mapped read-only (see ``MMAP_FLAGS``)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"index file not found: {path}")
        index = cls(device=device, **settings)
        try:
            index._cpu = faiss.read_index(str(path), MMAP_FLAGS)
        except RuntimeError as error:
            raise ValueError(f"{path}: not a readable FAISS index (truncated?): {str(error).splitlines()[0]}") from None
        if index._cpu.d != index.dim:
            raise ValueError(f"{path}: index width {index._cpu.d}, its settings say {index.dim}")
        index._configure(index._cpu)
        return index
