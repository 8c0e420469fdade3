"""vLLM's KV-cache block size on the demo's multi-turn rollouts: sampled tokens/s, alternating in one process.

Builds ``configs/demo.yaml`` as the CLI does, runs its warm start (``benchmarks/rollout_bench.py``'s), then for each
round samples the first training batch (4 prompts x 8 samples, searches through the module's retriever, the same
generator seed every time) once with the ``hf`` backend and once with a fresh vLLM engine per block size (each
built, pushed the weights, timed on the rollout alone, then closed). Rounds alternate the sizes so that drifts of
the machine's speed reach all of them. Usage::

    python experiments/vllm_block_size/compare.py [--rounds 3] [--sizes 128 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from rollout_bench import cpu_model, sampled_tokens, timed, warm_start  # noqa: E402

from bridge_pl.cli import BridgeCLI  # noqa: E402
from bridge_pl.rollout import HFRolloutEngine, SearchEnv  # noqa: E402
from bridge_pl.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 32], help="block sizes (multiples of 16)")
    args = parser.parse_args()

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    cli = BridgeCLI(args=["--config", args.config, "--trainer.logger=false",
                          f"--trainer.default_root_dir={ROOT / 'runs' / 'vllm_block_size'}"], run=False)
    module, data = cli.model, cli.datamodule
    data.trainer = cli.trainer
    module.setup("fit")
    warm = next(c for c in cli.trainer.callbacks if type(c).__name__ == "WarmStart")
    warm_start(cli, warm.steps)
    policy, tok = module.policy, module.policy.tokenizer
    env = SearchEnv(data.collector.prompts.env, tok)
    limits = dataclasses.asdict(data.collector.limits)
    prompts = [data.collector.prompts.ids(tok, ex.question) for ex in next(iter(data.train_dataloader()))]

    def rate(engine) -> float:
        gen = torch.Generator(device=module.device).manual_seed(data.seed)
        trajectories, seconds = timed(lambda: engine.rollout(
            policy, prompts, lambda q: module.retrieve(q, stochastic=True, generator=gen),
            n_samples=data.n_samples, generator=gen))
        return sampled_tokens(trajectories) / seconds

    hf = HFRolloutEngine(env, **limits)
    hf.rollout(policy, prompts[:1], lambda q: module.retrieve(q, stochastic=False), greedy=True)  # warm-up
    rates: dict[str, list[float]] = {"hf": []} | {f"vllm block {s}": [] for s in args.sizes}
    for r in range(args.rounds):
        rates["hf"].append(rate(hf))
        for size in args.sizes if r % 2 == 0 else reversed(args.sizes):
            engine = VLLMRolloutEngine(env, **limits, seed=data.seed,
                                       config=dataclasses.replace(data.collector.vllm, block_size=size))
            engine.sync(policy)
            rates[f"vllm block {size}"].append(rate(engine))
            engine.close()
    print(f"{Path(args.config).name}: {len(prompts)} prompts x {data.n_samples} samples, CPU {cpu_model()}, "
          f"{args.rounds} rounds")
    print(f"{'sampler':<18}{'tokens/s per round':<32}{'median':>8}{'vs hf (per-round median)':>26}")
    for name, values in rates.items():
        ratio = statistics.median(v / h for v, h in zip(values, rates["hf"]))
        print(f"{name:<18}{', '.join(f'{v:.1f}' for v in values):<32}{statistics.median(values):>8.1f}"
              f"{ratio:>25.2f}x")


if __name__ == "__main__":
    main()
