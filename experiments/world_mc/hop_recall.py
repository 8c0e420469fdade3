"""The retriever's recall@k on the world's own hop queries, for the config's retriever as built and after training.

Prints recall@k (k = ``model.retrieval.top_k``) of the retriever's query tower on the gold passage of every hop of a
split (``bridge_pl.miss_analysis.retriever_hop_recall`` over ``hop_probes``: the queries stored with the questions,
not the policy's), first as the config builds it, then with each checkpoint's weights loaded. It separates what RL
did to the retriever from what the policy searches.

Usage: python experiments/world_mc/hop_recall.py [--config configs/world_mc.yaml] [--split world-mc/dev] CKPT...
"""

from __future__ import annotations

import argparse

import torch

from bridge_pl.checkpoint_io import checkpoint_problem
from bridge_pl.cli import BridgeCLI
from bridge_pl.miss_analysis import retriever_hop_recall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="*", help="checkpoints of runs of the same config")
    p.add_argument("--config", default="configs/world_mc.yaml")
    p.add_argument("--split", default="world-mc/dev")
    args = p.parse_args()
    cli = BridgeCLI(args=["--config", args.config, "--data.engine=hf"], run=False)
    examples = cli.datamodule.load(args.split)
    module = cli.model
    print(f"as built: {retriever_hop_recall(module.retriever, examples, module.retrieval_config.top_k):.3f}")
    for path in args.checkpoints:
        if problem := checkpoint_problem(path):
            raise SystemExit(f"{path}: {problem}")
        module.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"], strict=False)
        print(f"{path}: {retriever_hop_recall(module.retriever, examples, module.retrieval_config.top_k):.3f}")


if __name__ == "__main__":
    main()
