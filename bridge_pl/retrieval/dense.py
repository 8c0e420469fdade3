"""Dense bi-encoder retriever: an HF encoder tower for queries (φ), one for passages, a FAISS index.

Passage tower modes (docs/method.md section 2):

- ``"frozen"`` (default, query-side training): the passages are encoded once by a frozen copy of the
  encoder; the index never goes stale and passage embeddings are cached on disk.
- ``"tied"``: one shared trainable encoder for both sides; the index goes stale after each update.
- ``"trainable"``: a separate trainable passage encoder (:attr:`DenseRetriever.passage_encoder`).

For the last two, ``callbacks.IndexRefresh`` re-encodes the corpus on a schedule (docs/method.md section 6).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bridge_pl.config import AT_LEAST_ONE, Rule, raise_problems, require_choice, rule_problems
from bridge_pl.eval_mode import eval_mode
from bridge_pl.files import is_verified, write_verified
from bridge_pl.records import CorpusSpec, Passage
from bridge_pl.retrieval.base import Retriever
from bridge_pl.retrieval.built_index import BuiltIndex, inner_products
from bridge_pl.retrieval.index import DenseIndex, IndexKind
from bridge_pl.retrieval.store import EmbeddingStore
from bridge_pl.terminal import Progress, is_rank_zero

log = logging.getLogger(__name__)

Pooling = Literal["mean", "cls"]
PassageTower = Literal["frozen", "tied", "trainable"]
INDEX_OPTIONS = ("nlist", "nprobe", "hnsw_m", "ef_search", "ef_construction", "m", "nbits", "opq")


class EncoderTower(nn.Module):
    """An HF encoder + pooling + optional L2 normalisation: ``tower(texts) -> [N, D]`` float32.

    ``prefix`` (E5-style ``"query: "``) and ``max_length`` (tokens) are this tower's defaults; a tied tower
    is called with the passage-side values through :meth:`encode`. Deep-copyable (the trainer copies
    the query tower as ψ).
    """

    def __init__(
        self, encoder: nn.Module, tokenizer, pooling: Pooling = "mean", normalize: bool = True,
        prefix: str = "", max_length: int = 64,
    ) -> None:
        super().__init__()
        if getattr(encoder, "pooler", None) is not None:
            # We pool ourselves; an unused HF pooler would cost compute and leave DDP with params
            # that never get a grad.
            encoder.pooler = None
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = require_choice("EncoderTower pooling", pooling, Pooling)
        self.normalize = normalize
        self.prefix = prefix
        self.max_length = max_length
        self._hash_key: tuple | None = None
        self._hash = ""

    @property
    def dim(self) -> int:
        return int(self.encoder.config.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.encoder.parameters()).device

    def freeze(self) -> EncoderTower:
        """No grads from now on (its train/eval mode does not matter: corpus encodes run in eval mode)."""
        return self.requires_grad_(False)

    def encode(
        self, texts: list[str], prefix: str | None = None, max_length: int | None = None
    ) -> torch.Tensor:
        """``[N, D]`` float32 embeddings on the tower's device (grad follows the caller's grad mode)."""
        if not texts:
            return torch.zeros(0, self.dim, dtype=torch.float32, device=self.device)
        prefix = self.prefix if prefix is None else prefix
        batch = self.tokenizer(
            [prefix + t for t in texts], padding=True, truncation=True,
            max_length=max_length or self.max_length, return_tensors="pt",
        ).to(self.device)
        hidden = self.encoder(**batch).last_hidden_state  # [N, T, H]
        if self.pooling == "cls":
            emb = hidden[:, 0]
        else:
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [N, T, 1]
            emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        emb = emb.float()
        return F.normalize(emb, dim=-1) if self.normalize else emb

    def forward(self, texts: list[str]) -> torch.Tensor:
        return self.encode(texts)

    def weights_hash(self) -> str:
        """Hash of all encoder weights and buffers (recomputed only after they change)."""
        tensors = [*self.encoder.named_parameters(), *self.encoder.named_buffers()]
        # Every in-place update (optimizer step, load_state_dict) bumps a tensor's version counter, so
        # (id, storage, version) tells cheaply whether the expensive byte hash must be redone.
        key = tuple((id(t), t.data_ptr(), t._version) for _, t in tensors)
        if key != self._hash_key:
            h = hashlib.blake2b(digest_size=16)
            for name, t in tensors:
                h.update(name.encode())
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            self._hash_key, self._hash = key, h.hexdigest()
        return self._hash

    def fingerprint(self, prefix: str | None = None, max_length: int | None = None) -> str:
        """Weights + model config + tokenizer + pooling/normalisation/prefix/max length, as a hex digest."""
        config = {k: v for k, v in self.encoder.config.to_dict().items()
                  if k not in ("_name_or_path", "transformers_version")}
        settings = {
            "config": config, "tokenizer": [type(self.tokenizer).__name__, len(self.tokenizer)],
            "pooling": self.pooling, "normalize": self.normalize,
            "prefix": self.prefix if prefix is None else prefix, "max_length": max_length or self.max_length,
            "weights": self.weights_hash(),
        }
        blob = json.dumps(settings, sort_keys=True, default=str).encode()
        return hashlib.blake2b(blob, digest_size=16).hexdigest()


def encode_by_length(
    tower: EncoderTower, texts: list[str], batch_size: int, prefix: str, max_length: int,
    on_batch: Callable[[int], object] = lambda n: None,
) -> np.ndarray:
    """``[N, D]`` float32 embeddings of ``texts`` by ``tower`` in eval mode without grad, in the given order.

    Texts are encoded in length order so each batch of ``batch_size`` pads little; ``on_batch(n)`` is called
    after each batch of ``n``.
    """
    order = np.argsort([len(t) for t in texts], kind="stable")
    out = np.empty((len(texts), tower.dim), dtype=np.float32)
    with eval_mode(tower), torch.no_grad():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            out[rows] = tower.encode([texts[i] for i in rows], prefix=prefix, max_length=max_length).cpu().numpy()
            on_batch(len(rows))
    return out


def corpus_hash(passages: Sequence[Passage]) -> str:
    """Hex digest of the passages' ids, titles and texts, in row order."""
    h = hashlib.blake2b(digest_size=16)
    for p in passages:
        h.update(json.dumps([p.id, p.title, p.text]).encode())
    return h.hexdigest()


