"""One-token decode steps: transformers' SDPA vs ``sdpa_decode`` (bridge_pl.attention), side by side in one run.

The policy model (default SmolLM2-135M-Instruct, bfloat16 where supported) is prefilled with ``B x L`` random
tokens, then 15 decode steps are timed per implementation, three rounds in alternating order. Two masks:
``padded`` (a quarter of the rows left-padded, so transformers passes a boolean mask) and ``unpadded`` (every row
full: transformers passes no mask and CPU SDPA takes its flash kernel). Timings need an otherwise idle machine.
Usage::

    python benchmarks/decode_attention_bench.py [--model smollm2-135m-instruct] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bridge_pl import attention
from bridge_pl.models import load_causal_lm
from bridge_pl.policy import resolve_dtype

SHAPES = ((32, 250), (48, 300))  # (rows, cached tokens): the demo's rollout and evaluation batches
STEPS, ROUNDS = 15, 3


def step_ms(model, ids: torch.Tensor, attn: torch.Tensor) -> float:
    """Milliseconds per decode step after prefilling ``ids``."""
    with torch.no_grad():
        cache = model(ids, attention_mask=attn, use_cache=True).past_key_values
        token = torch.randint(100, 20000, (ids.shape[0], 1))
        start = time.perf_counter()
        for _ in range(STEPS):
            attn = torch.cat([attn, torch.ones(ids.shape[0], 1, dtype=attn.dtype)], dim=1)
            cache = model(token, attention_mask=attn, past_key_values=cache, use_cache=True).past_key_values
    return (time.perf_counter() - start) / STEPS * 1000


def model_arguments(description: str) -> argparse.Namespace:
    """``--model`` and ``--threads`` of a micro-benchmark of the policy model (also ``lm_head_bench``); sets torch's
    thread count."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = model_arguments(__doc__)
    torch.manual_seed(0)
    model = load_causal_lm(args.model, dtype=resolve_dtype("auto")).eval()
    print(f"{args.model} ({model.dtype}), threads={args.threads}, {STEPS} steps x {ROUNDS} rounds (median)")
    print(f"{'rows x cached':<15}{'mask':<10}{'sdpa ms':>9}{'sdpa_decode ms':>16}{'speed-up':>10}")
    for rows, length in SHAPES:
        ids = torch.randint(100, 20000, (rows, length))
        for mask in ("padded", "unpadded"):
            attn = torch.ones_like(ids)
            if mask == "padded":
                attn[: rows // 4, :30] = 0
            times: dict[str, list[float]] = {"sdpa": [], attention.NAME: []}
            for round_ in range(ROUNDS):
                for impl in list(times) if round_ % 2 == 0 else reversed(list(times)):
                    model.set_attn_implementation(impl)
                    times[impl].append(step_ms(model, ids, attn))
            plain, ours = statistics.median(times["sdpa"]), statistics.median(times[attention.NAME])
            print(f"{f'{rows} x {length}':<15}{mask:<10}{plain:>9.0f}{ours:>16.0f}{plain / ours:>9.2f}x")


if __name__ == "__main__":
    main()
