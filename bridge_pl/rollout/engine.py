"""Multi-turn generation with search calls: the episode rules every backend shares, and the ``hf`` backend.

:class:`MultiTurnEngine` holds the episode (turn budgets, the env's parsing and replies, search calls, what a
:class:`Trajectory` records); a backend supplies only a :class:`TurnDecoder`, which samples one turn per active
row and appends the env's reply ids. Every backend is token-in/token-out: a turn is never re-tokenised, and the
next turn continues from the recorded ids. ``bridge_pl.rollout.vllm_engine`` is the vLLM backend.

:class:`HFRolloutEngine` (``hf``) decodes with the Hugging Face model itself, reusing the KV cache across turns.
All active trajectories decode together, one token per forward. A trajectory's turn ends at EOS, at the
per-turn budget, or on the token that completes a stop string (``</search>`` / ``</answer>``); rows that
already stopped are fed a padding token with attention mask 0 (a "hole") until every row has stopped.
Then the env parses each turn, ``search_fn`` runs once for all queries of the batch, finished rows are
pruned from the cache, and each remaining row's last sampled token plus its env text (observation or
message) is appended to the cache in one forward, left-padded within that chunk. Positions are always
``cumsum(attention_mask) - 1``, so left padding and holes never shift them; between turns the cache is
compacted (each row's real entries right-aligned, columns that are padding in every row dropped).

Ids recorded are exactly the ids sampled (a turn is never re-tokenised); the env's text is tokenised on its
own and recorded as appended.

A stop requested through :data:`STOP_ROLLOUT` (by ``bridge_pl.signals.StopOnSignal``, from a signal handler) ends a
rollout in progress at its next turn, and the ``hf`` backend's at its next decode step, with
:class:`RolloutAbandoned`: nothing of the rollout is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from bridge_pl.attention import MIN_SHARED_PREFIX
from bridge_pl.config import AT_LEAST_ONE, OPEN_CLOSED_UNIT_INTERVAL, POSITIVE, Rule, raise_problems, rule_problems
from bridge_pl.eval_mode import eval_mode
from bridge_pl.records import Passage
from bridge_pl.rollout.env import Action, SearchEnv

if TYPE_CHECKING:
    from bridge_pl.policy import Policy


class RolloutAbandoned(BaseException):
    """A stop signal ended the rollout in progress (see :class:`RolloutStop`); nothing of it is kept. Like
    ``SystemExit``, a stop rather than an error: no ``except Exception`` on the way takes it for a failure."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"the rollout in progress was abandoned on signal {signum}")
        self.signum = signum


class RolloutStop:
    """A request, for this process, that rollouts end at their next turn or decode step: set (from a signal handler)
    with :meth:`request`; :meth:`check`, called between turns and decode steps, then raises
    :class:`RolloutAbandoned`."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def request(self, signum: int) -> None:
        self.signum = signum

    def clear(self) -> None:
        self.signum = None

    def check(self) -> None:
        if self.signum is not None:
            raise RolloutAbandoned(self.signum)


STOP_ROLLOUT = RolloutStop()  # the process's one request, checked by every engine


@dataclass
class SearchOutcome:
    """What the caller's ``search_fn`` returns for one query."""

    candidate_rows: list[int]  # the K' FAISS candidates (retriever rows)
    passage_rows: list[int]  # the k passages shown, in order
    logprob: float  # log-prob of that ordered list under the retriever's sampling distribution
    passages: list[Passage]  # the passages of passage_rows, in order


@dataclass
class SearchCall:
    """One executed search, as recorded in a trajectory (``turn`` is 1-based).

    ``position``: index into the trajectory's ``response_ids`` where this search's observation starts (so
    ``response_ids[:position]`` is everything the policy had seen and written when it issued the search).
    """

    query: str
    turn: int
    outcome: SearchOutcome
    position: int


@dataclass
class Trajectory:
    """One rollout. ``action_mask[i] = 1`` exactly where ``response_ids[i]`` was sampled by the policy.

    ``sampler_logprobs[i]``: the sampler's log-prob (nats) of ``response_ids[i]`` where it was sampled, under the full
    softmax at the sampling temperature, log softmax(logits / T) (with top-p < 1 not renormalised over the nucleus,
    so that it compares with the trainer's π_old); 0.0 on env tokens. Greedy decoding records the log-probs at
    temperature 1.
    """

    prompt_index: int  # index into the prompts list (the GRPO group)
    prompt_ids: list[int]
    response_ids: list[int]  # generated tokens + env tokens (observations, messages), in order
    action_mask: list[int]
    response_text: str  # decode of response_ids (special tokens kept)
    searches: list[SearchCall]
    turns: int  # generation turns taken
    valid_actions: int
    invalid_actions: int
    finished: bool  # ended with an answer (vs the turn or token limit)
    sampler_logprobs: list[float] = field(default_factory=list)


