"""A corpus index built once on disk (``bridge-pl index build``) and opened by every training process.

Folder layout (all files written to a temp file and renamed, each with a ``<file>.b2`` digest)::

    manifest.json             corpus + encoder fingerprints, width, chunk size, and (once done) the index settings
    passages.jsonl            the passage text store, one ``[id, title, text]`` per line
    passages.offsets.npy      int64 [N + 1] byte offsets into passages.jsonl
    emb-00000.f16 ...         float16 passage embeddings, ``chunk_rows`` rows per shard
    index.faiss               the FAISS index (``faiss.write_index``), opened memory-mapped

The build is resumable: a shard whose digest matches is kept and skipped, so a build killed at any point
(``kill -9`` included) redoes at most the shard it was writing and the index training. It writes only into an empty
folder or one that holds its own files (:func:`check_out_folder`), and deletes no file but the temp files it writes
through (``<file>.<8 random characters>.tmp``, left by a build killed while writing).

Opening a folder (:class:`BuiltIndex`) checks the manifest's fields and ``index.faiss`` against its digest (the
file FAISS maps has no check of its own); the text store and the shards are checked by their sizes there, and
against their digests by the build's resume and ``bridge-pl index info --verify``.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bridge_pl.files import atomic_write, digest_path, file_digest, is_verified
from bridge_pl.records import Passage
from bridge_pl.retrieval.index import KIND_OPTIONS, DenseIndex, StaleIndexError, default_nlist
from bridge_pl.retrieval.store import (
    OFFSETS_FILE,
    PASSAGES_FILE,
    EmbeddingStore,
    PassageStore,
    StoreError,
    shard_path,
    write_embedding_shard,
    write_passage_store,
)
from bridge_pl.terminal import Progress

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"
FORMAT = "bridge-pl index 1"
TRAIN_ROWS_PER_CELL = 50  # k-means sample per IVF cell (FAISS warns below 39)
TRAIN_ROWS_PER_CENTROID = 64  # PQ sample per sub-quantizer centroid
TRAIN_SEED = 0


@dataclass(frozen=True)
class EncoderSettings:
    """How passages were encoded: the passage side of a ``DenseRetriever`` with the same values."""

    name: str
    pooling: str = "mean"
    normalize: bool = True
    passage_prefix: str = ""
    max_passage_length: int = 256


def inner_products(q: torch.Tensor, p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[Q, K]`` scores ``q_i · p_ij`` of queries ``q`` ``[Q, D]`` and passages ``p`` ``[Q, K, D]``; ``-inf`` where
    ``rows`` ``[Q, K]`` is -1. The one formula for search-time and training-time scores."""
    scores = torch.einsum("qd,qkd->qk", q, p)
    return scores.masked_fill(rows.to(q.device) < 0, float("-inf"))


REBUILD = "rebuild with `bridge-pl index build`"
_FIELDS = {"format": str, "corpus": str, "corpus_fingerprint": str, "passages": int, "encoder": dict, "dim": int,
           "chunk_rows": int}
_ENCODER_FIELDS = {"name": str, "pooling": str, "normalize": bool, "passage_prefix": str, "max_passage_length": int,
                   "fingerprint": str}
_INDEX_SETTINGS = set(inspect.signature(DenseIndex).parameters) - {"device"}


def _field_problem(record: dict, fields: dict[str, type], where: str) -> str | None:
    """The first of ``fields`` (name -> type) that ``record`` lacks or holds with another type (an ``int`` field
    must be a whole number >= 1), as ``"<where>'name' ..."``; else None."""
    for name, kind in fields.items():
        if name not in record:
            return f"lacks {where}{name!r}"
        value = record[name]
        wrong = not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1))
        if wrong:
            want = "a whole number >= 1" if kind is int else f"a {kind.__name__}"
            return f"holds {where}{name!r} = {value!r}, expected {want}"
    return None


