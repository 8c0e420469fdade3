"""Rollout throughput and agreement of the generation backends (``hf``, ``vllm``) at a config's real shape.

Everything is the config's (default ``configs/demo.yaml``), built as the CLI builds it: the policy (SmolLM2-135M
+ LoRA), warm-started first by the config's own ``WarmStart`` callback (its steps, data and seed; its evaluations
off), the prompts (the first training batch of the seeded stream: ``data.batch_size`` questions x ``data.n_samples``
samples, the instruction and chat template), the rollout settings (turns, budgets, temperature, top-p) and the
searches, which go through the module's retriever as in training (K' dense candidates, a Plackett-Luce sample shown).

Throughput (sampled tokens/s; each method samples its own tokens, so compare rates, not counts):

- ``hf``: bridge-pl's own decode loop (:class:`bridge_pl.rollout.HFRolloutEngine`: KV cache kept across turns, LoRA
  merged into the weights for generation);
- ``vllm``: the in-process vLLM engine (:class:`bridge_pl.rollout.vllm_engine.VLLMRolloutEngine`), weights pushed in
  before the timed rollout (the push is timed on its own: ``sync``);
- ``floor``: one single-turn Hugging Face ``generate`` of as many tokens per row as ``hf`` sampled on average (no
  turns, no env text, no searches).

Agreement, on ``--eval`` dev questions (greedy, deterministic retrieval, as in evaluation): the share of trajectories
both engines write token for token, where the others part (the first differing response position), and the mean
|log π_trainer − log π_sampler| per sampled token, π_trainer being the policy's own forward (through the adapters,
float32 log-probs) on the vLLM trajectories. Timings need an otherwise idle machine. Usage::

    python benchmarks/rollout_bench.py --json benchmarks/results/rollout_bench.json
    python benchmarks/rollout_bench.py --config configs/smoke.yaml --warm-steps 0 --eval 4 \\
        --model.policy.init_args.model=tiny-llama-hd32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from bridge_pl.cli import BridgeCLI
from bridge_pl.eval_mode import eval_mode
from bridge_pl.rollout import HFRolloutEngine, SearchEnv
from bridge_pl.rollout.vllm_engine import VLLMRolloutEngine

ROOT = Path(__file__).resolve().parents[1]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def sampled_tokens(trajectories) -> int:
    return sum(sum(t.action_mask) for t in trajectories)


def warm_start(cli: BridgeCLI, steps: int) -> None:
    """Run the config's ``WarmStart`` (``steps`` steps, no evaluations) through ``Trainer.fit`` with no RL step."""
    from callbacks import WarmStart

    warm = [c for c in cli.trainer.callbacks if isinstance(c, WarmStart)]
    if not warm or steps == 0:
        print("no warm start: the policy as loaded")
        return
    warm[0].steps, warm[0].evaluate = steps, False
    cli.trainer.callbacks[:] = warm
    cli.trainer.fit_loop.epoch_loop.max_steps = 0  # on_fit_start (the warm start) runs, no RL step
    cli.trainer.fit(cli.model, cli.datamodule)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first response position where two id lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def trainer_gap(policy, trajectories) -> float:
    """Mean |log π_trainer − log π_sampler| (nats) over the sampled tokens of ``trajectories``."""
    gaps = []
    for traj in trajectories:
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        logp = policy.logprobs(ids, torch.ones_like(ids))[0, len(traj.prompt_ids):]
        gaps += [abs(float(t) - s) for t, s, m in zip(logp, traj.sampler_logprobs, traj.action_mask) if m]
    return statistics.fmean(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Other arguments (--data.x=..., --model.x=...) override the config.")
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="default: all cores")
    parser.add_argument("--warm-steps", type=int, default=None, help="WarmStart steps (default: the config's)")
    parser.add_argument("--eval", type=int, default=48, help="dev questions for the agreement figures")
    parser.add_argument("--json", help="also write the figures here")
    args, overrides = parser.parse_known_args()

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    cli = BridgeCLI(args=["--config", args.config, "--trainer.logger=false",
                          f"--trainer.default_root_dir={ROOT / 'runs' / 'rollout_bench'}", *overrides], run=False)
    module, data = cli.model, cli.datamodule
    data.trainer = cli.trainer
    module.setup("fit")
    warm = next((c for c in cli.trainer.callbacks if type(c).__name__ == "WarmStart"), None)
    warm_steps = args.warm_steps if args.warm_steps is not None else (warm.steps if warm else 0)
    _, t_warm = timed(lambda: warm_start(cli, warm_steps))
    policy, tok = module.policy, module.policy.tokenizer
    env = SearchEnv(data.collector.prompts.env, tok)
    limits = dataclasses.asdict(data.collector.limits)
    engines = {"hf": HFRolloutEngine(env, **limits),
               "vllm": VLLMRolloutEngine(env, **limits, config=data.collector.vllm, seed=data.seed)}
    examples = list(next(iter(data.train_dataloader())))
    prompts = [data.collector.prompts.ids(tok, ex.question) for ex in examples]
    n = data.n_samples

    def sample(engine):
        gen = torch.Generator(device=module.device).manual_seed(data.seed)
        return engine.rollout(policy, prompts, lambda q: module.retrieve(q, stochastic=True, generator=gen),
                              n_samples=n, generator=gen)

    def greedy(engine, questions):
        out = []
        size = data.eval_batch_size
        for start in range(0, len(questions), size):
            chunk = [data.collector.prompts.ids(tok, ex.question) for ex in questions[start:start + size]]
            out += engine.rollout(policy, chunk, lambda q: module.retrieve(q, stochastic=False), greedy=True)
        return out

    _, t_build = timed(lambda: engines["vllm"].sync(policy))  # builds the engine and pushes the weights
    engines["vllm"].synced = None
    _, t_sync = timed(lambda: engines["vllm"].sync(policy))
    engines["hf"].rollout(policy, prompts[:1], lambda q: module.retrieve(q, stochastic=False), greedy=True)  # warm-up
    results = {}
    for name, engine in engines.items():
        trajectories, seconds = timed(lambda engine=engine: sample(engine))
        results[name] = (trajectories, sampled_tokens(trajectories), seconds)
    per_row = max(1, round(results["hf"][1] / len(results["hf"][0])))
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows], device=module.device)
    attn = (torch.arange(width, device=module.device)[None] >= torch.tensor([width - len(r) for r in rows],
                                                                              device=module.device)[:, None]).long()
    sampling = dict(do_sample=True, temperature=limits["temperature"], top_p=limits["top_p"],
                    pad_token_id=tok.pad_token_id, max_new_tokens=per_row, min_new_tokens=per_row)
    with policy.generation_model() as model, eval_mode(model), torch.no_grad():
        _, t_floor = timed(lambda: model.generate(input_ids=ids, attention_mask=attn, **sampling))
    floor = per_row * len(rows) / t_floor

    questions = data.load(next(iter(data.val_sources.values())))[: args.eval]
    a, b = greedy(engines["hf"], questions), greedy(engines["vllm"], questions)
    parted = [first_difference(x.response_ids, y.response_ids) for x, y in zip(a, b)]
    identical = sum(p is None for p in parted) / len(parted)
    gap_vllm, gap_hf = trainer_gap(policy, b), trainer_gap(policy, a)
    engines["vllm"].close()

    trajs = results["hf"][0]
    print(f"{Path(args.config).name}: policy {policy.name} ({str(policy.weight_dtype).removeprefix('torch.')}), "
          f"{len(prompts)} prompts x {n} samples, max_turns={limits['max_turns']}, "
          f"tokens/turn<={limits['max_new_tokens_per_turn']}, "
          f"response<={limits['max_response_tokens']}, temperature={limits['temperature']}, "
          f"threads={args.threads}, CPU {cpu_model()}")
    print(f"warm start: {warm_steps} steps in {t_warm:.1f} s; vLLM engine built in {t_build:.1f} s, weight push "
          f"{t_sync:.2f} s; hf rollouts: {sum(t.turns for t in trajs) / len(trajs):.2f} turns, "
          f"{sum(len(t.searches) for t in trajs) / len(trajs):.2f} searches per trajectory")
    print(f"{'sampler':<28}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'vs floor':>10}{'vs hf':>8}")
    hf_rate = results["hf"][1] / results["hf"][2]
    for name, (_, count, seconds) in results.items():
        rate = count / seconds
        print(f"{name + ' (multi-turn, searches)':<28}{count:>8}{seconds:>10.2f}{rate:>11.1f}{rate / floor:>9.2f}x"
              f"{rate / hf_rate:>7.2f}x")
    print(f"{'floor (single-turn generate)':<28}{per_row * len(rows):>8}{t_floor:>10.2f}{floor:>11.1f}{1:>9.2f}x"
          f"{floor / hf_rate:>7.2f}x")
    where = sorted(p for p in parted if p is not None)
    print(f"agreement on {len(questions)} dev questions (greedy): {identical:.1%} identical"
          + (f"; the others part at response positions {where}" if where else ""))
    print(f"mean |log pi_trainer - log pi_sampler| per sampled token: vllm {gap_vllm:.4f}, hf {gap_hf:.4f} nats")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "engines": {name: {"tokens_per_s": count / seconds, "tokens": count, "seconds": seconds}
                        for name, (_, count, seconds) in results.items()},
            "floor": {"tokens_per_s": floor},
            "agreement": {"greedy_identical_share": identical, "mean_abs_logprob_gap": gap_vllm,
                          "mean_abs_logprob_gap_hf": gap_hf, "questions": len(questions), "parted_at": where},
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
