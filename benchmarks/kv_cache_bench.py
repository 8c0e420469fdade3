"""Greedy decoding with the rollout engine's KV cache (``GrowingLayer``) vs transformers' ``DynamicCache``.

transformers' dynamic cache appends by ``torch.cat``, copying each layer's whole cache at every step; the engine's
layers write each step into spare room (``bridge_pl.rollout.cache``). Both decode the same greedy tokens from the
same prefill through ``bridge_pl.rollout.engine._forward`` (the policy model, ``sdpa_decode`` attention, bfloat16
where supported, bridge-pl's allocator setting); three rounds in alternating order, median seconds of the decode
steps; also whether every step's logits are bit-identical. Shape: the demo's evaluation batch (48 rows, 169 prompt
tokens, a turn's 40 tokens and beyond). Timings need an otherwise idle machine. Usage::

    python benchmarks/kv_cache_bench.py [--model smollm2-135m-instruct] [--threads 2]
"""

from __future__ import annotations

import statistics
import time

import torch
from decode_attention_bench import model_arguments  # benchmarks/, the script's folder
from transformers.cache_utils import DynamicCache

from bridge_pl.allocator import reuse_freed_memory
from bridge_pl.attention import use_decode_attention
from bridge_pl.models import load_causal_lm
from bridge_pl.policy import resolve_dtype
from bridge_pl.rollout.cache import growing_cache
from bridge_pl.rollout.engine import _forward

ROWS, PROMPT, STEPS, ROUNDS = 48, 169, 120, 3
CACHES = {"transformers": lambda config: DynamicCache(config=config), "growing": growing_cache}


def decode(model, prompt: torch.Tensor, make_cache) -> tuple[float, list[torch.Tensor]]:
    """Prefill ``prompt [B, T]``, then ``STEPS`` greedy steps: (seconds of the steps, each step's logits)."""
    attn = torch.ones_like(prompt)
    logits, cache = _forward(model, prompt, attn, make_cache(model.config))
    seen = [logits]
    start = time.perf_counter()
    for _ in range(STEPS):
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        logits, cache = _forward(model, logits.argmax(-1, keepdim=True), attn, cache)
        seen.append(logits)
    return time.perf_counter() - start, seen


def main() -> None:
    args = model_arguments(__doc__)
    reuse_freed_memory()
    dtype = resolve_dtype("auto")
    model = load_causal_lm(args.model, dtype=dtype).eval()
    use_decode_attention(model)
    prompt = torch.randint(100, 40000, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    print(f"{args.model}, {str(dtype).removeprefix('torch.')}, {args.threads} threads: {ROWS} rows, {PROMPT}-token "
          f"prefill, then {STEPS} greedy decode steps; median of {ROUNDS} alternating rounds")
    times: dict[str, list[float]] = {name: [] for name in CACHES}
    logits: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for r in range(ROUNDS):
            for name in CACHES if r % 2 == 0 else reversed(CACHES):
                seconds, logits[name] = decode(model, prompt, CACHES[name])
                times[name].append(seconds)
    plain, growing = statistics.median(times["transformers"]), statistics.median(times["growing"])
    same = all(torch.equal(a, b) for a, b in zip(logits["transformers"], logits["growing"], strict=True))
    print(f"{'cache':<14}{'decode s':>10}{'ms/step':>10}")
    for name, seconds in (("transformers", plain), ("growing", growing)):
        print(f"{name:<14}{seconds:>10.2f}{1000 * seconds / STEPS:>10.1f}")
    print(f"transformers / growing = {plain / growing:.2f}; logits bit-identical at every step: {same}")


if __name__ == "__main__":
    main()
