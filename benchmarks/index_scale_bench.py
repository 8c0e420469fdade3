"""Retrieval at corpus scale: a flat and a compressed (``ivf_pq``) on-disk index side by side, with an extrapolation
to wiki-18 (21,015,324 passages x 768).

The corpus is synthetic: ``--n`` passages (default 2,000,000) with short synthetic texts (``--words`` words each,
about wiki-18's 100 by default) and D=768 unit embeddings drawn from a clustered, low-rank distribution (a cluster
centre + a 64-d latent direction + small isotropic noise), because encoding 2M real passages with e5-base on
2 CPU cores would take days. Queries are fresh draws from the same distribution. Both indexes are built by the
same code as ``bridge-pl index build`` (``build_index``, float16 shards, text store) from one store.

For each kind it prints: build time (the index only; the store is written once and shared), bytes on disk
(index / float16 embeddings / text), the resident memory of one process that opens index + stores and answers
``--queries`` queries in batches of ``--batch`` (RSS; its private part RssAnon and its file-backed part RssFile),
the proportional set size (PSS) of that process and of a second one answering the same queries beside it
(what the two share is split between them), recall@10 against exact search (the flat index, rescored) and
ms/query. The compressed kind rescores ``--rerank-factor * 10`` candidates per query exactly from the float16
rows, as ``DenseRetriever`` does with ``index_path``.

Usage: python benchmarks/index_scale_bench.py [--n 2000000] [--work DIR] [--m 96] [--nprobe 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bridge_pl.records import Passage
from bridge_pl.retrieval.built_index import INDEX_FILE, BuiltIndex, EncoderSettings, build_index
from bridge_pl.retrieval.index import topk_overlap

WIKI18_N, WIKI18_D = 21_015_324, 768
LATENT, NOISE = 64, 0.15
K = 10
TIMING_FILE = "build_seconds.json"
OWN_FILES = (INDEX_FILE, INDEX_FILE + ".b2", "manifest.json", TIMING_FILE)  # each kind's own files: never linked
QUERY_STREAM = 2**62  # the queries' random stream (corpus streams are row numbers)
WORDS = np.array(("river city king born founded capital war empire music science church school village mountain "
                  "island army company language author novel film team league season bridge railway station museum "
                  "painter poet treaty century province district population election party government bank market "
                  "harbour castle temple festival dynasty republic coast valley forest desert lake border").split())


class Synthetic:
    """Seeded clustered low-rank unit vectors ``[n, dim]``: row ``i`` of the corpus depends only on ``i``."""

    def __init__(self, dim: int, clusters: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.dim, self.seed = dim, seed
        self.centres = rng.normal(size=(clusters, dim)).astype(np.float32) / math.sqrt(dim)
        self.basis = rng.normal(size=(LATENT, dim)).astype(np.float32) * (0.8 / math.sqrt(dim * LATENT))

    def draw(self, n: int, stream: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, stream])
        x = (self.centres[rng.integers(len(self.centres), size=n)]
             + rng.normal(size=(n, LATENT)).astype(np.float32) @ self.basis
             + rng.normal(size=(n, self.dim)).astype(np.float32) * (NOISE / math.sqrt(self.dim)))
        return x / np.linalg.norm(x, axis=1, keepdims=True)


def rows_text(start: int, n: int, words: int) -> list[Passage]:
    rng = np.random.default_rng([7, start])
    picks = WORDS[rng.integers(len(WORDS), size=(n, words))]
    return [Passage(str(start + i), f"Topic {start + i}", " ".join(p)) for i, p in enumerate(picks)]


class LazyCorpus:
    """The synthetic passages as a sequence made on demand (never all in memory)."""

    def __init__(self, n: int, words: int, chunk: int) -> None:
        self.n, self.words, self.chunk = n, words, chunk
        self._cached: tuple[int, list[Passage]] = (-1, [])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, row: int) -> Passage:
        start = row - row % self.chunk
        if self._cached[0] != start:
            self._cached = (start, rows_text(start, min(self.chunk, self.n - start), self.words))
        return self._cached[1][row - start]

    def __iter__(self):
        return (self[i] for i in range(self.n))


def build(folder: Path, args, options: dict, store_from: Path | None) -> float:
    """Build one kind in ``folder`` (hard-linking the store from ``store_from`` when given); index seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    if store_from is not None:
        for path in store_from.iterdir():
            if path.name not in OWN_FILES and not (folder / path.name).exists():
                os.link(path, folder / path.name)
    synthetic = Synthetic(args.dim, args.clusters, args.seed)
    corpus = LazyCorpus(args.n, args.words, args.chunk)
    def encode(texts: list[str]) -> np.ndarray:  # one shard: its first row is named in its first title
        return synthetic.draw(len(texts), int(texts[0].split()[1].rstrip('"')))

    timing = folder / TIMING_FILE  # a rerun on a finished --work folder reports the first build's time
    start = time.perf_counter()
    build_index("synthetic", corpus, f"synthetic-{args.n}-{args.seed}", folder, EncoderSettings("synthetic"),
                encode, "synthetic", args.dim, options, chunk_rows=args.chunk, progress=True)
    if not timing.exists():
        timing.write_text(json.dumps(time.perf_counter() - start))
    return json.loads(timing.read_text())


