"""``bridge-pl index build`` / ``bridge-pl index info``: build a corpus index on disk once, for training configs to
point at (``model.retriever.init_args.index_path``). See docs/retrieval_index.md."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Iterator

import torch

from bridge_pl.retrieval.index import KIND_OPTIONS, IndexKind

KINDS = IndexKind.__args__
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class BuildStopped(BaseException):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) during ``index build``, raised where the build then is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """While active (in the main thread), a stop signal raises :class:`BuildStopped` at once: any point of a build is
    a safe one, since each file is written to a temp file that is renamed into place or, on the way out, removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame) -> None:
        raise BuildStopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stopped_line(out: str, signum: int, argv: list[str]) -> str:
    """The line that ends a build stopped by ``signum``: what ``out`` keeps and the command that resumes it."""
    from bridge_pl.retrieval.built_index import kept_files

    name = signal.Signals(signum).name
    rerun = shlex.join(["bridge-pl", "index", *argv])
    kept = kept_files(out)
    if kept is None:
        return f"bridge-pl: index build stopped by {name} before it wrote anything; start it again with: {rerun}"
    return (f"bridge-pl: index build stopped by {name}; {out} keeps {kept} (a rerun checks them against their "
            f"digests and does not redo them); resume with: {rerun}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bridge-pl index", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="encode a corpus into an on-disk store and write a FAISS index",
                           description="Encode CORPUS with the frozen passage tower in chunks (float16 shards; "
                                       "a rerun resumes, keeping finished chunks), then train and write the index.")
    build.add_argument("--corpus", required=True, help='"world", "wikipedia" or a corpus .jsonl/.json/.parquet')
    build.add_argument("--out", required=True, help="the index folder (created; a rerun resumes in it)")
    build.add_argument("--encoder", default="minilm-l6", help="passage encoder: registry name, folder or HF id")
    build.add_argument("--pooling", default="mean", choices=("mean", "cls"))
    build.add_argument("--no-normalize", dest="normalize", action="store_false",
                       help="keep raw embeddings (default: L2-normalised, inner product = cosine)")
    build.add_argument("--passage-prefix", default="", help='prepended to each passage (E5: "passage: ")')
    build.add_argument("--max-passage-length", type=int, default=256, help="tokens per passage")
    build.add_argument("--kind", default="ivf_pq", choices=KINDS, help="index kind (docs/retrieval_index.md)")
    build.add_argument("--nlist", type=int, help="IVF cells (default 4*sqrt(N), at most N/39)")
    build.add_argument("--nprobe", type=int, default=32, help="IVF cells searched per query")
    build.add_argument("--m", type=int, help="ivf_pq: sub-quantizers, bytes per vector at 8 bits; must divide D "
                                             "(default: largest divisor of D up to D/8)")
    build.add_argument("--nbits", type=int, default=8, help="ivf_pq: bits per sub-quantizer code")
    build.add_argument("--opq", action="store_true", help="ivf_pq: learn an OPQ rotation first")
    build.add_argument("--hnsw-m", type=int, default=32, help="hnsw: graph degree")
    build.add_argument("--chunk-size", type=int, default=8192, help="passages per embedding shard (resume unit)")
    build.add_argument("--batch-size", type=int, default=64, help="passages per encoder forward")
    build.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                       help="where the encoder runs")
    build.add_argument("--quiet", action="store_true", help="no progress output")
    info = sub.add_parser("info", help="print an index folder's kind, size, corpus and encoder")
    info.add_argument("path", help="the index folder")
    info.add_argument("--verify", action="store_true", help="also check every file's digest (reads all of it)")
    return parser


def _index_options(args: argparse.Namespace) -> dict:
    """The DenseIndex arguments the chosen kind uses (others left out, so they do not key the build)."""
    used = [name for name in KIND_OPTIONS[args.kind] if name not in ("ef_search", "ef_construction")]
    for name in used:
        value = getattr(args, name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"index build option '--{name.replace('_', '-')}' must be >= 1, got {value}")
    return {"kind": args.kind, **{name: getattr(args, name) for name in used}}


def build_main(args: argparse.Namespace) -> None:
    from bridge_pl.data.sources import load_corpus
    from bridge_pl.models import load_encoder, load_tokenizer
    from bridge_pl.retrieval.built_index import EncoderSettings, build_index, check_out_folder
    from bridge_pl.retrieval.dense import EncoderTower, corpus_hash, encode_by_length

    options = _index_options(args)  # option errors before anything loads
    if args.max_passage_length < 1 or args.batch_size < 1:
        raise ValueError("index build options '--max-passage-length' and '--batch-size' must be >= 1")
    check_out_folder(args.out)  # a folder holding other files is refused before anything loads
    passages = load_corpus(args.corpus)
    if not passages:
        raise ValueError(f"corpus {args.corpus!r} has no passages")
    settings = EncoderSettings(args.encoder, args.pooling, args.normalize, args.passage_prefix,
                               args.max_passage_length)
    tower = EncoderTower(load_encoder(args.encoder), load_tokenizer(args.encoder), args.pooling, args.normalize,
                         args.passage_prefix, args.max_passage_length).freeze().to(args.device)

    def encode(texts: list[str]):
        return encode_by_length(tower, texts, args.batch_size, args.passage_prefix, args.max_passage_length)

    folder = build_index(args.corpus, passages, corpus_hash(passages), args.out, settings, encode,
                         tower.fingerprint(), tower.dim, options, args.chunk_size, progress=not args.quiet)
    print(f"bridge-pl: index written to {folder}; point a config at it with "
          f"model.retriever.init_args.index_path: {folder}")


def index_main(argv: list[str]) -> None:
    """``bridge-pl index build|info``."""
    args = _parser().parse_args(argv)
    if args.command == "build":
        try:
            with stopped_by_signals():
                build_main(args)
        except BuildStopped as stop:
            sys.stderr.write(stopped_line(args.out, stop.signum, argv) + "\n")
            raise SystemExit(128 + stop.signum) from None
    else:
        from bridge_pl.retrieval.built_index import index_info

        print("\n".join(index_info(args.path, verify=args.verify)))