@dataclass
class _Rollout:
    """Mutable per-trajectory state while generating."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    searches: list[SearchCall] = field(default_factory=list)
    turns: int = 0
    valid: int = 0
    invalid: int = 0
    finished: bool = False

    def extend(self, ids: list[int], action: int, logprobs: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.action_mask.extend([action] * len(ids))
        self.sampler_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


@dataclass
class SampledTurn:
    """One row's turn as a decoder sampled it: the ids and each one's sampler log-prob (nats)."""

    ids: list[int]
    logprobs: list[float]


class TurnDecoder(Protocol):
    """What a backend supplies for one batch of rows (``n_samples`` per prompt, prompt-major)."""

    def decode(self, budgets: list[int]) -> list[SampledTurn]:
        """Sample one turn for every active row, at most ``budgets[i]`` tokens for row i, ending at EOS or on
        the token that completes a stop string (that token kept)."""

    def append(self, keep: list[int], replies: list[list[int]]) -> None:
        """Drop the rows not in ``keep`` (indices into the active rows, ascending); row ``keep[j]`` continues
        after its sampled turn and then ``replies[j]`` (the env's ids)."""


# transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns, then goes away).
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

SearchFn = Callable[[list[str]], list[SearchOutcome]]


class StopMatcher:
    """Decides after each sampled token whether a turn is over (EOS or a completed stop string).

    Only a token whose text contains the last character of some stop string can complete it, so the tail
    is decoded only for those tokens; the tail window is as many tokens as the longest stop string has
    characters (every non-special token decodes to at least one character).
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.eos_ids = eos_ids
        self.window = max(len(s) for s in self.stop_strings)
        last_chars = {s[-1] for s in self.stop_strings}
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.may_complete = [any(ch in t for ch in last_chars) for t in texts]

    def stops(self, turn_ids: list[int]) -> bool:
        tok = turn_ids[-1]
        if tok in self.eos_ids:
            return True
        if tok < len(self.may_complete) and not self.may_complete[tok]:
            return False
        tail = self.tokenizer.decode(turn_ids[-self.window:])
        return any(s in tail for s in self.stop_strings)


class MultiTurnEngine:
    """Batched multi-turn rollouts against a :class:`SearchEnv`: the episode rules every backend shares.

    Episode rules: a turn ends at EOS (the EOS token is kept, mask 1), at the per-turn budget, or on the
    token completing a stop string. An answer ends the episode (``finished``); a search or invalid turn
    gets the env's reply and the episode goes on. Turn ``max_turns + 1`` is final: its reply is never
    generated, and a search there is not executed and counts as invalid. Sampled tokens have mask 1, env
    tokens mask 0.

    Args:
        env: the tag grammar and reply texts.
        max_turns: turns in which a search is executed; one more, final turn may only answer.
        max_new_tokens_per_turn: sampled tokens per turn at most.
        max_response_tokens: response length (sampled + env tokens) at most; a trajectory whose next env
            text would leave no room for another token ends there (unfinished, the search not recorded).
        temperature, top_p: sampling parameters (ignored when ``greedy``).
    """

    name: str  # the backend's data.engine name
    RULES: ClassVar[dict[str, Rule]] = {
        **dict.fromkeys(("max_turns", "max_new_tokens_per_turn", "max_response_tokens"), AT_LEAST_ONE.worded(">= 1")),
        "temperature": POSITIVE.worded("> 0 (use greedy=True)"), "top_p": OPEN_CLOSED_UNIT_INTERVAL,
    }

    def __init__(
        self,
        env: SearchEnv,
        max_turns: int = 4,
        max_new_tokens_per_turn: int = 500,
        max_response_tokens: int = 3000,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> None:
        raise_problems(rule_problems(type(self).__name__, locals(), self.RULES))  # the arguments by name
        self.env = env
        self.max_turns = max_turns
        self.max_new_tokens_per_turn = max_new_tokens_per_turn
        self.max_response_tokens = max_response_tokens
        self.temperature = temperature
        self.top_p = top_p

    def rollout(
        self,
        policy: Policy,
        prompts: list[list[int]],
        search_fn: SearchFn,
        n_samples: int = 1,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> list[Trajectory]:
        """Roll out ``policy`` as it is now: ``n_samples`` trajectories per prompt, prompt-major
        (``[p0s0, p0s1, …, p1s0, …]``). The seam the datamodule uses; each backend implements it.
        ``generator`` (on the policy's device) drives the sampling, so a run resumed with its state repeats it."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the backend holds between rollouts (nothing here)."""

    def _episodes(self, decoder: TurnDecoder, tokenizer, prompts: list[list[int]], search_fn: SearchFn,
                  n_samples: int) -> list[Trajectory]:
        """Run the episodes of ``n_samples`` rows per prompt with ``decoder`` sampling the turns."""
        rollouts = [_Rollout(p, list(prompts[p])) for p in range(len(prompts)) for _ in range(n_samples)]
        rows = list(range(len(rollouts)))  # rows[i]: the rollout in active row i
        for turn in range(1, self.max_turns + 2):
            STOP_ROLLOUT.check()
            budgets = [min(self.max_new_tokens_per_turn, self.max_response_tokens - len(rollouts[r].response_ids))
                       for r in rows]
            actions = []
            for r, sampled in zip(rows, decoder.decode(budgets), strict=True):
                rollouts[r].extend(sampled.ids, 1, sampled.logprobs)
                rollouts[r].turns += 1
                actions.append(self.env.parse_action(tokenizer.decode(sampled.ids)))
            replies = self._env_step(rollouts, rows, actions, turn, search_fn, tokenizer)
            keep = [i for i, reply in enumerate(replies) if reply is not None]
            if not keep:
                break
            decoder.append(keep, [replies[i] for i in keep])
            rows = [rows[i] for i in keep]
        return [
            Trajectory(
                prompt_index=r.prompt_index, prompt_ids=r.prompt_ids, response_ids=r.response_ids,
                action_mask=r.action_mask, response_text=tokenizer.decode(r.response_ids),
                searches=r.searches, turns=r.turns, valid_actions=r.valid, invalid_actions=r.invalid,
                finished=r.finished, sampler_logprobs=r.sampler_logprobs,
            )
            for r in rollouts
        ]

    def _check_request(self, prompts: list[list[int]], n_samples: int) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(f"{type(self).__name__}.rollout: prompts must be a non-empty list of non-empty id lists")
        if n_samples < 1:
            raise ValueError(f"{type(self).__name__}.rollout: n_samples must be >= 1, got {n_samples}")

    def _env_step(self, rollouts, rows, actions: list[Action], turn: int, search_fn: SearchFn, tokenizer):
        """Apply the turn's actions. Returns per active row the env ids to append, or None if it is done."""
        final = turn == self.max_turns + 1
        pending = []  # batch rows that go on and need a reply
        for i, (r, action) in enumerate(zip(rows, actions, strict=True)):
            ro = rollouts[r]
            if action.kind == "answer":
                ro.valid += 1
                ro.finished = True
                continue
            if final or action.kind == "invalid":  # a search in the final turn is not executed
                ro.invalid += 1
            else:
                ro.valid += 1
            if not final and len(ro.response_ids) < self.max_response_tokens:
                pending.append(i)
        searching = [i for i in pending if actions[i].kind == "search"]
        outcomes = dict(zip(searching, self._search(search_fn, [actions[i].content for i in searching]),
                            strict=True))
        replies: list[list[int] | None] = [None] * len(rows)
        for i in pending:
            ro = rollouts[rows[i]]
            outcome = outcomes.get(i)
            text = self.env.reply(actions[i], outcome.passages if outcome else None, turn == self.max_turns)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise ValueError(f"the env reply {text!r} tokenizes to nothing; replies must be non-empty")
            if len(ro.response_ids) + len(ids) >= self.max_response_tokens:
                continue  # no room to generate after it: the episode ends here, unfinished
            if outcome is not None:
                ro.searches.append(SearchCall(actions[i].content, turn, outcome, len(ro.response_ids)))
            ro.extend(ids, 0)
            replies[i] = ids
        return replies

    @staticmethod
    def _search(search_fn: SearchFn, queries: list[str]) -> list[SearchOutcome]:
        if not queries:
            return []
        outcomes = search_fn(queries)
        if len(outcomes) != len(queries):
            raise ValueError(f"search_fn returned {len(outcomes)} outcomes for {len(queries)} queries")
        return outcomes


class HFRolloutEngine(MultiTurnEngine):
    """The ``hf`` backend: all active rows decode together with the Hugging Face model, one token per forward,
    reusing the KV cache across turns (see the module docstring)."""

    name = "hf"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._matcher: tuple[object, StopMatcher] | None = None  # (tokenizer, matcher) cache

    def rollout(self, policy, prompts, search_fn, n_samples=1, greedy=False, generator=None) -> list[Trajectory]:
        with policy.generation_model() as model:
            return self.generate(model, policy.tokenizer, prompts, search_fn, n_samples=n_samples, greedy=greedy,
                                 generator=generator)

    def generate(
        self,
        model: torch.nn.Module,
        tokenizer,
        prompts: list[list[int]],
        search_fn: SearchFn,
        n_samples: int = 1,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> list[Trajectory]:
        """Roll out ``model`` itself: ``n_samples`` trajectories per prompt, prompt-major.

        Runs under ``torch.no_grad()`` in eval mode and restores the model's previous mode. ``search_fn``
        is called once per turn with every query issued in that turn (never with an empty list).
        ``generator`` must live on the model's device.
        """
        self._check_request(prompts, n_samples)
        with eval_mode(model), torch.no_grad():
            decoder = _CachedDecoder(model, tokenizer, prompts, n_samples, self._stop_matcher(model, tokenizer),
                                     greedy, self.temperature, self.top_p, generator)
            return self._episodes(decoder, tokenizer, prompts, search_fn, n_samples)

    def _stop_matcher(self, model, tokenizer) -> StopMatcher:
        eos_ids = eos_token_ids(model, tokenizer)
        if self._matcher is None or self._matcher[0] is not tokenizer or self._matcher[1].eos_ids != eos_ids:
            self._matcher = (tokenizer, StopMatcher(tokenizer, self.env.stop_strings, eos_ids))
        return self._matcher[1]


class _CachedDecoder:
    """The ``hf`` backend's :class:`TurnDecoder`: one KV cache for the batch, kept across turns.

    A turn's rows decode together; rows that already stopped are fed a padding token with attention mask 0 (a
    "hole"). A row that stopped on the last step has its last token not yet fed (``unfed``); it goes into the
    cache with the row's reply, in one forward for all rows.
    """

    def __init__(self, model, tokenizer, prompts, n_samples, matcher: StopMatcher, greedy: bool, temperature: float,
                 top_p: float, generator: torch.Generator | None) -> None:
        self.model, self.matcher, self.greedy, self.generator = model, matcher, greedy, generator
        self.temperature, self.top_p = (1.0, 1.0) if greedy else (temperature, top_p)
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.logits, self.cache, self.attn = self._prefill(prompts)
        if n_samples > 1:
            self.cache.batch_repeat_interleave(n_samples)
            self.attn = self.attn.repeat_interleave(n_samples, dim=0)
            self.logits = self.logits.repeat_interleave(n_samples, dim=0)
        self.unfed: list[list[int]] = []

    def _prefill(self, prompts: list[list[int]]):
        """Feed each distinct prompt once: logits ``[P, V]``, the cache and its mask ``[P, L]``.

        Prompts built from one template share a long prefix (system prompt and instruction: ~115 of the
        demo's 134 tokens), so the prefix is fed once and its cache copied to every row; each prompt's
        remainder follows, left-padded (the hole between the two is masked and positions come from the mask).
        """
        model, pad_id, device = self.model, self.pad_id, self.device
        shared = _common_prefix_length(prompts) if len(prompts) > 1 else 0
        if shared < MIN_SHARED_PREFIX:
            ids, attn = _left_pad([list(p) for p in prompts], pad_id, device)
            logits, cache = _forward(model, ids, attn, None)
            return logits, cache, attn
        prefix = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device)
        _, cache = _forward(model, prefix, torch.ones_like(prefix), None)
        cache.batch_repeat_interleave(len(prompts))
        ids, rest_attn = _left_pad([p[shared:] for p in prompts], pad_id, device)
        attn = torch.cat([torch.ones(len(prompts), shared, dtype=rest_attn.dtype, device=device), rest_attn], dim=1)
        logits, cache = _forward(model, ids, attn, cache)
        return logits, cache, attn

    def decode(self, budgets: list[int]) -> list[SampledTurn]:
        B = len(budgets)
        turns = [SampledTurn([], []) for _ in range(B)]
        running = [True] * B
        while True:
            tokens, logprobs = _sample(self.logits, self.greedy, self.temperature, self.top_p, self.generator)
            tokens, logprobs = tokens.tolist(), logprobs.tolist()
            fed = list(running)
            for i in range(B):
                if not running[i]:
                    tokens[i] = self.pad_id
                    continue
                turns[i].ids.append(tokens[i])
                turns[i].logprobs.append(logprobs[i])
                if len(turns[i].ids) >= budgets[i] or self.matcher.stops(turns[i].ids):
                    running[i] = False
            if not any(running):
                self.unfed = [[tokens[i]] if fed[i] else [] for i in range(B)]
                return turns
            STOP_ROLLOUT.check()
            step_mask = torch.tensor(fed, dtype=self.attn.dtype, device=self.device)[:, None]
            self.attn = torch.cat([self.attn, step_mask], dim=1)
            step_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
            self.logits, _ = _forward(self.model, step_ids, self.attn, self.cache)

    def append(self, keep: list[int], replies: list[list[int]]) -> None:
        if len(keep) < self.attn.shape[0]:
            self.cache.batch_select_indices(torch.tensor(keep, device=self.device))
            self.attn = self.attn[keep]
        self.attn = _compact(self.cache, self.attn)
        chunk_ids, chunk_attn = _left_pad([self.unfed[i] + reply for i, reply in zip(keep, replies, strict=True)],
                                          self.pad_id, self.device)
        self.attn = torch.cat([self.attn, chunk_attn], dim=1)
        self.logits, self.cache = _forward(self.model, chunk_ids, self.attn, self.cache)


# ---- tensor helpers ---------------------------------------------------------------------------
def eos_token_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS id plus the model's ``generation_config.eos_token_id`` (an id or a list)."""
    ids = set()
    config = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    return ids


def _common_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, at most ``min(len) - 1`` (so every remainder is non-empty)."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for n in range(limit):
        if any(p[n] != first[n] for p in prompts):
            return n
    return max(limit, 0)


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad id lists: ids ``[B, T]`` and attention mask ``[B, T]`` (1 on real tokens)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            ids[b, T - len(s):] = torch.tensor(s, dtype=torch.long)
            attn[b, T - len(s):] = 1
    return ids.to(device), attn.to(device)


def _forward(model, ids: torch.Tensor, attn: torch.Tensor, cache):
    """Feed ``ids [B, T]`` after ``cache``; ``attn [B, L]`` covers cache + new tokens.

    Returns the next-token logits ``[B, V]`` (float32) after the last new position, and the cache.
    """
    positions = (attn.cumsum(dim=1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    # The last position as an index, not ``logits_to_keep=1``: that slices ``hidden[:, -1:]``, a strided view when
    # T > 1, and with a frozen head (LoRA) CPU ``F.linear`` on it falls back to a bmm against the head expanded and
    # copied once per row (48 rows x SmolLM2's 49152 x 576 head: 2.35 s a call, against 0.010 s gathered).
    # A decode step (T = 1) is contiguous already and keeps the plain int (no tensor to build per step).
    last = 1 if ids.shape[1] == 1 else torch.tensor([ids.shape[1] - 1], device=ids.device)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, logits_to_keep=last,
                **{_CACHE: cache})
    return out.logits[:, -1].float(), getattr(out, _CACHE)


def _sample(logits: torch.Tensor, greedy: bool, temperature: float, top_p: float,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token ``[B]`` from logits ``[B, V]`` (argmax, or temperature + nucleus (top-p) sampling) and its
    log-prob ``[B]`` (nats) under the full tempered softmax, log softmax(logits / T), not renormalised over the
    nucleus (greedy: log softmax(logits)). The nucleus is the smallest set of most probable tokens whose mass
    reaches ``top_p``; the top token is always in it."""
    if greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, _gather_logprobs(logits, tokens)
    tempered = logits / temperature
    allowed = tempered
    if top_p < 1.0:
        sorted_logits, order = tempered.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p  # the top token is always kept
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        allowed = torch.full_like(tempered, float("-inf")).scatter(-1, order, sorted_logits)
    tokens = torch.multinomial(allowed.softmax(dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, _gather_logprobs(tempered, tokens)


def _gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` ``[B, V]`` at ``tokens`` ``[B]``: ``[B]``."""
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _compact(cache, attn: torch.Tensor) -> torch.Tensor:
    """Right-align each row's real cache entries and drop columns that are then padding in every row.

    RoPE is applied before caching and positions come from the mask, so moving entries changes nothing
    but the memory and time later steps spend on holes. Only plain ``DynamicLayer`` caches are compacted
    (sliding-window or other layer types are left as they are). Returns the new mask ``[B, L']``.
    """
    length = int(attn.sum(dim=1).max())
    layers = getattr(cache, "layers", None)
    if length == attn.shape[1] or not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return attn
    index = torch.sort(attn, dim=1, stable=True).indices[:, -length:]  # pads first, real entries in order
    for layer in layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        layer.keys = _gather_positions(layer.keys, index)
        layer.values = _gather_positions(layer.values, index)
    return attn.gather(1, index)


def _gather_positions(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``states [B, H, L, D]`` at positions ``index [B, L']`` of each row: ``[B, H, L', D]``."""
    B, H, _, D = states.shape
    return states.gather(2, index[:, None, :, None].expand(B, H, index.shape[1], D))
