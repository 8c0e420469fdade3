"""Recall@k of the *untrained* MiniLM retriever on the synthetic world (how hard are its distractors?).

Encodes the world corpus (FlashRAG ``contents``) and the dev+test queries with all-MiniLM-L6-v2
(mean pooling over non-pad tokens, L2 norm), searches by brute-force inner product and reports
recall@1/3/10 of the gold passage per question type and hop:

- single: the question -> its one gold passage;
- bridge hop 1: the question -> the first entity's passage;
- bridge hop 2: the follow-up query one would issue after hop 1 (``metadata["hop_queries"][1]``, e.g.
  "<city name> country") -> the second entity's passage;
- comparison hop 1 / hop 2: "<name> born" / "<name> founded" -> each compared entity's passage.

Usage: python benchmarks/world_recall.py [--seed 0] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from bridge_pl.data.world import build_world, hop_probes
from bridge_pl.models import load_encoder, load_tokenizer

KS = (1, 3, 10)


@torch.no_grad()
def encode(texts: list[str], model, tokenizer, batch_size: int) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings: ``[len(texts), hidden]`` float32."""
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=256,
                          return_tensors="pt")
        hidden = model(**batch).last_hidden_state  # [B, T, H]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="world seed")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    world = build_world(args.seed)
    model, tokenizer = load_encoder("minilm-l6").eval(), load_tokenizer("minilm-l6")
    start = time.perf_counter()
    passages = encode([p.contents for p in world.corpus], model, tokenizer, args.batch_size)  # [N, H]
    row_of = {p.id: i for i, p in enumerate(world.corpus)}
    print(f"world seed {args.seed}: {len(world.corpus)} passages, {len(world.dev) + len(world.test)} "
          f"dev+test questions; untrained minilm-l6, brute-force inner product")
    print(f"{'probe':<18}{'n':>6}" + "".join(f"{f'R@{k}':>8}" for k in KS))
    for name, pairs in hop_probes(world.dev + world.test).items():
        queries = encode([q for q, _ in pairs], model, tokenizer, args.batch_size)  # [Q, H]
        top = (queries @ passages.T).topk(max(KS), dim=1).indices  # [Q, max k]
        gold = torch.tensor([row_of[g] for _, g in pairs]).unsqueeze(1)  # [Q, 1]
        hits = top == gold  # [Q, max k]
        recalls = [hits[:, :k].any(1).float().mean().item() for k in KS]
        print(f"{name:<18}{len(pairs):>6}" + "".join(f"{r:>8.3f}" for r in recalls))
    print(f"(encoding + search took {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