def _manifest_problem(manifest: object) -> str | None:
    """What makes ``manifest`` (a parsed manifest.json of this format) unusable, or None."""
    if not isinstance(manifest, dict):
        return f"holds a JSON {type(manifest).__name__}, not an object"
    problem = _field_problem(manifest, _FIELDS, "")
    problem = problem or _field_problem(manifest["encoder"], _ENCODER_FIELDS, "encoder ")
    for key in ("index_request", "index"):
        if problem is None and key in manifest and not isinstance(manifest[key], dict):
            problem = f"holds {key!r} = {manifest[key]!r}, expected an object"
    index = manifest.get("index")
    if problem is None and index is not None:
        if index.get("kind") not in KIND_OPTIONS:
            problem = f"holds index kind {index.get('kind')!r}, expected one of {sorted(KIND_OPTIONS)}"
        elif unknown := sorted(set(index) - _INDEX_SETTINGS):
            problem = f"holds unknown index settings {unknown}"
    return problem


def _read_manifest(folder: Path, remedy: str = REBUILD) -> dict:
    """``folder``'s manifest, checked (a :class:`StoreError` naming the folder and ``remedy`` when it is damaged)."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise StoreError(f"{folder}: not a built index ({MANIFEST_FILE} is missing); build it with "
                         "`bridge-pl index build`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StoreError(f"damaged index folder {folder}: {MANIFEST_FILE} is not JSON ({error}); {remedy}") from None
    if isinstance(manifest, dict) and manifest.get("format", FORMAT) != FORMAT:
        raise StoreError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if problem := _manifest_problem(manifest):
        raise StoreError(f"damaged index folder {folder}: {MANIFEST_FILE} {problem}; {remedy}")
    return manifest


def _write_manifest(folder: Path, manifest: dict) -> None:
    atomic_write(folder / MANIFEST_FILE, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


ANOTHER_OUT = "give another --out folder or delete this one"
# The files a build writes, their digests, and the temp files it writes them through (``tempfile.mkstemp``'s names:
# ``<file>.<8 random characters>.tmp``, see ``bridge_pl.files.atomic_write``).
_OWN_FILE = re.compile(r"(manifest\.json|passages\.jsonl|passages\.offsets\.npy|index\.faiss|emb-\d{5,}\.f16)"
                       r"(\.b2)?(?P<temp>\.[a-z0-9_]{8}\.tmp)?")
_LISTED = 3  # foreign files a refusal names


def _own_files(folder: Path, temp: bool) -> list[str]:
    """The names in ``folder`` that a build writes: its temp files (``temp``) or its other files."""
    matches = (_OWN_FILE.fullmatch(p.name) for p in folder.iterdir() if p.is_file())
    return sorted(m.string for m in matches if m is not None and bool(m.group("temp")) == temp)


def check_out_folder(folder: str | Path) -> None:
    """Refuse (``ValueError``, one line naming the folder and a few of the files) an ``--out`` folder that holds
    anything but a build's own files: any file when it holds no ``manifest.json`` (a build writes that first),
    except the temp files of a build killed while writing it. A missing or empty folder is fine."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"index build: --out {folder} is a file, not a folder; give a new or empty folder")
    names = sorted(p.name for p in folder.iterdir())
    own = set(_own_files(folder, temp=True))
    if MANIFEST_FILE in names:
        own |= set(_own_files(folder, temp=False))
    foreign = [name for name in names if name not in own]
    if foreign:
        more = len(foreign) - _LISTED
        listed = ", ".join(foreign[:_LISTED]) + (f" and {more} more" if more > 0 else "")
        unmarked = "" if MANIFEST_FILE in names else f" and no {MANIFEST_FILE}"
        raise ValueError(f"index build: --out {folder} holds files that are not part of a bridge-pl index build "
                         f"({listed}){unmarked}; give a new or empty folder")


