"""How often the warm-started policy searches twice: what RL has to work with on two-hop questions.

Runs the config's ``WarmStart`` for one seed (a fit of ``max_steps=0``, as ``benchmarks/iteration_bench.py``
does), then, with the warm-started policy and the retriever as built:

- **sampled**: ``n_samples`` trajectories per dev question, at the config's temperature and Plackett-Luce
  retrieval, as a training rollout draws them (without dynamic sampling); per question type, how many searched
  0, 1, 2 times and the mean reward of each count;
- **greedy**: the evaluation rollout of the same questions; per type, searches per question and mean reward
  (EM on the world's free-text questions);
- **decision tokens**: the policy's probability of the tokens that decide a second search, teacher-forced on
  noise-free demonstrations of the same questions (``bridge_pl.demonstrations.demonstration_segments``): the word
  after ``<think> I`` once an observation is in the context (``need`` before a next search, ``have`` before the
  answer), and the first token of the second query.

One seed per process (each builds its own vLLM engine)::

    for S in 0 1 2; do python experiments/warm_start_searches/probe.py --seed $S; done
    python experiments/warm_start_searches/probe.py --seed 0 --warm-steps 32   # a longer warm start
    python experiments/warm_start_searches/probe.py --seed 0 --warm-lr 0.002   # a larger warm-start step
    python experiments/warm_start_searches/probe.py --seed 0 --warm-steps 32 --warm-batch 2   # more, smaller steps
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from bridge_pl.cli import BridgeCLI
from bridge_pl.demonstrations import demonstration_segments, tokenize_demonstration
from bridge_pl.rollout.env import SearchEnv
from callbacks.warm_start import WarmStart


def warm_started(config: str, seed: int, root: Path, overrides: dict[str, float | int | None]):
    """The config's trainer, module, data module and ``WarmStart`` after its warm start (``seed`` reseeds
    everything; ``overrides``: WarmStart attributes to replace, e.g. ``{"steps": 32}``; None keeps the config's)."""
    cli = BridgeCLI(args=["--config", config, "--trainer.logger=false", f"--trainer.default_root_dir={root}",
                          "--trainer.max_steps=0", f"--seed_everything={seed}"], run=False)
    warm = next(c for c in cli.trainer.callbacks if isinstance(c, WarmStart))
    warm.evaluate = False
    for name, value in overrides.items():
        if value is not None:
            setattr(warm, name, value)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.trainer, cli.model, cli.datamodule, warm


def search_counts(batch) -> dict[str, dict[int, list[float]]]:
    """Question type -> number of searches -> the rewards of the trajectories that searched that often."""
    counts: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for meta, searches, reward in zip(batch.metadata, batch.num_searches.tolist(), batch.rewards.tolist()):
        counts[meta.get("type", "?")][searches].append(reward)
    return counts


def decision_probabilities(trainer, module, data, examples) -> dict[tuple[str, str], list[float]]:
    """(question type, decision) -> the policy's probability of the demonstrated token at each decision."""
    tokenizer = module.policy.tokenizer
    env = SearchEnv(data.collector.prompts.env, tokenizer)
    need, have = (tokenizer(f" {word}", add_special_tokens=False)["input_ids"][0] for word in ("need", "have"))
    think = tokenizer("<think> I", add_special_tokens=False)["input_ids"]
    found: dict[tuple[str, str], list[float]] = defaultdict(list)
    module.policy.eval()
    for example in examples:
        segments = demonstration_segments(
            example, env, lambda queries: module.retrieve(queries, stochastic=False), random.Random(0), 0.0)
        prompt = data.collector.prompts.ids(tokenizer, example.question, example.metadata.get("options"))
        demo = tokenize_demonstration(prompt, segments, tokenizer)
        ids = torch.tensor([demo.input_ids])
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            logp = torch.log_softmax(module.policy.model(input_ids=ids).logits[0, :-1].float(), -1)
        probs = logp.gather(-1, ids[0, 1:, None])[:, 0].exp().tolist()  # probs[j - 1]: token j given 0..j-1
        ids_list, observed = demo.input_ids, False
        for j in range(len(prompt) + 1, len(ids_list)):
            if not demo.loss_mask[j]:
                observed = True  # an observation (never trained on) precedes the thinks that follow
                continue
            if observed and ids_list[j] in (need, have) and ids_list[j - len(think):j] == think:
                found[(example.metadata.get("type", "?"), "need" if ids_list[j] == need else "have")].append(
                    probs[j - 1])
        second = [i for i, (text, _) in enumerate(segments) if "<search>" in text][1:2]
        if second:  # the first token of the second query, after its "<search>" tag
            before = tokenize_demonstration(prompt, segments[:second[0]], tokenizer).input_ids[:-1]
            lead = segments[second[0]][0].split("<search>")[0] + "<search>"
            start = len(before) + len(tokenizer(lead, add_special_tokens=False)["input_ids"])
            found[(example.metadata.get("type", "?"), "second query's first token")].append(probs[start - 1])
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--seed", type=int, default=0, help="reseeds everything, as bridge-pl fit --seed_everything")
    p.add_argument("--questions", type=int, default=48, help="the first N dev questions")
    p.add_argument("--warm-steps", type=int, help="supervised steps of the warm start (default: the config's)")
    p.add_argument("--warm-lr", type=float, help="the warm start's learning rate (default: the config's)")
    p.add_argument("--warm-batch", type=int, help="demonstrations per warm-start step (default: the config's)")
    p.add_argument("--root", type=Path, default=Path("runs/warm_start_searches"))
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    overrides = {"steps": args.warm_steps, "lr": args.warm_lr, "batch_size": args.warm_batch}
    trainer, module, data, warm = warm_started(args.config, args.seed, args.root / f"seed{args.seed}", overrides)
    examples = data.load(next(iter(data.val_sources.values())), args.questions)
    data.collector.groups = dataclasses.replace(data.collector.groups, filter_groups=False)
    with trainer.precision_plugin.forward_context():
        sampled = search_counts(data.rollout(module, examples, training=True, dataset="probe"))
        greedy = search_counts(data.rollout(module, examples, training=False, dataset="probe"))
    print(f"seed {args.seed}, {warm.steps} warm-start steps of {warm.batch_size} at lr {warm.lr:g}: "
          f"{len(examples)} dev questions, {data.n_samples} samples each at temperature "
          f"{data.collector.limits.temperature}")
    for kind in sorted(sampled):
        cells = ", ".join(f"{n} searches: {len(r)} (reward {sum(r) / len(r):.2f})"
                          for n, r in sorted(sampled[kind].items()))
        flat = [reward for rewards in greedy[kind].values() for reward in rewards]
        searches = {n: len(r) for n, r in sorted(greedy[kind].items())}
        print(f"  {kind}: sampled {cells}; greedy searches {searches}, reward {sum(flat) / len(flat):.3f}")
    for (kind, what), values in sorted(decision_probabilities(trainer, module, data, examples).items()):
        print(f"  {kind}: P({what}) {sum(values) / len(values):.3f} over {len(values)} decisions")
    data.teardown("probe")


if __name__ == "__main__":
    main()