def memory(index_file: Path | None = None) -> dict[str, int]:
    """This process' RSS, RssAnon, RssFile (``/proc/self/status``), PSS (``smaps_rollup``) and the resident
    pages of the mapped ``index_file`` (``IndexRss``, from ``smaps``), in bytes."""
    out = {"IndexRss": 0}
    if index_file is not None:
        inside = False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            if not line.split(" ", 1)[0].endswith(":"):  # a mapping's header line
                inside = line.endswith(str(index_file))
            elif inside and line.startswith("Rss:"):
                out["IndexRss"] += int(line.split()[1]) * 1024
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "RssAnon", "RssFile")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["Pss"] = int(line.split()[1]) * 1024
    return out


def serve(folder: Path, queries: Path, out: Path, batch: int, rerank_factor: int, nprobe: int | None,
          threads: int) -> None:
    """One process: open the index + stores, answer every query (and read the shown passages' text), record
    memory, then wait for a line on stdin and record PSS again (with the other process alive)."""
    torch.set_num_threads(threads)  # torch and FAISS share one OpenMP runtime: this sizes FAISS's threads too
    before = memory()
    built = BuiltIndex(folder, nprobe=nprobe)
    q = torch.from_numpy(np.load(queries))
    factor = 1 if built.kind == "flat" else rerank_factor
    rows, chars = [], 0
    start = time.perf_counter()
    for i in range(0, len(q), batch):
        _, r = built.search(q[i:i + batch], K, factor)
        rows.append(r)
        chars += sum(len(built.passages[row].text) for row in r.reshape(-1).tolist())
    seconds = time.perf_counter() - start
    np.save(out.with_suffix(".rows.npy"), torch.cat(rows).numpy())
    record = {"before": before, "after": memory(folder / INDEX_FILE), "ms_per_query": 1000 * seconds / len(q),
              "chars": chars}
    print("ready", flush=True)
    sys.stdin.readline()  # the other process has answered too and is alive
    record["pss_beside"] = memory()["Pss"]
    out.write_text(json.dumps(record))
    print("measured", flush=True)
    sys.stdin.readline()


