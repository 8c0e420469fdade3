"""One-token decode steps: the policy's default attention (``sdpa_prefix``: transformers' SDPA) against the opt-in
``sdpa_decode`` (two matmuls over the grouped heads; ``Policy(decode_matmul=True)``), side by side in one run.

The policy model (default SmolLM2-135M-Instruct, bfloat16 where supported) is prefilled with ``rows x cached``
random tokens once per mask; then ``--steps`` decode steps from a copy of that cache are timed per implementation,
``--rounds`` rounds in alternating order (median reported). Two masks: ``padded`` (a quarter of the rows
left-padded, so transformers passes a mask) and ``unpadded`` (every row full: transformers passes no mask, and CPU
SDPA takes its flash kernel). Timings need an otherwise idle machine. Usage::

    python benchmarks/decode_attention_bench.py [--model smollm2-135m-instruct] [--threads 2] [--shapes 32x250]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from bridge_pl import attention
from bridge_pl.models import load_causal_lm
from bridge_pl.policy import resolve_dtype


def step_ms(model, cache, attn: torch.Tensor, steps: int) -> float:
    """Milliseconds per decode step from a copy of the prefilled ``cache`` (``attn``: its ``[rows, cached]`` mask)."""
    cache = copy.deepcopy(cache)
    token = torch.randint(100, 20000, (attn.shape[0], 1))
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(steps):
            attn = torch.cat([attn, torch.ones(attn.shape[0], 1, dtype=attn.dtype)], dim=1)
            cache = model(token, attention_mask=attn, past_key_values=cache, use_cache=True).past_key_values
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=["32x250"],
                        help="rows x cached tokens (the demo's rollout batch: 32x250; its evaluations: 48x300)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_causal_lm(args.model, dtype=resolve_dtype("auto")).eval()
    default, opt_in = attention.NAME, attention.DECODE_NAME
    print(f"{args.model} ({model.dtype}), threads={args.threads}, {args.steps} steps x {args.rounds} rounds (median); "
          f"load average when started {os.getloadavg()[0]:.2f} (timings need an otherwise idle machine)")
    print(f"{'rows x cached':<15}{'mask':<10}{default + ' ms':>16}{opt_in + ' ms':>16}{'ratio':>8}")
    for shape in args.shapes:
        rows, length = map(int, shape.split("x"))
        ids = torch.randint(100, 20000, (rows, length))
        for mask in ("padded", "unpadded"):
            attn = torch.ones_like(ids)
            if mask == "padded":
                attn[: rows // 4, :30] = 0
            with torch.no_grad():  # the prefill runs SDPA in both; each timing decodes from a copy of its cache
                cache = model(ids, attention_mask=attn, use_cache=True).past_key_values
            times: dict[str, list[float]] = {default: [], opt_in: []}
            for round_ in range(args.rounds):
                for name in list(times) if round_ % 2 == 0 else reversed(list(times)):
                    model.set_attn_implementation(name)
                    times[name].append(step_ms(model, cache, attn, args.steps))
            base, ours = statistics.median(times[default]), statistics.median(times[opt_in])
            print(f"{f'{rows} x {length}':<15}{mask:<10}{base:>16.0f}{ours:>16.0f}{base / ours:>7.2f}x")
    print(f"ratio: {default} time / {opt_in} time (above 1: the opt-in matmul path is faster)")


if __name__ == "__main__":
    main()
