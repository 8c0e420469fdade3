"""How far the merged-LoRA sampler is from the policy the losses compute: per-token log-prob gaps on a real batch.

Rollouts generate with each LoRA delta merged into the base weights (``Policy.generation_model``); the losses score
the same tokens through peft's adapters (π_old is the losses' first forward). This script builds one training
rollout batch of a config (default ``configs/demo.yaml``, as the CLI builds it; ``--ckpt`` loads a run's trained
adapter and query encoder, e.g. ``runs/<run>/checkpoints/last.ckpt``), scores every sampled token both ways at the
batch's temperature, and prints the gap ``log p_merged - log p_adapters`` over the sampled tokens (mean, mean
absolute, quantiles of the absolute value) and per trajectory as the importance ratio ``exp(sum of the gaps)``
that a truncated-importance-sampling correction would apply. In the same run, for scale: the gap between the
adapters in the policy's dtype and a float32 copy of the same policy (how far the learner itself is from exact
arithmetic), the merged sampler against that copy, and two scorings through the adapters that differ only in how
many rows share a forward (8 and 1: the scoring's own noise). Usage::

    python benchmarks/merge_gap.py --ckpt runs/demo/checkpoints/last.ckpt [--prompts 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings
from pathlib import Path

import torch

from bridge_pl.cli import BridgeCLI

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Other arguments (--data.x=..., --model.x=...) override the config.")
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    parser.add_argument("--ckpt", default=None, help="a run's checkpoint (its trained adapter); default: none")
    parser.add_argument("--prompts", type=int, default=4, help="training prompts, each a group of data.n_samples")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    cli = BridgeCLI(args=["--config", args.config, "--trainer.logger=false", f"--data.batch_size={args.prompts}",
                          "--data.filter_groups=false", *overrides], run=False)
    module, data = cli.model, cli.datamodule
    data.trainer = cli.trainer
    module.setup("fit")
    if args.ckpt:
        module.load_state_dict(torch.load(args.ckpt, map_location="cpu", weights_only=True)["state_dict"], strict=False)
    policy = module.policy
    if not policy.generates_merged:
        raise SystemExit("this policy generates through its adapters (nothing merged): no gap to measure")
    batch = data.rollout(module, list(next(iter(data.train_dataloader()))), training=True, dataset="train")
    ids, attn, temperature = batch.input_ids, batch.attention_mask, batch.temperature
    with policy.generation_model():  # the policy's own model, merged in place
        sampler = policy.logprobs(ids, attn, temperature=temperature)
    adapters = policy.logprobs(ids, attn, temperature=temperature)
    one_row = policy.logprobs(ids, attn, micro_batch=1, temperature=temperature)
    float32 = copy.deepcopy(policy).float().logprobs(ids, attn, temperature=temperature)
    sampled = batch.action_mask.bool()
    print(f"{Path(args.config).name}, {policy.name} ({str(policy.weight_dtype).removeprefix('torch.')}), "
          f"checkpoint {args.ckpt or 'none (the initial adapter)'}: {len(sampled)} trajectories, {int(sampled.sum())} "
          f"sampled tokens, temperature {batch.temperature}")
    print("log-prob gap per sampled token and exp(sum of the gaps) per trajectory:")
    print(f"{'':<34}{'mean':>10}{'mean |.|':>10}{'median |.|':>11}{'p99 |.|':>10}{'max |.|':>10}"
          f"{'ratio min':>10}{'median':>8}{'max':>8}")
    dtype = str(policy.weight_dtype).removeprefix("torch.")
    for name, a, b in (("merged - adapters (the sampler)", sampler, adapters),
                       (f"adapters {dtype} - float32 copy", adapters, float32),
                       (f"merged {dtype} - float32 copy", sampler, float32),
                       ("adapters, 8 rows - 1 row", adapters, one_row)):
        gap = (a - b)[sampled]
        ratio = ((a - b) * sampled).sum(-1).exp()
        median, p99 = torch.quantile(gap.abs().double(), torch.tensor([0.5, 0.99], dtype=torch.double)).tolist()
        print(f"{name:<34}{gap.mean():>+10.1e}{gap.abs().mean():>10.1e}{median:>11.1e}{p99:>10.1e}"
              f"{gap.abs().max():>10.1e}{ratio.min():>10.4f}{ratio.median():>8.4f}{ratio.max():>8.4f}")


if __name__ == "__main__":
    main()
