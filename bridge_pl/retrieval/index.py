"""FAISS inner-product indexes (flat / IVF / HNSW) that remember which passage encoder built them.

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

IndexKind = Literal["flat", "ivf", "hnsw"]


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


def faiss_gpu_available() -> bool:
    """Whether this ``faiss`` build has GPU support and sees at least one GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class DenseIndex:
    """Maximum-inner-product search over ``[N, D]`` float32 embeddings.

    Args:
        dim: embedding width ``D``.
        kind: ``"flat"`` (exact, default), ``"ivf"`` (IndexIVFFlat; trained on the added vectors) or
            ``"hnsw"`` (IndexHNSWFlat, inner-product metric) for large corpora.
        fingerprint: identifies the passage encoder (and corpus) the vectors came from.
        nlist: IVF cells; default ``clamp(4 * sqrt(N), 1, N // 39)`` (FAISS wants >= 39 points per cell).
        nprobe: IVF cells visited per query.
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
        nlist = self.nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
        if nlist > n:
            raise ValueError(f"ivf index: nlist={nlist} exceeds the number of vectors ({n})")
        self.nlist = nlist
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)

    def add(self, embeddings: np.ndarray | torch.Tensor) -> None:
        """Append ``[N, D]`` vectors as rows ``ntotal..ntotal+N-1``; IVF trains on the first batch."""
        emb = as_float32(embeddings)
        if emb.shape[1] != self.dim:
            raise ValueError(f"embeddings have width {emb.shape[1]}, index expects {self.dim}")
        if self._cpu is None:
            self._cpu = self._new_cpu_index(len(emb))
            if not self._cpu.is_trained:
                self._cpu.train(emb)
        self._cpu.add(emb)
        self._configure(self._cpu)
        self._searcher = None

    def _configure(self, index: faiss.Index) -> None:
        if self.kind == "ivf":
            index.nprobe = self.nprobe
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
    def _meta(self) -> dict:
        return {
            "dim": self.dim, "kind": self.kind, "fingerprint": self.fingerprint, "nlist": self.nlist,
            "nprobe": self.nprobe, "hnsw_m": self.hnsw_m, "ef_search": self.ef_search,
            "ef_construction": self.ef_construction,
        }

    def save(self, path: str | Path) -> Path:
        """Write index + metadata as one ``.npz`` file, atomically (temp file, then rename)."""
        if self._cpu is None:
            raise RuntimeError("cannot save an empty index")
        blob = faiss.serialize_index(self._cpu)
        meta = np.frombuffer(json.dumps(self._meta()).encode(), np.uint8)
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
