"""The LM head on each row's last position: a strided ``hidden[:, -1:]`` view vs the gathered contiguous rows.

``logits_to_keep=1`` makes transformers slice ``hidden[:, -1:]``; for a forward of several tokens (a prefill, an
observation fed to the cache) that view is strided, and when the head is frozen (LoRA: the demo) CPU ``F.linear``
then runs a batched matmul against the head expanded and copied once per row (``torch.matmul`` folds the rows into
one matrix only when that needs no copy, or when the weight requires grad). The rollout engine passes the last
position as an index instead (``bridge_pl.rollout.engine._forward``), which gathers contiguous rows: the floor, one
``[B, d] x [d, V]`` matmul.
The policy model's real head (default SmolLM2-135M-Instruct, bfloat16 where supported) on random hidden states;
both ways side by side, three rounds in alternating order, median; also whether the logits are bit-identical.
Shapes: the demo's evaluation and rollout batches after a prompt or an observation (``T`` new tokens), and a
decode step (``T = 1``: contiguous both ways, the control). Timings need an otherwise idle machine. Usage::

    python benchmarks/lm_head_bench.py [--model smollm2-135m-instruct] [--threads 2]
"""

from __future__ import annotations

import statistics
import time

import torch
from decode_attention_bench import model_arguments  # benchmarks/, the script's folder

from bridge_pl.models import load_causal_lm
from bridge_pl.policy import resolve_dtype

SHAPES = ((48, 169), (32, 169), (48, 1))  # (rows, new tokens in the forward)
ROUNDS, CALLS = 3, 2


def seconds_per_call(head: torch.nn.Module, rows: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        head(rows)
    return (time.perf_counter() - start) / CALLS


def main() -> None:
    args = model_arguments(__doc__)
    dtype = resolve_dtype("auto")
    head = load_causal_lm(args.model, dtype=dtype).get_output_embeddings().requires_grad_(False)  # frozen, as in LoRA
    vocab, width = head.weight.shape
    print(f"{args.model} head {vocab} x {width}, {str(dtype).removeprefix('torch.')}, {args.threads} threads; "
          f"median of {ROUNDS} alternating rounds of {CALLS} calls")
    print(f"{'rows x T':<10}{'hidden[:, -1:] (s)':>20}{'gathered (s)':>14}{'ratio':>8}  bit-identical")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for batch, length in SHAPES:
            hidden = torch.randn(batch, length, width, generator=generator).to(dtype)
            strided, gathered = hidden[:, -1:], hidden[:, torch.tensor([length - 1])]
            same = torch.equal(head(strided), head(gathered))
            times: dict[str, list[float]] = {"strided": [], "gathered": []}
            for r in range(ROUNDS):
                order = ("strided", "gathered") if r % 2 == 0 else ("gathered", "strided")
                for name in order:
                    times[name].append(seconds_per_call(head, strided if name == "strided" else gathered))
            slow, fast = statistics.median(times["strided"]), statistics.median(times["gathered"])
            print(f"{f'{batch} x {length}':<10}{slow:>20.4f}{fast:>14.4f}{slow / fast:>8.1f}  {same}")


if __name__ == "__main__":
    main()
