"""Dense retrieval costs: corpus encoding, embedding-cache hits, and flat vs IVF vs HNSW search.

1. Encoding: ``DenseRetriever.prepare()`` on ``--passages`` synthetic passages (60-120 words) with the
   given encoder on CPU, first run (encode + cache write) vs second run (cache hit); passages/s.
2. Search: clustered random unit vectors (``--dim``) at each ``--sizes`` corpus size; build time,
   ms/query for a batch of ``--queries`` queries, recall@10 against the exact flat index, and the
   speed-up over flat, for each index kind with default and wider search beams. The vectors are
   a hard case for ANN (many near-equidistant neighbours inside each cluster).

Usage: python benchmarks/retrieval_bench.py [--passages 2000] [--sizes 10000 100000] [--dim 384]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import numpy as np
import torch

from bridge_pl.records import Passage
from bridge_pl.retrieval.dense import DenseRetriever
from bridge_pl.retrieval.index import DenseIndex, topk_overlap

WORDS = (
    "river city king born founded capital war empire music science church school village mountain "
    "island army company language author novel film team league season river bridge railway station "
    "museum painter poet treaty century province district population election party government bank "
    "market harbour castle temple festival dynasty republic coast valley forest desert lake border"
).split()


# Default options first, then a wider search beam for each approximate kind.
VARIANTS = (
    ("flat", {"kind": "flat"}),
    ("ivf", {"kind": "ivf"}),
    ("ivf nprobe=128", {"kind": "ivf", "nprobe": 128}),
    ("hnsw", {"kind": "hnsw"}),
    ("hnsw ef=512", {"kind": "hnsw", "ef_search": 512}),
)


def synthetic_passages(n: int, seed: int = 0) -> list[Passage]:
    rng = random.Random(seed)
    return [
        Passage(str(i), " ".join(rng.choices(WORDS, k=2)).title(),
                " ".join(rng.choices(WORDS, k=rng.randint(60, 120))))
        for i in range(n)
    ]


def clustered(n: int, dim: int, clusters: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, dim]`` float32 unit vectors around ``clusters`` random centres."""
    centres = rng.normal(size=(clusters, dim)).astype(np.float32)
    x = centres[rng.integers(clusters, size=n)] + 0.5 * rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def bench_encoding(encoder: str, n: int, batch_size: int) -> None:
    passages = synthetic_passages(n)
    with tempfile.TemporaryDirectory() as cache:
        times = []
        for _ in range(2):
            retriever = DenseRetriever(passages, encoder=encoder, cache_dir=cache, batch_size=batch_size,
                                       progress=False)
            start = time.perf_counter()
            retriever.prepare()
            times.append(time.perf_counter() - start)
        assert retriever.encoded_passages == 0, "second prepare() re-encoded"
    print(f"\n== corpus encoding: {encoder}, {n} passages, batch {batch_size}, "
          f"{torch.get_num_threads()} threads ==")
    print(f"first prepare (encode + cache write): {times[0]:8.2f} s  = {n / times[0]:8.1f} passages/s")
    print(f"second prepare (cache hit):           {times[1]:8.2f} s  = {times[0] / times[1]:8.1f}x faster")


def bench_search(sizes: list[int], dim: int, n_queries: int, k: int) -> None:
    rng = np.random.default_rng(0)
    print(f"\n== search: dim {dim}, {n_queries} queries per batch, k={k}, clustered unit vectors ==")
    print(f"{'N':>8} {'index':>14} {'build s':>8} {'ms/query':>9} {'x flat':>7} {'recall@10':>9}")
    for n in sizes:
        clusters = max(10, n // 1000)
        emb = clustered(n, dim, clusters, rng)
        queries = clustered(n_queries, dim, clusters, rng)
        exact_rows, flat_ms = None, None
        for label, options in VARIANTS:
            start = time.perf_counter()
            index = DenseIndex.build(emb, **options)
            build = time.perf_counter() - start
            index.search(queries[:8], k)  # warm-up
            start = time.perf_counter()
            _, rows = index.search(queries, k)
            ms = 1000 * (time.perf_counter() - start) / n_queries
            if label == "flat":
                exact_rows, flat_ms = rows, ms
            recall = topk_overlap(rows, exact_rows)
            print(f"{n:>8} {label:>14} {build:>8.2f} {ms:>9.3f} {flat_ms / ms:>6.1f}x {recall:>9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="minilm-l6")
    parser.add_argument("--passages", type=int, default=2000, help="0 skips the encoding benchmark")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000],
                        help="corpus sizes for the search benchmark; none skips it")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    if args.passages > 0:
        bench_encoding(args.encoder, args.passages, args.batch_size)
    if args.sizes:
        bench_search(args.sizes, args.dim, args.queries, args.k)


if __name__ == "__main__":
    main()
