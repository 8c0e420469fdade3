"""Rollout throughput at a config's real shape: the KV-cache engine vs a naive re-encoding loop vs one ``generate``.

Everything is the config's (default ``configs/demo.yaml``), built as the CLI builds it (``BridgeCLI(run=False)``,
no callback runs): the policy (SmolLM2-135M-Instruct + LoRA), the prompts (the first training batch of the seeded
stream: ``data.batch_size`` questions, ``data.n_samples`` samples each, the data module's instruction and chat
template), the rollout settings (``max_turns``, ``max_new_tokens_per_turn``, ``max_response_tokens``,
``temperature``, ``top_p``: sampling, as in training) and the searches, which go through the module's retriever
(``BridgeModule.retrieve``: K' dense candidates, a Plackett-Luce sample of top_k shown, as in training):

- ``engine``: :class:`bridge_pl.rollout.RolloutEngine` (prompt prefilled once per group, cache kept across turns,
  finished rows pruned), with the policy's attention (``sdpa_decode``, :mod:`bridge_pl.attention`);
- ``engine, plain SDPA``: the same engine with transformers' SDPA for the decode steps too;
- ``engine, LoRA unmerged``: the engine generating through peft's LoRA layers, not with the adapters merged into
  the base weights as every other method here and the data module do (``Policy.generation_model``); only when
  the policy merges for generation;
- ``naive``: the Search-R1 way: every turn calls ``model.generate`` on the full prefix (prompt + all previous turns
  and observations re-encoded), with the same env, stop strings, search function and budgets;
- ``single``: one ``model.generate`` producing, per row, as many tokens as the engine sampled on average (no turns,
  no env text): the floor for generating that many tokens.

Tokens/s counts policy-sampled tokens; the methods sample independently, so compare tokens/s, not token counts. An
untrained policy searches little (the demo trains after ``WarmStart``); the output says how much it did. Timings
need an otherwise idle machine. Usage::

    python benchmarks/rollout_bench.py                                   # demo shapes, all cores
    python benchmarks/rollout_bench.py --config tests/configs/tiny.yaml --threads 1 --data.n_samples=4
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch

from bridge_pl.cli import BridgeCLI
from bridge_pl.rollout import RolloutEngine, SearchEnv
from bridge_pl.rollout.engine import StopMatcher, eos_token_ids

ROOT = Path(__file__).resolve().parents[1]


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r)
        attn[b, width - len(r):] = 1
    return ids.to(device), attn.to(device)


def naive_rollout(model, tok, engine: RolloutEngine, rows: list[list[int]], search_fn, sampling: dict) -> int:
    """Search-R1-style loop: ``model.generate`` on the whole prefix every turn. Returns the policy-sampled tokens."""
    env = engine.env
    matcher = StopMatcher(tok, env.stop_strings, eos_token_ids(model, tok))
    device = next(model.parameters()).device
    seqs, response_len = [list(r) for r in rows], [0] * len(rows)
    active, sampled = list(range(len(rows))), 0
    for turn in range(1, engine.max_turns + 2):
        limits = {i: min(engine.max_new_tokens_per_turn, engine.max_response_tokens - response_len[i]) for i in active}
        ids, attn = left_pad([seqs[i] for i in active], tok.pad_token_id, device)
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max(limits.values()),
                             stop_strings=list(env.stop_strings), tokenizer=tok, **sampling)
        queries, going_on = [], []
        for b, i in enumerate(active):
            turn_ids: list[int] = []
            for token in out[b, ids.shape[1]:].tolist():
                turn_ids.append(token)
                if len(turn_ids) >= limits[i] or matcher.stops(turn_ids):
                    break
            seqs[i] += turn_ids
            response_len[i] += len(turn_ids)
            sampled += len(turn_ids)
            action = env.parse_action(tok.decode(turn_ids))
            if action.kind != "answer" and turn <= engine.max_turns:
                going_on.append((i, action))
                if action.kind == "search":
                    queries.append(action.content)
        outcomes = iter(search_fn(queries) if queries else [])
        active = []
        for i, action in going_on:
            passages = next(outcomes).passages if action.kind == "search" else None
            reply = tok.encode(env.reply(action, passages, turn == engine.max_turns), add_special_tokens=False)
            if response_len[i] + len(reply) < engine.max_response_tokens:
                seqs[i] += reply
                response_len[i] += len(reply)
                active.append(i)
        if not active:
            break
    return sampled


def timed(fn):
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Other arguments (--data.x=..., --model.x=...) override the config.")
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="default: all cores")
    args, overrides = parser.parse_known_args()

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    cli = BridgeCLI(args=["--config", args.config, "--trainer.logger=false", *overrides], run=False)
    module, data = cli.model, cli.datamodule
    data.trainer = cli.trainer
    module.setup("fit")
    policy, tok = module.policy, module.policy.tokenizer
    policy.model.eval()
    settings = data.engine_args
    engine = RolloutEngine(SearchEnv(data.env_config, tok), **settings)
    examples = list(next(iter(data.train_dataloader())))
    prompts = [data.prompt_ids(tok, ex.question) for ex in examples]
    n = data.n_samples
    gen = torch.Generator(device=module.device).manual_seed(data.seed)

    def search_fn(queries):
        return module.retrieve(queries, stochastic=True, generator=gen)

    with policy.generation_model() as model:  # LoRA merged, as the data module generates
        engine.generate(model, tok, prompts[:1], search_fn, greedy=True)  # warm-up (and the stop-token table)
        trajs, t_engine = timed(lambda: engine.generate(model, tok, prompts, search_fn, n_samples=n, generator=gen))
        n_engine = sum(sum(t.action_mask) for t in trajs)
        attention = policy.hf_model.config._attn_implementation
        policy.hf_model.set_attn_implementation("sdpa")
        trajs_sdpa, t_sdpa = timed(lambda: engine.generate(model, tok, prompts, search_fn, n_samples=n, generator=gen))
        policy.hf_model.set_attn_implementation(attention)
        n_sdpa = sum(sum(t.action_mask) for t in trajs_sdpa)
        rows = [p for p in prompts for _ in range(n)]
        sampling = {"do_sample": True, "temperature": settings["temperature"], "top_p": settings["top_p"],
                    "pad_token_id": tok.pad_token_id}
        torch.manual_seed(data.seed)
        with torch.no_grad():
            n_naive, t_naive = timed(lambda: naive_rollout(model, tok, engine, rows, search_fn, sampling))
            per_row = max(1, round(n_engine / len(trajs)))
            ids, attn = left_pad(rows, tok.pad_token_id, module.device)
            _, t_single = timed(lambda: model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=per_row,
                                                       min_new_tokens=per_row, **sampling))
        n_single = per_row * len(rows)
    rows_timed = [("engine (KV cache)", n_engine, t_engine), ("engine, plain SDPA", n_sdpa, t_sdpa)]
    if policy.generates_merged:  # else every row already ran through the adapters
        trajs_lora, t_lora = timed(lambda: engine.generate(policy.model, tok, prompts, search_fn, n_samples=n,
                                                           generator=gen))
        rows_timed.append(("engine, LoRA unmerged", sum(sum(t.action_mask) for t in trajs_lora), t_lora))
    rows_timed += [("naive (re-encode)", n_naive, t_naive), ("single-turn generate", n_single, t_single)]

    turns = sum(t.turns for t in trajs) / len(trajs)
    n_searches = sum(len(t.searches) for t in trajs) / len(trajs)
    env_tokens = sum(len(t.action_mask) - sum(t.action_mask) for t in trajs) / len(trajs)
    print(f"{Path(args.config).name}: policy {policy.name} ({str(policy.weight_dtype).replace('torch.', '')}), "
          f"retriever {type(module.retriever).__name__}, threads={args.threads}, {len(prompts)} prompts x {n} samples, "
          f"max_turns={settings['max_turns']}, tokens/turn<={settings['max_new_tokens_per_turn']}, "
          f"response<={settings['max_response_tokens']}, temperature={settings['temperature']}")
    print(f"engine rollouts: {turns:.2f} turns, {n_searches:.2f} searches, {n_engine / len(trajs):.1f} sampled "
          f"+ {env_tokens:.1f} env tokens per trajectory (load average {os.getloadavg()[0]:.2f}; timings need an "
          "idle machine)")
    print(f"{'method':<22}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'vs engine':>11}")
    for name, count, t in rows_timed:
        print(f"{name:<22}{count:>8}{t:>10.2f}{count / t:>11.1f}{(count / t) / (n_engine / t_engine):>10.2f}x")


if __name__ == "__main__":
    main()