def index_fingerprint(manifest: dict) -> str:
    """``<encoder fingerprint>-<corpus fingerprint>``, as ``DenseRetriever.fingerprint()`` gives it."""
    return f"{manifest['encoder']['fingerprint']}-{manifest['corpus_fingerprint']}"


def _train_rows(n: int, kind: str, nlist: int | None, nbits: int) -> np.ndarray:
    """Sorted rows of the training sample (seeded): every row for flat/HNSW, which do not train."""
    if kind in ("flat", "hnsw"):
        return np.arange(0)
    want = TRAIN_ROWS_PER_CELL * (nlist or default_nlist(n))
    if kind == "ivf_pq":
        want = max(want, TRAIN_ROWS_PER_CENTROID * 2 ** nbits)
    if want >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(TRAIN_SEED).choice(n, size=want, replace=False))


def write_index(folder: Path, store: EmbeddingStore, fingerprint: str, options: dict,
                progress: bool = True) -> DenseIndex:
    """Train (on a seeded sample) and fill an index of ``options`` (DenseIndex arguments) from ``store``'s
    shards, one shard in memory at a time; write it as ``folder/index.faiss``."""
    index = DenseIndex(store.dim, fingerprint=fingerprint, **options)
    sample = _train_rows(store.rows, index.kind, index.nlist, index.nbits)
    index.train(store[sample] if len(sample) else np.zeros((0, store.dim), np.float32), store.rows)
    bar = Progress(store.rows, "index add", "vec", enabled=progress)
    for shard in range(store.shards):
        index.add(store.shard(shard))
        bar.update(store.shard_rows(shard))
    bar.close()
    index.write(folder / INDEX_FILE)
    return index