def measure(folder: Path, queries: Path, work: Path, args) -> tuple[dict, dict, np.ndarray]:
    """Process 1 answers alone; process 2 answers beside it; both then report PSS with the other alive."""
    def start(name: str) -> subprocess.Popen:
        cmd = [sys.executable, __file__, "--serve", str(folder), "--query-file", str(queries),
               "--record", str(work / name), "--batch", str(args.batch), "--rerank-factor", str(args.rerank_factor),
               "--nprobe", str(args.nprobe), "--threads", str(args.threads)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        assert proc.stdout.readline().strip() == "ready", f"{name} failed"
        return proc

    procs = [start(f"{folder.name}-1.json"), start(f"{folder.name}-2.json")]
    for step in ("measured", None):  # both measure PSS while both are alive, then both exit
        for proc in procs:
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in procs:
            assert step is None or proc.stdout.readline().strip() == step
    for proc in procs:
        proc.wait()
    one, two = (json.loads((work / f"{folder.name}-{i}.json").read_text()) for i in (1, 2))
    return one, two, np.load(work / f"{folder.name}-1.rows.npy")


def disk(folder: Path) -> dict[str, int]:
    size = {p.name: p.stat().st_size for p in folder.iterdir()}
    return {"index": size[INDEX_FILE],
            "embeddings": sum(v for k, v in size.items() if k.startswith("emb-") and k.endswith(".f16")),
            "text": size["passages.jsonl"] + size["passages.offsets.npy"]}


def gb(x: float) -> str:
    return f"{x / 1e9:.3f} GB" if x < 1e11 else f"{x / 1e9:.0f} GB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=WIKI18_D)
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--words", type=int, default=100, help="words per synthetic passage")
    p.add_argument("--queries", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--chunk", type=int, default=65536, help="rows per embedding shard")
    p.add_argument("--nlist", type=int, default=None, help="default 4*sqrt(N)")
    p.add_argument("--m", type=int, default=96)
    p.add_argument("--nbits", type=int, default=8)
    p.add_argument("--nprobe", type=int, default=64)
    p.add_argument("--opq", action="store_true")
    p.add_argument("--rerank-factor", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="OMP threads of each serving process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for the stores and indexes (default: a temp folder)")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)
    p.add_argument("--query-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(Path(args.serve), Path(args.query_file), Path(args.record), args.batch, args.rerank_factor, args.nprobe,
              args.threads)
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="index_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    queries = work / "queries.npy"
    np.save(queries, Synthetic(args.dim, args.clusters, args.seed).draw(args.queries, QUERY_STREAM))
    pq = {"kind": "ivf_pq", "nlist": args.nlist, "nprobe": args.nprobe, "m": args.m, "nbits": args.nbits,
          "opq": args.opq}
    kinds = {"flat": {"kind": "flat"}, "ivf_pq": pq}
    results = {}
    for name, options in kinds.items():
        seconds = build(work / name, args, options, None if name == "flat" else work / "flat")
        one, two, rows = measure(work / name, queries, work, args)
        results[name] = {"build_s": seconds, "disk": disk(work / name), "one": one, "two": two, "rows": rows}
        print(f"[{name}] built in {seconds:.0f} s; served: {one['ms_per_query']:.2f} ms/query", flush=True)
    truth = torch.from_numpy(results["flat"]["rows"])
    for r in results.values():
        r["recall"] = topk_overlap(torch.from_numpy(r["rows"]), truth)
    report(args, results, BuiltIndex(work / "ivf_pq").index.settings())


def report(args, results: dict, pq_settings: dict) -> None:
    names = list(results)
    line = "| {:<44} | " + " | ".join("{:>16}" for _ in names) + " |"
    print(f"\nN = {args.n:,} x D = {args.dim}; {args.queries:,} queries, batch {args.batch}, k = {K}; ivf_pq: "
          f"nlist={pq_settings['nlist']}, m={pq_settings['m']}, nbits={pq_settings['nbits']}, "
          f"nprobe={pq_settings['nprobe']}, opq={pq_settings['opq']}, rerank factor {args.rerank_factor}\n")
    print(line.format("measured", *names))
    print(line.format("-" * 44, *["-" * 16] * len(names)))
    rows = [
        ("index build (s)", lambda r: f"{r['build_s']:.1f}"),
        ("index file", lambda r: gb(r["disk"]["index"])),
        ("float16 embedding store", lambda r: gb(r["disk"]["embeddings"])),
        ("text store", lambda r: gb(r["disk"]["text"])),
        ("process 1 RSS before opening", lambda r: gb(r["one"]["before"]["VmRSS"])),
        ("process 1 RSS after the queries", lambda r: gb(r["one"]["after"]["VmRSS"])),
        ("  of which private (RssAnon)", lambda r: gb(r["one"]["after"]["RssAnon"])),
        ("  of which file-backed (RssFile)", lambda r: gb(r["one"]["after"]["RssFile"])),
        ("  of which the index file's pages", lambda r: gb(r["one"]["after"]["IndexRss"])),
        ("process 1 RSS growth (opening + answering)", lambda r: gb(growth(r))),
        ("process 1 PSS alone", lambda r: gb(r["one"]["after"]["Pss"])),
        ("process 1 PSS beside process 2", lambda r: gb(r["one"]["pss_beside"])),
        ("process 2 PSS beside process 1", lambda r: gb(r["two"]["pss_beside"])),
        ("recall@10 vs exact", lambda r: f"{r['recall']:.4f}"),
        ("ms/query (batch 256)", lambda r: f"{r['one']['ms_per_query']:.3f}"),
    ]
    for label, cell in rows:
        print(line.format(label, *[cell(results[n]) for n in names]))
    flat, pq = results["flat"], results["ivf_pq"]
    print(f"\nivf_pq / flat: process RSS growth {growth(pq) / growth(flat):.4f}, index pages resident "
          f"{pq['one']['after']['IndexRss'] / flat['one']['after']['IndexRss']:.4f} (target <= 0.1); "
          f"recall@10 {pq['recall']:.4f} (target >= 0.95)")
    extrapolate(args, results, pq_settings)


def growth(r: dict) -> int:
    """RSS the process gained by opening the index and stores and answering (its baseline left out)."""
    return r["one"]["after"]["VmRSS"] - r["one"]["before"]["VmRSS"]


def extrapolate(args, results: dict, pq_settings: dict) -> None:
    """Scale each figure to wiki-18 (module docstring of the printed table says how)."""
    rows_scale, width_scale = WIKI18_N / args.n, WIKI18_D / args.dim
    nlist_21m = int(4 * math.sqrt(WIKI18_N))
    pq, flat = results["ivf_pq"], results["flat"]
    centroids = lambda nlist, dim: nlist * dim * 4  # noqa: E731 - the coarse quantizer's float32 table
    index_21m = {
        "flat": flat["disk"]["index"] * rows_scale * width_scale,
        "ivf_pq": (pq["disk"]["index"] - centroids(pq_settings["nlist"], args.dim)) * rows_scale
        + centroids(nlist_21m, WIKI18_D),
    }
    one, eight = {}, {}
    for name, r in results.items():
        after, index_now = r["one"]["after"], r["one"]["after"]["IndexRss"]
        # The index file's resident pages (measured) are swapped for wiki-18's whole index file (10,000 queries
        # touch every page of a flat index, and every list of an IVF one at this nprobe/nlist).
        file_backed = max(after["RssFile"] - index_now, 0) + index_21m[name]
        one[name] = after["RssAnon"] + file_backed
        eight[name] = 8 * after["RssAnon"] + file_backed  # mapped pages are shared, private ones are not
    print(f"\nExtrapolated to wiki-18 ({WIKI18_N:,} x {WIKI18_D}). How: files scale with rows (x 21M/N) and width "
          f"(x 768/D); the ivf_pq centroid table is recomputed for nlist={nlist_21m} (4 sqrt(N)). A process's "
          "resident memory = its measured private memory (RssAnon, kept as measured) + its file-backed pages with "
          "the index file's resident pages replaced by wiki-18's whole index file. 8 processes on "
          "one machine = 8 x the private part + the file-backed part once (the same mapped pages). The float16 "
          "store and the text are read by offset (pread), so they stay on disk and in the reclaimable page "
          "cache, outside every process.\n")
    line = "| {:<46} | {:>16} | {:>16} |"
    print(line.format("wiki-18 (extrapolated)", "flat", "ivf_pq"))
    print(line.format("-" * 46, "-" * 16, "-" * 16))
    print(line.format("index file", gb(index_21m["flat"]), gb(index_21m["ivf_pq"])))
    for label, key, scale in (("float16 embedding store (on disk)", "embeddings", rows_scale * width_scale),
                              ("text store (on disk)", "text", rows_scale)):
        print(line.format(label, *[gb(r["disk"][key] * scale) for r in (flat, pq)]))
    print(line.format("one process, resident", gb(one["flat"]), gb(one["ivf_pq"])))
    print(line.format("8 processes sharing the mapped files, resident", gb(eight["flat"]), gb(eight["ivf_pq"])))
    print(line.format("8 processes each with a private float32 copy", gb(8 * (one["flat"])), "-"))
    print(f"\nTarget: 8 processes <= 8 GB in total with ivf_pq: {gb(eight['ivf_pq'])} "
          f"({'met' if eight['ivf_pq'] <= 8e9 else 'not met'})")


if __name__ == "__main__":
    main()
