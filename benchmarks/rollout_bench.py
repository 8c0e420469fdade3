"""Rollout throughput: the KV-cache engine vs a naive re-encoding loop vs one single-turn ``generate``.

On the same model and prompts (Search-R1-style instruction, greedy decoding):

- ``engine``: :class:`bridge_pl.rollout.RolloutEngine` (cache kept across turns, finished rows pruned);
- ``naive``: the Search-R1 way: every turn calls ``model.generate`` on the full prefix (prompt + all previous
  turns and observations re-encoded), with the same env, stop strings, search function and budgets;
- ``single``: one ``model.generate`` call producing, per prompt, as many tokens as the engine sampled on
  average (no turns, no env text): the cost floor of generating that many tokens.

Tokens/s counts policy-sampled tokens only. Usage::

    python benchmarks/rollout_bench.py                       # smollm2-135m-instruct on CPU
    python benchmarks/rollout_bench.py --model tiny-llama --prompts 16 --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from bridge_pl.data.qa import Passage
from bridge_pl.models import load_causal_lm, load_tokenizer
from bridge_pl.rollout import EnvConfig, RolloutEngine, SearchEnv, SearchOutcome
from bridge_pl.rollout.engine import StopMatcher, eos_token_ids

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
QUESTIONS = [
    "Who wrote the novel Moby-Dick?", "What is the capital of Australia?", "When did the Berlin Wall fall?",
    "Who painted the Mona Lisa?", "Which planet is known as the red planet?", "Who discovered penicillin?",
    "What is the longest river in Africa?", "In which year did the Titanic sink?",
]
CORPUS = [
    Passage(str(i), title, text) for i, (title, text) in enumerate([
        ("Moby-Dick", "Moby-Dick is an 1851 novel by American writer Herman Melville about a whaling voyage."),
        ("Canberra", "Canberra is the capital city of Australia, founded following the federation in 1901."),
        ("Berlin Wall", "The Berlin Wall fell on 9 November 1989, ending the division of Berlin."),
        ("Mona Lisa", "The Mona Lisa is a half-length portrait painting by Italian artist Leonardo da Vinci."),
        ("Mars", "Mars is the fourth planet from the Sun, often called the Red Planet for its iron oxide dust."),
        ("Penicillin", "Penicillin was discovered in 1928 by Scottish scientist Alexander Fleming."),
    ])
]


def search_fn(queries: list[str]) -> list[SearchOutcome]:
    """A deterministic stand-in retriever: word overlap with the corpus, top 3 shown of all candidates."""
    outcomes = []
    for q in queries:
        words = set(q.lower().split())
        ranked = sorted(range(len(CORPUS)), key=lambda r: -len(words & set(CORPUS[r].text.lower().split())))
        outcomes.append(SearchOutcome(ranked, ranked[:3], 0.0, [CORPUS[r] for r in ranked[:3]]))
    return outcomes


def build_prompts(tok, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = INSTRUCTION.format(question=QUESTIONS[i % len(QUESTIONS)])
        if tok.chat_template:
            enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
        else:
            prompts.append(tok.encode(text))
    return prompts


def naive_rollout(model, tok, env: SearchEnv, engine: RolloutEngine, prompts, device) -> int:
    """Search-R1-style loop: re-encode the whole prefix with ``model.generate`` every turn.

    Same turn/stop/budget/env rules as the engine. Returns the number of policy-sampled tokens.
    """
    matcher = StopMatcher(tok, env.stop_strings, eos_token_ids(model, tok))
    seqs = [list(p) for p in prompts]
    response_len = [0] * len(prompts)
    active = list(range(len(prompts)))
    sampled = 0
    for turn in range(1, engine.max_turns + 2):
        budget = max(min(engine.max_new_tokens_per_turn, engine.max_response_tokens - response_len[i])
                     for i in active)
        width = max(len(seqs[i]) for i in active)
        ids = torch.full((len(active), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, i in enumerate(active):
            ids[b, width - len(seqs[i]):] = torch.tensor(seqs[i])
            attn[b, width - len(seqs[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=False,
                             max_new_tokens=budget, stop_strings=list(env.stop_strings), tokenizer=tok,
                             pad_token_id=tok.pad_token_id)
        queries, still = [], []
        for b, i in enumerate(active):
            turn_ids: list[int] = []
            limit = min(engine.max_new_tokens_per_turn, engine.max_response_tokens - response_len[i])
            for token in out[b, width:].tolist():
                turn_ids.append(token)
                if len(turn_ids) >= limit or matcher.stops(turn_ids):
                    break
            seqs[i] += turn_ids
            response_len[i] += len(turn_ids)
            sampled += len(turn_ids)
            action = env.parse_action(tok.decode(turn_ids))
            if action.kind == "answer" or turn == engine.max_turns + 1:
                continue
            still.append((i, action))
            if action.kind == "search":
                queries.append(action.content)
        outcomes = iter(search_fn(queries) if queries else [])
        active = []
        for i, action in still:
            passages = next(outcomes).passages if action.kind == "search" else None
            reply = tok.encode(env.reply(action, passages, turn == engine.max_turns), add_special_tokens=False)
            if response_len[i] + len(reply) < engine.max_response_tokens:
                seqs[i] += reply
                response_len[i] += len(reply)
                active.append(i)
        if not active:
            break
    return sampled


def single_turn(model, tok, prompts, new_tokens: int, device) -> int:
    """One left-padded ``generate`` call, exactly ``new_tokens`` tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        attn[b, width - len(p):] = 1
    model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=False,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
    return new_tokens * len(prompts)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, e.g. tiny-llama")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--tokens-per-turn", type=int, default=64)
    parser.add_argument("--max-response-tokens", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 avoids oversubscription)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = load_causal_lm(args.model).to(args.device).eval()
    env = SearchEnv(EnvConfig(), tok)
    engine = RolloutEngine(env, max_turns=args.max_turns, max_new_tokens_per_turn=args.tokens_per_turn,
                           max_response_tokens=args.max_response_tokens)
    prompts = build_prompts(tok, args.prompts)

    engine.generate(model, tok, prompts[:2], search_fn, greedy=True)  # warm-up (and the stop-token table)
    trajs, t_engine = timed(lambda: engine.generate(model, tok, prompts, search_fn, greedy=True))
    n_engine = sum(sum(t.action_mask) for t in trajs)
    with torch.no_grad():
        n_naive, t_naive = timed(lambda: naive_rollout(model, tok, env, engine, prompts, args.device))
        per_prompt = max(1, round(n_engine / len(prompts)))
        n_single, t_single = timed(lambda: single_turn(model, tok, prompts, per_prompt, args.device))

    turns = sum(t.turns for t in trajs) / len(trajs)
    searches = sum(len(t.searches) for t in trajs) / len(trajs)
    env_tokens = sum(len(t.action_mask) - sum(t.action_mask) for t in trajs) / len(trajs)
    print(f"model={args.model} device={args.device} threads={args.threads} prompts={len(prompts)} "
          f"max_turns={args.max_turns} tokens/turn<={args.tokens_per_turn}")
    print(f"engine rollouts: {turns:.2f} turns, {searches:.2f} searches, {n_engine / len(trajs):.1f} sampled "
          f"+ {env_tokens:.1f} env tokens per trajectory")
    rows = [("engine (KV cache)", n_engine, t_engine), ("naive (re-encode)", n_naive, t_naive),
            ("single-turn generate", n_single, t_single)]
    print(f"{'method':<22}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'vs engine':>11}")
    for name, n, t in rows:
        print(f"{name:<22}{n:>8}{t:>10.2f}{n / t:>11.1f}{(n / t) / (n_engine / t_engine):>10.2f}x")


if __name__ == "__main__":
    main()