def build_index(
    corpus_spec: str,
    passages: Sequence[Passage],
    corpus_fingerprint: str,
    out: str | Path,
    encoder: EncoderSettings,
    encode: Callable[[list[str]], np.ndarray],
    encoder_fingerprint: str,
    dim: int,
    index_options: dict,
    chunk_rows: int = 8192,
    progress: bool = True,
) -> Path:
    """Build (or resume building) the index folder ``out``; returns it.

    Args:
        corpus_spec / passages / corpus_fingerprint: the corpus as named, its rows and its digest.
        encoder / encode / encoder_fingerprint / dim: the passage encoder's settings, a function
            ``texts -> [n, dim] float32`` (``Passage.contents``) and its fingerprint.
        index_options: ``DenseIndex`` arguments (``kind``, ``nlist``, ``m``, ...).
        chunk_rows: passages per embedding shard (the unit of resumption).
    """
    folder = Path(out)
    if chunk_rows < 1:
        raise ValueError(f"index build option '--chunk-size' must be >= 1, got {chunk_rows}")
    check_out_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    corpus = {"format": FORMAT, "corpus": corpus_spec, "corpus_fingerprint": corpus_fingerprint,
              "passages": len(passages), "encoder": {**asdict(encoder), "fingerprint": encoder_fingerprint},
              "dim": dim, "chunk_rows": chunk_rows}
    manifest = _read_manifest(folder, ANOTHER_OUT) if (folder / MANIFEST_FILE).exists() else {}
    for key, value in corpus.items():
        if key in manifest and manifest[key] != value:
            raise ValueError(f"{folder}: holds a build with another {key} ({manifest[key]!r}, now {value!r}); "
                             f"{ANOTHER_OUT}")
    for name in _own_files(folder, temp=True):  # left by a build killed while writing a file
        (folder / name).unlink(missing_ok=True)
    request = dict(index_options)
    done = manifest.get("index_request") == request and is_verified(folder / INDEX_FILE)
    if not done:  # new, unfinished, or other index settings (the embeddings are kept)
        (folder / INDEX_FILE).unlink(missing_ok=True)
        _write_manifest(folder, corpus)

    if not (is_verified(folder / PASSAGES_FILE) and is_verified(folder / OFFSETS_FILE)):
        write_passage_store(passages, folder)
    shards = -(-len(passages) // chunk_rows)
    bar = Progress(len(passages), "encode passages", "psg", enabled=progress)
    for shard in range(shards):
        rows = range(shard * chunk_rows, min((shard + 1) * chunk_rows, len(passages)))
        if is_verified(shard_path(folder, shard)):
            bar.skip(len(rows))
            continue
        write_embedding_shard(folder, shard, encode([passages[i].contents for i in rows]))
        bar.update(len(rows))
    bar.close()

    if not done:
        store = EmbeddingStore(folder, len(passages), dim, chunk_rows)
        index = write_index(folder, store, index_fingerprint(corpus), index_options, progress)
        _write_manifest(folder, {**corpus, "index_request": request, "index": index.settings()})
    return folder


def index_file_problem(folder: Path) -> str | None:
    """Why ``folder/index.faiss`` cannot be trusted (missing, no digest beside it, or bytes that do not match it:
    the whole file is read), as one line naming it; None when it is whole."""
    path = folder / INDEX_FILE
    if not path.is_file():
        why = "is missing"
    elif not digest_path(path).is_file():
        why = f"has no digest ({digest_path(path).name} is missing)"
    elif digest_path(path).read_text().strip() != file_digest(path):
        why = f"is damaged (its bytes do not match {digest_path(path).name})"
    else:
        return None
    return (f"{path} {why}; rebuild it by rerunning its `bridge-pl index build` command (the embeddings are kept), "
            f"and see `bridge-pl index info {folder} --verify` for the other files")


def kept_files(folder: str | Path) -> str | None:
    """What a stopped build left in ``folder`` for a rerun of it to keep (the passage text store, the finished
    embedding shards, the index), in words; None when it wrote nothing yet. Files count by name, with their digest
    beside them (nothing is read: a rerun checks the digests)."""
    folder = Path(folder)
    try:
        manifest = _read_manifest(folder)
    except StoreError:
        return None

    def finished(*names: str) -> bool:
        return all((folder / n).is_file() and digest_path(folder / n).is_file() for n in names)

    shards = -(-manifest["passages"] // manifest["chunk_rows"])
    parts = ["the passage text store"] if finished(PASSAGES_FILE, OFFSETS_FILE) else []
    parts.append(f"{sum(finished(shard_path(folder, s).name) for s in range(shards))} of {shards} embedding shards")
    if "index" in manifest and finished(INDEX_FILE):
        parts.append("the index")
    return ", ".join(parts)


class BuiltIndex:
    """An index folder opened for search: the FAISS index (memory-mapped), the passage text store and the
    float16 embedding store, none of them read into memory.

    Args:
        folder: a folder written by :func:`build_index`.
        nprobe / ef_search: search-time settings replacing the built ones (``None``: keep).
        device: where the FAISS index searches (see ``DenseIndex``).
    """

    def __init__(self, folder: str | Path, nprobe: int | None = None, ef_search: int | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.folder = Path(folder)
        self.manifest = _read_manifest(self.folder)
        if "index" not in self.manifest:
            raise StoreError(f"{self.folder}: the build did not finish; rerun the same `bridge-pl index build` "
                             "command to resume it")
        self.fingerprint = index_fingerprint(self.manifest)
        rows, dim = int(self.manifest["passages"]), int(self.manifest["dim"])
        self.passages = PassageStore(self.folder, rows)
        self.embeddings = EmbeddingStore(self.folder, rows, dim, int(self.manifest["chunk_rows"]))
        settings = dict(self.manifest["index"])
        settings.update({k: v for k, v in (("nprobe", nprobe), ("ef_search", ef_search)) if v is not None})
        if problem := index_file_problem(self.folder):
            raise StoreError(problem)
        self.index = DenseIndex.open(self.folder / INDEX_FILE, settings, device)

    @property
    def kind(self) -> str:
        return self.index.kind

    def check(self, encoder_fingerprint: str, corpus_fingerprint: str | None = None) -> None:
        """Raise :class:`StaleIndexError` (one line, naming the folder) unless built by this encoder and corpus."""
        built = self.manifest["encoder"]
        if encoder_fingerprint != built["fingerprint"]:
            raise StaleIndexError(
                f"index {self.folder} was built with passage encoder {built['name']!r} (fingerprint "
                f"{built['fingerprint']}, prefix {built['passage_prefix']!r}, max length "
                f"{built['max_passage_length']}), not the retriever's ({encoder_fingerprint}); rebuild it with "
                "`bridge-pl index build` and the retriever's encoder settings")
        if corpus_fingerprint is not None and corpus_fingerprint != self.manifest["corpus_fingerprint"]:
            raise StaleIndexError(
                f"index {self.folder} was built for corpus {self.manifest['corpus']!r} (fingerprint "
                f"{self.manifest['corpus_fingerprint']}), not this corpus ({corpus_fingerprint}); rebuild it or "
                "leave the retriever's 'corpus' unset to use the index's own passages")

    def search(self, q: torch.Tensor, k: int, rerank_factor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` of ``rerank_factor * k`` index candidates for ``q`` ``[Q, D]``, rescored exactly with the
        float16 embedding rows (:func:`inner_products`): ``(scores [Q, k] float32, rows [Q, k] int64)``."""
        _, cand = self.index.search(q, k * rerank_factor)
        scores = inner_products(q.cpu().float(), self.rows(cand), cand)
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        return top.values, cand.gather(1, top.indices).masked_fill(top.values == float("-inf"), -1)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[*rows.shape, D]`` float32 embeddings of ``rows`` (-1 gives row 0's; the caller masks it)."""
        flat = rows.clamp(min=0).reshape(-1).cpu().numpy()
        return torch.from_numpy(self.embeddings[flat]).reshape(*rows.shape, -1)


def _bytes(folder: Path, names: list[str]) -> int:
    return sum((folder / n).stat().st_size for n in names if (folder / n).is_file())


def index_info(folder: str | Path, verify: bool = False) -> list[str]:
    """Lines describing an index folder (size, kind, corpus and encoder fingerprints); ``verify`` checks every
    file's digest (reads it all)."""
    folder = Path(folder)
    m = _read_manifest(folder)
    shards = -(-m["passages"] // m["chunk_rows"])
    shard_names = [shard_path(folder, s).name for s in range(shards)]
    done = sum(is_verified(folder / n) if verify else (folder / n).is_file() for n in shard_names)
    text, emb = [PASSAGES_FILE, OFFSETS_FILE], shard_names
    index = m.get("index")
    lines = [
        f"index:    {folder}",
        f"kind:     {index['kind'] if index else '(build not finished)'}"
        + ("" if not index else "  " + ", ".join(f"{k}={index[k]}" for k in KIND_OPTIONS[index["kind"]])),
        f"corpus:   {m['corpus']}  ({m['passages']:,} passages, fingerprint {m['corpus_fingerprint']})",
        f"encoder:  {m['encoder']['name']}  (D={m['dim']}, fingerprint {m['encoder']['fingerprint']}, "
        f"prefix {m['encoder']['passage_prefix']!r}, max length {m['encoder']['max_passage_length']})",
        f"size:     index {_bytes(folder, [INDEX_FILE]):,} B, embeddings {_bytes(folder, emb):,} B "
        f"(float16, {done}/{shards} shards), text {_bytes(folder, text):,} B",
    ]
    if verify:
        bad = [n for n in [*text, *([INDEX_FILE] if index else [])] if not is_verified(folder / n)]
        lines.append("verify:   " + ("all digests match" if not bad and done == shards
                                     else f"damaged or missing: {', '.join(bad) or 'shards'}"))
    return lines
