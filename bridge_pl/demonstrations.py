"""Search demonstrations and their SFT loss: the warm start, a short supervised phase before RL.

A demonstration is what a competent agent would have written for a training question: a ``<think>``,
one ``<search>`` per hop (the hop queries the data records, e.g. the world's ``hop_queries``), the
passages the *current* retriever really returns for each query (top-k, so a miss stays a miss), then the
gold ``<answer>``: on a multiple-choice question its letter, or the gold option's text (``choice_answer="text"``,
which answer extraction maps back to the letter: for a small policy that copies a name from the evidence but
does not learn to look it up among the options, as in ``configs/world_mc.yaml``). Demonstrations are
deliberately imperfect: with probability ``noise`` a hop query is replaced by a weaker one, so RL and the
retriever still have something to fix: the raw question, or, when the demonstration already searched the raw
question, the hop's entity name alone (``metadata["hops"]``).
Repeating a query teaches nothing but a useless search: it returns the same passages.
Only the agent's own tokens are trained on (observations are masked, as in RL).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import torch

from bridge_pl.records import QAExample
from bridge_pl.rollout.env import SearchEnv


@dataclass
class Demonstration:
    """Token ids of prompt + response, and the loss mask (1 on agent-written tokens)."""

    input_ids: list[int]
    loss_mask: list[int]


def demonstration_segments(
    example: QAExample, env: SearchEnv, retrieve, rng: random.Random, noise: float,
    choice_answer: Literal["letter", "text"] = "letter",
) -> list[tuple[str, bool]]:
    """The response of one demonstration as (text, written-by-the-agent) segments.

    ``retrieve(queries) -> list[SearchOutcome]`` is the deterministic (top-k) retrieval of the module.
    ``choice_answer``: what a multiple-choice question's demonstration answers, the gold letter or its option's text.
    """
    cfg = env.config
    entities = example.metadata.get("hops") or []
    queries: list[str] = []
    for i, query in enumerate(example.metadata.get("hop_queries") or [example.question]):
        if rng.random() < noise:
            if example.question not in queries:
                query = example.question
            elif i < len(entities):
                query = entities[i]
        queries.append(query)
    segments: list[tuple[str, bool]] = []
    outcomes = retrieve(queries)
    for i, (query, outcome) in enumerate(zip(queries, outcomes)):
        lead = "I need to look this up." if i == 0 else "I need one more fact."
        segments.append((f"{cfg.wrap('think', lead)}\n{cfg.wrap('search', query)}", True))
        segments.append((env.observation(outcome.passages), False))
    answer = example.gold_text if choice_answer == "text" else example.golden_answers[0]
    segments.append((f"{cfg.wrap('think', 'I have the answer.')}\n{cfg.wrap('answer', answer)}", True))
    return segments


def tokenize_demonstration(prompt_ids: list[int], segments: list[tuple[str, bool]], tokenizer) -> Demonstration:
    """Concatenate the prompt and separately tokenized segments, as the rollout engine would."""
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    for text, trained in segments:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [int(trained)] * len(seg)
    if tokenizer.eos_token_id is not None:  # end of the agent's turn, as the chat template expects
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
    return Demonstration(ids, mask)


def sft_loss(policy, demos: list[Demonstration], normalizer: int | None = None) -> torch.Tensor:
    """Negative log-likelihood of the agent-written tokens of ``demos``, summed and divided by ``normalizer``
    (a scalar; default: their number, so the mean). A batch split into token-budget groups passes the whole
    batch's count to each group, so the groups' losses, and their gradients, add up to the batch's mean."""
    device = next(policy.parameters()).device
    T = max(len(d.input_ids) for d in demos)
    ids = torch.full((len(demos), T), policy.tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros(len(demos), T, dtype=torch.long)
    mask = torch.zeros(len(demos), T, dtype=torch.float32)
    for r, d in enumerate(demos):
        n = len(d.input_ids)
        ids[r, :n] = torch.tensor(d.input_ids)
        attn[r, :n] = 1
        mask[r, :n] = torch.tensor(d.loss_mask, dtype=torch.float32)
    ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
    logp = policy(ids, attn, score_mask=mask.bool())[0]  # the LM head only where the loss looks
    return -(logp * mask).sum() / (mask.sum().clamp(min=1) if normalizer is None else max(normalizer, 1))
