"""The retriever's recall@k on the world's own hop queries, for the config's retriever as built and after training.

Prints recall@k (k = ``model.retrieval.top_k``) of the retriever's query tower on the gold passage of every hop of a
split (``hop_probes``: the queries stored with the questions, not the policy's), first as the config builds it, then
with each checkpoint's weights loaded. It separates what RL did to the retriever from what the policy searches.

Usage: python experiments/world_mc/hop_recall.py [--config configs/world_mc.yaml] [--split world-mc/dev] CKPT...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_modes import hop_recall  # noqa: E402

from bridge_pl.checkpoint_io import checkpoint_problem  # noqa: E402
from bridge_pl.cli import BridgeCLI  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="*", help="checkpoints of runs of the same config")
    p.add_argument("--config", default="configs/world_mc.yaml")
    p.add_argument("--split", default="world-mc/dev")
    args = p.parse_args()
    cli = BridgeCLI(args=["--config", args.config, "--data.engine=hf"], run=False)
    examples = cli.datamodule.load(args.split)
    print(f"as built: {hop_recall(cli.model, examples):.3f}")
    for path in args.checkpoints:
        if problem := checkpoint_problem(path):
            raise SystemExit(f"{path}: {problem}")
        cli.model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"], strict=False)
        print(f"{path}: {hop_recall(cli.model, examples):.3f}")


if __name__ == "__main__":
    main()