class DenseRetriever(Retriever):
    """Bi-encoder retrieval over a corpus with a FAISS inner-product index.

    Args:
        corpus: a corpus spec for ``bridge_pl.data.sources.load_corpus`` (``"world"``, a jsonl path, ...)
            or the passages themselves; may be left unset (``None``) with ``index_path``, which then
            supplies the passages. Given with ``index_path``, it must be the corpus the index was built for.
        encoder: registry name, local folder or cached HF id of the encoder (``bridge_pl.models``).
        query_prefix / passage_prefix: prepended to texts (E5: ``"query: "`` / ``"passage: "``).
        pooling: ``"mean"`` over non-pad tokens or ``"cls"``.
        normalize: L2-normalise embeddings (inner product = cosine).
        passage_tower: ``"frozen"`` | ``"tied"`` | ``"trainable"`` (module docstring).
        index: ``"flat"`` (exact) | ``"ivf"`` | ``"hnsw"`` | ``"ivf_pq"``; ``index_options`` holds nlist /
            nprobe / hnsw_m / ef_search / ef_construction / m / nbits / opq (see :class:`DenseIndex`).
        index_path: a folder written by ``bridge-pl index build``: passages, float16 embeddings and the FAISS
            index are read from disk (the index memory-mapped, the stores by offset; processes share the pages)
            instead of built here; ``index`` is then ignored and ``index_options`` may only set ``nprobe`` /
            ``ef_search``. With a frozen passage tower, search rescores ``rerank_factor * k`` index candidates
            exactly from the float16 rows (one candidate per result for a flat index), so search and
            :meth:`score` give the same numbers.
        max_query_length / max_passage_length: tokenizer truncation, in tokens.
        batch_size: passages per forward pass when encoding the corpus.
        cache_dir: where passage embeddings (and non-flat indexes) are cached, keyed by
            :meth:`fingerprint`; default ``bridge_pl.models.cache_dir() / "embeddings"``.
        allow_stale: search an index built by older passage-tower weights without raising.
        rerank_stale / rerank_factor: over-retrieve ``rerank_factor * k`` candidates from a (possibly
            stale) index and rerank them with the current passage tower (Atlas); implies ``allow_stale``.
            ``rerank_factor`` is also the over-retrieval of an approximate built index (``index_path``).
        progress: show the corpus encoding's progress (rank 0 only): a bar when stdout is a terminal, else a
            plain line on stdout every 10 s and one at the end (``bridge_pl.terminal.Progress``).
        disable_dropout: zero every ``nn.Dropout`` in the towers, so that :meth:`score` in train mode equals
            the eval-mode :meth:`search` scores (the rollout's log-probs and the update's agree).

    Passages are encoded as ``Passage.contents`` (FlashRAG ``"title"\\ntext``).
    """

    RULES: ClassVar[dict[str, Rule]] = dict.fromkeys(  # messages name the option as in model.retriever.init_args
        ("batch_size", "rerank_factor", "max_query_length", "max_passage_length"), AT_LEAST_ONE.worded(">= 1"))

    def __init__(
        self,
        corpus: CorpusSpec | None = None,
        encoder: str = "minilm-l6",
        query_prefix: str = "",
        passage_prefix: str = "",
        pooling: Pooling = "mean",
        normalize: bool = True,
        passage_tower: PassageTower = "frozen",
        index: IndexKind = "flat",
        index_options: dict | None = None,
        max_query_length: int = 64,
        max_passage_length: int = 256,
        batch_size: int = 64,
        cache_dir: str | None = None,
        allow_stale: bool = False,
        rerank_stale: bool = False,
        rerank_factor: int = 4,
        progress: bool = True,
        disable_dropout: bool = True,
        index_path: str | None = None,
    ) -> None:
        super().__init__()
        from bridge_pl.models import load_encoder, load_tokenizer

        require_choice("DenseRetriever option 'pooling'", pooling, Pooling)  # fail before loading any weights
        self.passage_tower = require_choice("DenseRetriever option 'passage_tower'", passage_tower, PassageTower)
        self.index_kind = require_choice("DenseRetriever option 'index'", index, IndexKind)
        self.index_options = dict(index_options or {})
        unknown = sorted(set(self.index_options) - set(INDEX_OPTIONS))
        if unknown:
            raise ValueError(f"DenseRetriever option 'index_options' has unknown keys {unknown}; "
                             f"allowed: {list(INDEX_OPTIONS)}")
        raise_problems(rule_problems(lambda key: f"DenseRetriever option '{key}'", locals(), self.RULES))
        self.passage_prefix = passage_prefix
        self.max_passage_length = max_passage_length
        self.batch_size = batch_size
        self.cache_dir = cache_dir
        self.allow_stale = allow_stale
        self.rerank_stale = rerank_stale
        self.rerank_factor = rerank_factor
        self.progress = progress
        self.encoded_passages = 0  # passages run through a full-corpus encode (cache misses, refreshes)

        if corpus is None and index_path is None:
            raise ValueError("DenseRetriever needs 'corpus' or 'index_path'")
        if index_path is not None:
            searching = {"nprobe", "ef_search"}
            if set(self.index_options) - searching:
                raise ValueError(f"DenseRetriever option 'index_options' may only set {sorted(searching)} with "
                                 f"'index_path' (the rest was fixed by `bridge-pl index build`), got "
                                 f"{sorted(self.index_options)}")
        self.index_path = index_path
        self._built: BuiltIndex | None = None
        self._corpus_spec, self._passages = corpus, None  # read (and checked) on first use
        self._corpus_hash: str | None = None

        hf_encoder, tokenizer = load_encoder(encoder), load_tokenizer(encoder)
        self._query_tower = EncoderTower(
            hf_encoder, tokenizer, pooling, normalize, query_prefix, max_query_length
        )
        self._passage_tower: EncoderTower | None = None
        if passage_tower != "tied":
            tower = EncoderTower(copy.deepcopy(hf_encoder), tokenizer, pooling, normalize, passage_prefix,
                                 max_passage_length)
            self._passage_tower = tower.freeze() if passage_tower == "frozen" else tower
        if disable_dropout:
            for module in self.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
        self.train()  # one mode for all submodules (from_pretrained leaves the encoder in eval mode)
        # [N, D] passage embeddings: memory-mapped on a cache hit, an EmbeddingStore with index_path
        self._emb: np.ndarray | EmbeddingStore | None = None
        self._index: DenseIndex | None = None
        self._index_tower_state: dict[str, torch.Tensor] | None = None  # see index_tower_state()

    # ---- corpus -------------------------------------------------------------------------------
    @property
    def passages(self) -> Sequence[Passage]:
        if self._passages is None and self.index_path is not None:
            self._passages = self._open_built().passages
        if self._passages is None:
            from bridge_pl.data.sources import load_corpus

            self._passages = list(load_corpus(self._corpus_spec))
        if not self._passages:
            raise ValueError(f"DenseRetriever corpus {self._corpus_spec!r} has no passages")
        return self._passages

    # ---- towers -------------------------------------------------------------------------------
    @property
    def query_encoder(self) -> EncoderTower:
        return self._query_tower

    @property
    def passage_encoder(self) -> EncoderTower | None:
        """The separate trainable passage tower (``passage_tower="trainable"``), else ``None``.

        With ``"tied"`` the passage side *is* :attr:`query_encoder`; with ``"frozen"`` nothing trains.
        """
        return self._passage_tower if self.passage_tower == "trainable" else None

    @property
    def passage_tower_trains(self) -> bool:
        return self.passage_tower != "frozen"

    @property
    def device(self) -> torch.device:
        return self._query_tower.device

    def _passage_side(
        self, query_encoder: nn.Module | None = None, passage_encoder: nn.Module | None = None
    ) -> EncoderTower:
        """The tower that encodes passages; a tied retriever uses the given query tower (e.g. ψ), a trainable one
        the given ``passage_encoder`` (e.g. ψ's copy of it) instead of its own."""
        if self.passage_tower == "tied":
            return query_encoder if query_encoder is not None else self._query_tower
        if passage_encoder is not None:
            return passage_encoder
        assert self._passage_tower is not None
        return self._passage_tower

    def encode_passages(
        self, texts: list[str], query_encoder: nn.Module | None = None, passage_encoder: nn.Module | None = None
    ) -> torch.Tensor:
        """``[N, D]`` passage embeddings by the passage tower (grad follows the caller's grad mode)."""
        return self._passage_side(query_encoder, passage_encoder).encode(
            texts, prefix=self.passage_prefix, max_length=self.max_passage_length
        )

    def fingerprint(self) -> str:
        """``<passage-encoder digest>-<corpus digest>``; reflects the passage tower's current weights."""
        if self._corpus_hash is None:
            passages = self.passages  # opening a built index (index_path) sets the hash from its manifest
            self._corpus_hash = self._corpus_hash or corpus_hash(passages)
        tower = self._passage_side()
        return f"{tower.fingerprint(self.passage_prefix, self.max_passage_length)}-{self._corpus_hash}"

    # ---- index --------------------------------------------------------------------------------
    def _cache_root(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        from bridge_pl.models import cache_dir

        return cache_dir() / "embeddings"

    def _open_built(self) -> BuiltIndex:
        """Open ``index_path`` (once) and check that it was built by this passage encoder and corpus."""
        if self._built is None:
            built = BuiltIndex(self.index_path, device=self.device, **self.index_options)
            given = None
            if self._corpus_spec is not None:  # a corpus named beside the index must be the one it holds
                from bridge_pl.data.sources import load_corpus

                given = corpus_hash(load_corpus(self._corpus_spec))
            tower = self._passage_side()
            built.check(tower.fingerprint(self.passage_prefix, self.max_passage_length), given)
            self._built, self._passages, self._corpus_hash = built, built.passages, built.manifest["corpus_fingerprint"]
            self.index_kind = built.kind
        return self._built

    def _encode_corpus(self) -> np.ndarray:
        """``[N, D]`` float32 embeddings of the whole corpus, under no_grad, in eval mode."""
        passages = self.passages
        bar = Progress(len(passages), "encode passages", "psg", stream=sys.stdout,
                       enabled=self.progress and is_rank_zero())
        try:
            out = encode_by_length(self._passage_side(), [p.contents for p in passages], self.batch_size,
                                   self.passage_prefix, self.max_passage_length, bar.update)
        finally:
            bar.close()
        self.encoded_passages += len(passages)
        return out

    def _build(self, use_cache: bool) -> None:
        if use_cache and self.index_path is not None:
            built = self._open_built()
            self._emb, self._index = built.embeddings, built.index
            self._keep_index_tower_state()
            return
        fp = self.fingerprint()
        emb_path = self._cache_root() / f"{fp}.npy"
        if use_cache and _usable_cache(emb_path, "passage embedding"):
            log.info("passage embedding cache hit: %s", emb_path)
            emb = np.load(emb_path, mmap_mode="r")
        else:
            emb = self._encode_corpus()
            if use_cache:
                write_verified(emb_path, lambda f: np.save(f, emb))
                log.info("cached passage embeddings: %s", emb_path)
        options = {"kind": self.index_kind, **self.index_options}
        index_path = None
        if use_cache and self.index_kind != "flat":  # a flat index is just the embeddings again
            key = hashlib.blake2b(json.dumps(options, sort_keys=True).encode(), digest_size=8).hexdigest()
            index_path = self._cache_root() / f"{fp}.{self.index_kind}-{key}.index.npz"
        if index_path is not None and _usable_cache(index_path, "index"):
            index = DenseIndex.load(index_path, device=self.device)
        else:
            index = DenseIndex.build(emb, fingerprint=fp, device=self.device, **options)
            if index_path is not None:
                index.save(index_path)
        self._emb, self._index = emb, index
        self._keep_index_tower_state()

    def _keep_index_tower_state(self) -> None:
        if self.passage_tower_trains:  # what a resumed run needs to rebuild this very (later stale) index
            self._index_tower_state = {k: v.detach().to("cpu", copy=True)
                                       for k, v in self._passage_side().state_dict().items()}

    def index_tower_state(self) -> dict[str, torch.Tensor] | None:
        """The passage-tower weights the current index was encoded with (``None`` for a frozen tower).

        Between refreshes a trained tower moves on while the index stays as it was built; checkpoints keep
        these weights so that a resumed run rebuilds the same index (:meth:`restore_index`).
        """
        return self._index_tower_state

    def restore_index(self, tower_state: dict[str, torch.Tensor]) -> None:
        """Rebuild the index as encoded by a passage tower with ``tower_state``; the live tower is unchanged."""
        tower = self._passage_side()
        live = {k: v.detach().clone() for k, v in tower.state_dict().items()}
        tower.load_state_dict(tower_state)
        try:
            self._build(use_cache=False)
        finally:
            tower.load_state_dict(live)

    def prepare(self) -> None:
        """Encode the corpus (or load the cached embeddings) and build the index; idempotent."""
        if self._index is None:
            self._build(use_cache=True)

    def refresh_index(self) -> None:
        """Re-encode the corpus with the current passage tower and rebuild the index (not disk-cached)."""
        self._build(use_cache=not self.passage_tower_trains)

    @property
    def index(self) -> DenseIndex:
        self.prepare()
        assert self._index is not None
        return self._index

    # ---- retrieval ----------------------------------------------------------------------------
    def _check_rows(self, queries: list[str], rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[0] != len(queries):
            raise ValueError(f"rows must be [Q={len(queries)}, K] int64, got shape {tuple(rows.shape)}")
        if bool((rows >= len(self.passages)).any()):
            raise ValueError(f"rows must be < corpus size {len(self.passages)} (or -1 for padding)")

    def _passage_embeddings(
        self, rows: torch.Tensor, query_encoder: nn.Module | None, passage_encoder: nn.Module | None = None
    ) -> torch.Tensor:
        """``[Q, K, D]`` embeddings of ``rows`` ``[Q, K]`` (-1 rows give row 0's, masked by the caller).

        Frozen tower: the corpus embeddings; trainable tower: re-encoded (with grad if grad is enabled).
        """
        flat = rows.clamp(min=0).reshape(-1).cpu()
        if not self.passage_tower_trains:
            self.prepare()
            emb = torch.from_numpy(np.asarray(self._emb[flat.numpy()], dtype=np.float32))  # float16 rows: exact
        else:
            uniq, inverse = torch.unique(flat, return_inverse=True)
            texts = [self.passages[i].contents for i in uniq.tolist()]
            emb = self.encode_passages(texts, query_encoder, passage_encoder)[inverse.to(self.device)]
        return emb.reshape(*rows.shape, -1)

    def score(
        self, queries: list[str], rows: torch.Tensor, query_encoder: nn.Module | None = None,
        passage_encoder: nn.Module | None = None,
    ) -> torch.Tensor:
        """``[Q, K]`` float32 inner products ``q_i · p_{rows[i, j]}``; ``-inf`` where ``rows`` is -1.

        Differentiable w.r.t. the query tower (``query_encoder`` or φ), and w.r.t. the passage tower
        when it trains (``passage_encoder``, a copy of the trainable one such as ψ's, or the retriever's own).
        On the query tower's device. Uses the towers' current train/eval mode.
        """
        self._check_rows(queries, rows)
        tower = query_encoder if query_encoder is not None else self._query_tower
        return self._pair_scores(tower(queries), rows, query_encoder, passage_encoder)

    def _pair_scores(
        self, q: torch.Tensor, rows: torch.Tensor, query_encoder: nn.Module | None = None,
        passage_encoder: nn.Module | None = None,
    ) -> torch.Tensor:
        """``[Q, K]`` inner products of query embeddings ``q`` ``[Q, D]`` with passages ``rows`` ``[Q, K]``."""
        passages = self._passage_embeddings(rows, query_encoder, passage_encoder)
        return inner_products(q, passages.to(q.device), rows)

    def search(self, queries: list[str], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` ``(scores [Q, k] float32, rows [Q, k] int64)`` on CPU, eval mode, no grad.

        Rows are -1 (score -inf) only where the index returned fewer than ``k`` hits (e.g. ``k > N``).
        Raises :class:`~bridge_pl.retrieval.index.StaleIndexError` if the passage tower changed since
        the index was built, unless ``allow_stale`` or ``rerank_stale`` is set.
        """
        index = self.index.to(self.device)
        rerank = self.rerank_stale and self.passage_tower_trains
        expected = None if (self.allow_stale or rerank) else self.fingerprint()
        index.check_fresh(expected)
        with eval_mode(self._query_tower, self._passage_side()), torch.no_grad():
            q = self._query_tower(queries)
            if self._built is not None and index is self._built.index and not self.passage_tower_trains:
                factor = 1 if index.kind == "flat" else self.rerank_factor
                return self._built.search(q, k, factor)
            if not rerank:
                return index.search(q, k)
            _, cand = index.search(q, k * self.rerank_factor)
            fresh = self._pair_scores(q, cand).cpu()
        top = fresh.topk(k, dim=1)
        rows = cand.gather(1, top.indices)
        return top.values, rows.masked_fill(top.values == float("-inf"), -1)


def _usable_cache(path: Path, what: str) -> bool:
    """Whether a cache file exists and matches its digest; a damaged one is reported, removed and rebuilt."""
    if not path.exists():
        return False
    if is_verified(path):
        return True
    log.warning("%s cache %s is damaged or was not completely written (its checksum does not match); "
                "rebuilding it", what, path)
    path.unlink(missing_ok=True)
    return False
