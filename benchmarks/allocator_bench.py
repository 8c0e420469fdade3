"""Time and peak RSS of the policy update per allocator setting: what glibc keeps, and what fresh memory costs.

``--repeats`` SmolLM2-135M policy forwards + backwards (LoRA r16, bf16 where native, activation checkpointing, as in
``configs/demo.yaml``) over ``--rows`` x ``--tokens`` random token ids with ``--scored`` scored tokens per row, in a
fresh process per allocator setting, run one after the other in the same invocation. The first update fills an
empty process; the later ones are what every update of a training run costs. Settings:

- ``default``: glibc as it comes (its mmap threshold rises after large frees, up to 32 MiB, and the heap keeps
  freed blocks below it; larger blocks are mapped afresh each time);
- ``no-mmap``: ``MALLOC_MMAP_MAX_=0`` and a 2 GiB ``MALLOC_TRIM_THRESHOLD_``: every freed block stays in the heap
  for the next allocation, so no large tensor is mapped (and faulted in) afresh;
- ``mmap-1M`` / ``mmap-4M``: ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 / 4 MiB (large blocks go back to the OS on free);
- ``mmap-1M+thp``: the 1 MiB threshold with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (those mappings use
  transparent huge pages, so fewer page faults).

Prints the first update's time, the mean of the later ones, the peak RSS above the post-load baseline and their
ratios to ``default``. Timings need an otherwise idle machine. Usage::

    python benchmarks/allocator_bench.py            # the demo's update shape, ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

SETTINGS = {
    "default": {},
    "no-mmap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)},
    "mmap-1M": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "mmap-1M+thp": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    "mmap-4M": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)},
}


def child(args: argparse.Namespace) -> dict:
    import psutil
    import torch

    from bridge_pl.policy import Policy

    torch.set_num_threads(args.threads)
    policy = Policy("smollm2-135m-instruct", lora_r=16, lora_alpha=32, gradient_checkpointing=True).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (args.rows, args.tokens), generator=generator)
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[:, args.tokens - args.scored :] = True
    process, peak, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            stop.wait(0.003)

    baseline = process.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        logp = policy(ids, torch.ones_like(ids), score_mask=scored)[0]
        (logp * scored).sum().backward()
        seconds.append(time.perf_counter() - start)
        policy.model.zero_grad(set_to_none=True)
        del logp
    stop.set()
    sampler.join()
    later = seconds[1:] or seconds
    return {"first_s": seconds[0], "later_s": sum(later) / len(later), "peak_mb": (peak[0] - baseline) / 2**20,
            "dtype": str(policy.weight_dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=386, help="tokens per row (the demo's mean trajectory)")
    parser.add_argument("--scored", type=int, default=67, help="scored tokens per row (the demo's sampled tokens)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3, help="updates per process (the first fills it)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    flags = ["--rows", str(args.rows), "--tokens", str(args.tokens), "--scored", str(args.scored),
             "--threads", str(args.threads), "--repeats", str(args.repeats), "--child"]
    results = {}
    for name, env in SETTINGS.items():
        out = subprocess.run([sys.executable, __file__, *flags], env={**os.environ, **env}, capture_output=True,
                             text=True, check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["default"]
    print(f"policy forward + backward: {args.rows} x {args.tokens} tokens, {args.scored} scored per row, "
          f"{results['default']['dtype']}, activation checkpointing, {args.threads} threads, {args.repeats} updates "
          f"per process (load average {os.getloadavg()[0]:.2f})")
    print("| allocator | first update s | later updates s (mean) | peak RSS above baseline MB | first / default | "
          "later / default | peak / default |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['first_s']:.2f} | {r['later_s']:.2f} | {r['peak_mb']:.0f} | "
              f"{r['first_s'] / base['first_s']:.2f} | {r['later_s'] / base['later_s']:.2f} | "
              f"{r['peak_mb'] / base['peak_mb']:.2f} |")


if __name__ == "__main__":
    main()
