"""``bridge-pl index build`` killed with ``kill -9`` and rerun: does the resumed build equal an uninterrupted one?

Builds the same index three times into ``--work``: once uninterrupted (timed), once killed right after an embedding
shard is finished (a chunk boundary) and once killed halfway through encoding the next shard (mid-chunk, half the
previous shard's encoding time later); each killed build is rerun once with the same command. Every file of the
resumed build is compared byte for byte with the uninterrupted build's, and the shards finished before the kill
must not have been rewritten.

Usage: python experiments/index_resume/resume_check.py --work DIR [--corpus wikipedia] [--chunk-size 1000]
                                                       [--kill-after 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bridge_pl.files import digest_path
from bridge_pl.retrieval.built_index import INDEX_FILE
from bridge_pl.retrieval.store import shard_path


def build_command(args, out: Path) -> list[str]:
    return [sys.executable, "-m", "bridge_pl.cli", "index", "build", "--corpus", args.corpus, "--encoder", args.encoder,
            "--kind", args.kind, "--chunk-size", str(args.chunk_size), "--out", str(out), "--quiet"]


def run_build(args, out: Path) -> float:
    """One build to the end; its wall seconds."""
    start = time.perf_counter()
    subprocess.run(build_command(args, out), check=True)
    return time.perf_counter() - start


def killed_build(args, out: Path, fraction: float) -> int:
    """Start a build, wait until shard ``args.kill_after`` is finished (timing it), wait ``fraction`` of that
    shard's time more, then ``kill -9`` it. Returns the number of finished shards at the kill."""
    proc = subprocess.Popen(build_command(args, out))

    def wait_for(shard: int) -> None:
        while not digest_path(shard_path(out, shard)).exists():  # the shard is finished
            assert proc.poll() is None, f"the build ended before shard {shard} was finished"
            time.sleep(0.005)

    wait_for(args.kill_after - 1)
    start = time.perf_counter()
    wait_for(args.kill_after)
    time.sleep(fraction * (time.perf_counter() - start))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return len(list(out.glob("emb-*.f16.b2")))


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="an empty folder for the three builds")
    p.add_argument("--corpus", default="wikipedia")
    p.add_argument("--encoder", default="minilm-l6")
    p.add_argument("--kind", default="ivf_pq")
    p.add_argument("--chunk-size", type=int, default=1000)
    p.add_argument("--kill-after", type=int, default=3, help="kill after shard KILL_AFTER (0-based) is finished")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    seconds = run_build(args, work / "uninterrupted")
    reference = files(work / "uninterrupted")
    shards = sum(name.endswith(".f16") for name in reference)
    print(f"uninterrupted: {shards} shards, {sum(map(len, reference.values())) / 1e6:.1f} MB, {seconds:.1f} s")
    print("| kill | shards finished at the kill | resume (s) | files equal to the uninterrupted build | "
          "finished shards rewritten |")
    print("|---|---|---|---|---|")
    for name, fraction in (("chunk boundary", 0.0), ("mid-chunk", 0.5)):
        out = work / name.replace(" ", "_")
        done = killed_build(args, out, fraction)
        assert not (out / INDEX_FILE).exists(), "the build finished before the kill"
        kept = {q.name: q.stat().st_mtime_ns for q in out.glob("emb-*.f16") if digest_path(q).exists()}
        resume_s = run_build(args, out)
        rewritten = sum((out / n).stat().st_mtime_ns != t for n, t in kept.items())
        print(f"| {name} | {done} of {shards} | {resume_s:.1f} | {files(out) == reference} | {rewritten} |")


if __name__ == "__main__":
    main()
