"""HFRolloutEngine with the tiny random Llama, a real FAISS index, and a bigram logit bias to steer turns.

The tiny model is random, so a forward hook adds a large bias to chosen next tokens after chosen input
tokens ("after '<' prefer 'search'"). The bias is a function of each position's own input token only, so
it acts the same in cached decoding and in a full-prefix forward: the model stays a real model whose
behaviour we can steer, and the KV-cache equivalence check stays meaningful (ties among biased tokens
and all unbiased text are decided by the model's own logits).
"""

from __future__ import annotations

import zlib

import faiss
import numpy as np
import pytest
import torch
from helpers import bigram_bias

from bridge_pl.attention import MIN_SHARED_PREFIX
from bridge_pl.models import load_causal_lm, load_tokenizer
from bridge_pl.records import Passage
from bridge_pl.rollout import EnvConfig, HFRolloutEngine, SearchEnv, SearchOutcome
from bridge_pl.rollout.engine import _common_prefix_length

BIAS = 30.0

PASSAGES = [
    Passage("p0", "Alpha", "alpha is the first letter of the Greek alphabet."),
    Passage("p1", "Beta", "beta follows alpha; beta decay emits electrons."),
    Passage("p2", "Gamma", "gamma rays are high-energy photons."),
    Passage("p3", "Paris", "Paris is the capital of France."),
    Passage("p4", "Alphabet", "an alphabet is a set of letters; alpha, beta."),
    Passage("p5", "Lyon", "Lyon is a city in France on the Rhone."),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def model():
    return load_causal_lm("tiny-llama")


@pytest.fixture(scope="module")
def env(tok):
    return SearchEnv(EnvConfig(), tok)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def one(tok, text: str) -> int:
    (token,) = ids(tok, text)
    return token


def chain(tokens: list[int]) -> dict[int, dict[int, float]]:
    """Force ``tokens[1:]``: each token leads to the next one."""
    return {a: {b: BIAS} for a, b in zip(tokens[:-1], tokens[1:], strict=True)}


def embed(texts: list[str], dim: int = 64) -> np.ndarray:
    """Deterministic hashed character-trigram embeddings, L2-normalised: ``[N, dim]`` float32."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for i, text in enumerate(texts):
        t = f"  {text.lower()}  "
        for j in range(len(t) - 2):
            out[i, zlib.crc32(t[j: j + 3].encode()) % dim] += 1.0
    return out / np.linalg.norm(out, axis=1, keepdims=True)


class FaissSearch:
    """A real FAISS inner-product index over PASSAGES; top-3 candidates, the best 2 shown."""

    def __init__(self, on_call=None) -> None:
        self.index = faiss.IndexFlatIP(64)
        self.index.add(embed([f"{p.title} {p.text}" for p in PASSAGES]))
        self.calls: list[list[str]] = []
        self.on_call = on_call

    def lookup(self, query: str) -> SearchOutcome:
        scores, rows = self.index.search(embed([query]), 3)
        cand = [int(r) for r in rows[0]]
        return SearchOutcome(cand, cand[:2], float(-np.log(2.0)), [PASSAGES[r] for r in cand[:2]])

    def __call__(self, queries: list[str]) -> list[SearchOutcome]:
        self.calls.append(list(queries))
        if self.on_call is not None:
            self.on_call(len(self.calls))
        return [self.lookup(q) for q in queries]


def segments(traj) -> list[tuple[int, list[int]]]:
    """Split a response into maximal runs of equal mask: ``[(mask, ids), ...]``."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(traj.response_ids, traj.action_mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


def grammar_table(tok) -> dict[int, dict[int, float]]:
    """After '<' the model writes ``<search>alpha|Paris</search>`` (rarely closing with </answer>, an invalid
    turn); after ' <' it writes `` <answer>, Paris </answer>`` (other tokens for '>' and 'answer', so the two
    chains never share a bigram). Which start token leads where is up to each test."""
    t = {s: one(tok, s) for s in ["<", " <", "</", " </", "search", "answer", "ans", "wer", ">", ">,", "alpha",
                                  "Paris", " Paris"]}
    table = chain([t["<"], t["search"], t[">"]]) | chain([t["alpha"], t["</"]]) | chain([t["Paris"], t["</"]])
    table[t[">"]] = {t["alpha"]: BIAS, t["Paris"]: BIAS}
    table[t["</"]] = {t["search"]: BIAS, t["answer"]: BIAS - 2.0}
    table |= chain([t[" <"], t["answer"], t[">,"], t[" Paris"], t[" </"], t["ans"], t["wer"], t[">"]])
    return table


def test_multi_turn_observations_are_exactly_what_faiss_returned(model, tok, env):
    engine = HFRolloutEngine(env, max_turns=3, max_new_tokens_per_turn=12, max_response_tokens=1000)
    prompts = [ids(tok, "Question: what comes after alpha?\n"), ids(tok, "Q: capital of France?\n")]
    begin = [p[-1] for p in prompts] + [ids(tok, env.observation([]))[-1], ids(tok, env.invalid_message)[-1]]
    lt, sp_lt, the = one(tok, "<"), one(tok, " <"), one(tok, " the")
    search = FaissSearch()
    gen = torch.Generator().manual_seed(0)
    table = grammar_table(tok) | {s: {lt: BIAS + 1.5, sp_lt: BIAS, the: BIAS} for s in begin}
    with bigram_bias(model, table):
        trajs = engine.generate(model, tok, prompts, search, n_samples=4, generator=gen)

    assert [t.prompt_index for t in trajs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert 1 <= len(search.calls) <= engine.max_turns and all(search.calls)
    all_searches = [c for t in trajs for c in t.searches]
    assert sum(len(q) for q in search.calls) == len(all_searches) >= 4
    assert max(len(t.searches) for t in trajs) >= 2, "want several search turns in one trajectory"
    for traj in trajs:
        assert traj.response_text == tok.decode(traj.response_ids)
        runs = segments(traj)
        policy_runs = [r for m, r in runs if m == 1]
        assert runs[0][0] == 1 and len(policy_runs) == traj.turns
        calls = iter(traj.searches)
        for turn, (mask, run) in enumerate(runs[::2], start=1):
            assert mask == 1
            action = env.parse_action(tok.decode(run))
            if 2 * turn - 1 >= len(runs):  # last turn: nothing was appended
                break
            env_ids = runs[2 * turn - 1][1]
            if action.kind == "search":
                expected = search.lookup(action.content)  # recomputed straight from FAISS
                call = next(calls)
                assert (call.query, call.turn) == (action.content, turn)
                assert call.outcome.passage_rows == expected.passage_rows
                assert call.outcome.candidate_rows == expected.candidate_rows
                obs_text = tok.decode(env_ids)
                for i, p in enumerate(expected.passages, start=1):
                    assert f'Doc {i}(Title: "{p.title}") {p.text}' in obs_text
                reply = env.reply(action, expected.passages, turn == engine.max_turns)
            else:
                assert action.kind == "invalid"
                reply = env.reply(action, None, turn == engine.max_turns)
            assert env_ids == ids(tok, reply), "env tokens must be the reply tokenised on its own"
        assert next(calls, None) is None
        assert traj.valid_actions + traj.invalid_actions == traj.turns


def test_masks_token_by_token_on_a_hand_built_trajectory(model, tok, env):
    """Turn 1 searches 'alpha' and closes the tag with unusual tokens ('se' 'arch' '>.'): the ids kept
    are the sampled ones, up to and including the token that completes '</search>'. Turn 2 answers."""
    engine = HFRolloutEngine(env, max_turns=2, max_new_tokens_per_turn=20, max_response_tokens=1000)
    prompt = ids(tok, "Question: first Greek letter?\n")
    t = {s: one(tok, s) for s in ["<", " <", "</", "search", "se", "arch", "answer", ">", ">.", "alpha", "Paris"]}
    turn1 = [t["<"], t["search"], t[">"], t["alpha"], t["</"], t["se"], t["arch"], t[">."]]
    turn2 = [t[" <"], t["answer"], t[">"], t["Paris"], t["</"], t["answer"], t[">"]]
    table = chain([prompt[-1], *turn1])

    obs_end = ids(tok, env.observation([]))[-1]

    def next_turn(_: int) -> None:  # after the search: steer turn 2 from the observation's last token
        table.clear()
        table.update(chain([obs_end, *turn2]))

    search = FaissSearch(on_call=next_turn)
    with bigram_bias(model, table):
        (traj,) = engine.generate(model, tok, [prompt], search, greedy=True)

    obs = ids(tok, env.reply(env.parse_action("<search>alpha</search>"), search.lookup("alpha").passages, False))
    assert tok.decode(turn1) == "<search>alpha</search>."
    assert traj.prompt_ids == prompt
    expected_ids = turn1 + obs + turn2
    expected_mask = [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert len(traj.response_ids) == len(traj.action_mask) == len(expected_ids)
    for i, (token, m) in enumerate(zip(traj.response_ids, traj.action_mask, strict=True)):
        assert (token, m) == (expected_ids[i], expected_mask[i]), f"response position {i}"
    assert traj.response_text == "<search>alpha</search>." + tok.decode(obs) + " <answer>Paris</answer>"
    assert (traj.turns, traj.valid_actions, traj.invalid_actions, traj.finished) == (2, 2, 0, True)
    assert [(c.query, c.turn, c.outcome.passage_rows) for c in traj.searches] == [
        ("alpha", 1, search.lookup("alpha").passage_rows)
    ]


SHARED_LEAD = "You are a careful agent. Read the question below, think, search when needed, then answer. "


@pytest.mark.parametrize("lead", ["", SHARED_LEAD], ids=["distinct", "shared-prefix"])
def test_kv_cache_decoding_equals_full_prefix_greedy(model, tok, env, lead):
    """Greedy tokens from the cached engine (left padding, holes, pruning, compaction, a shared prompt
    prefix fed once) equal the argmax of a plain full-sequence forward over the recorded prefix, at every
    sampled position."""
    engine = HFRolloutEngine(env, max_turns=3, max_new_tokens_per_turn=9, max_response_tokens=1000)
    lt, sp_lt = one(tok, "<"), one(tok, " <")
    texts = ["Search please:", "a somewhat longer prompt, then answer?", "free"]
    prompts = [ids(tok, lead + text) for text in texts]
    assert (_common_prefix_length(prompts) >= MIN_SHARED_PREFIX) == bool(lead)
    # prompt 0 searches every turn (then free text), prompt 1 answers at once, prompt 2 is free text
    table = grammar_table(tok) | chain([prompts[0][-1], lt]) | chain([prompts[1][-1], sp_lt])
    table[ids(tok, env.observation([]))[-1]] = {lt: BIAS}
    with bigram_bias(model, table, generation_only=False):  # the reference below is a plain forward
        trajs = engine.generate(model, tok, prompts, FaissSearch(), n_samples=2, greedy=True)
        assert len({t.turns for t in trajs}) >= 2, "rows must leave the batch at different turns"
        assert {t.finished for t in trajs} == {True, False}
        for traj in trajs:
            full = torch.tensor([traj.prompt_ids + traj.response_ids])
            with torch.no_grad():
                argmax = model(full).logits[0, len(traj.prompt_ids) - 1: -1].argmax(-1).tolist()
            sampled = [(a, r) for a, r, m in zip(argmax, traj.response_ids, traj.action_mask, strict=True) if m]
            assert [a for a, _ in sampled] == [r for _, r in sampled]
    # the two samples of a prompt are identical under greedy decoding
    assert all(trajs[2 * i].response_ids == trajs[2 * i + 1].response_ids for i in range(len(prompts)))


def test_sampling_is_reproducible_and_tiny_top_p_is_greedy(model, tok, env):
    prompts = [ids(tok, "Who wrote Hamlet?"), ids(tok, "x")]
    search = FaissSearch()
    sample = HFRolloutEngine(env, max_turns=1, max_new_tokens_per_turn=8, temperature=1.0)
    a = sample.generate(model, tok, prompts, search, n_samples=3, generator=torch.Generator().manual_seed(1))
    b = sample.generate(model, tok, prompts, search, n_samples=3, generator=torch.Generator().manual_seed(1))
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert len({tuple(t.response_ids) for t in a}) > 2  # samples differ at temperature 1
    greedy = sample.generate(model, tok, prompts, search, greedy=True)
    nucleus = HFRolloutEngine(env, max_turns=1, max_new_tokens_per_turn=8, top_p=1e-6)
    tiny_p = nucleus.generate(model, tok, prompts, search, generator=torch.Generator().manual_seed(2))
    assert [t.response_ids for t in tiny_p] == [t.response_ids for t in greedy]


def test_token_budgets(model, tok, env):
    prompts = [ids(tok, "Question?"), ids(tok, "Another question here?")]
    per_turn = HFRolloutEngine(env, max_turns=2, max_new_tokens_per_turn=5, max_response_tokens=1000)
    for traj in per_turn.generate(model, tok, prompts, FaissSearch(), greedy=True):
        assert all(len(run) <= 5 for m, run in segments(traj) if m == 1)
    total = HFRolloutEngine(env, max_turns=4, max_new_tokens_per_turn=30, max_response_tokens=70)
    for traj in total.generate(model, tok, prompts, FaissSearch(), greedy=True):
        assert len(traj.response_ids) <= 70 and not traj.finished


def test_eval_mode_no_grad_and_mode_restored(model, tok, env):
    seen = []
    handle = model.register_forward_hook(lambda m, a, o: seen.append((m.training, torch.is_grad_enabled())))
    model.train()
    try:
        HFRolloutEngine(env, max_turns=1, max_new_tokens_per_turn=3).generate(
            model, tok, [ids(tok, "hi")], FaissSearch(), greedy=True
        )
    finally:
        handle.remove()
    assert model.training
    assert seen and all(s == (False, False) for s in seen)
    model.eval()
    HFRolloutEngine(env, max_turns=1, max_new_tokens_per_turn=3).generate(
        model, tok, [ids(tok, "hi")], FaissSearch(), greedy=True
    )
    assert not model.training


def test_the_lm_head_gets_each_rows_last_position_contiguous(model, tok, env):
    """Every engine forward (the prefill of several tokens included) hands the LM head one contiguous row per
    sequence: on a strided ``hidden[:, -1:]`` view CPU ``F.linear`` expands and copies the whole head once per row."""
    assert len(ids(tok, "Who wrote Hamlet?")) > 1  # a prefill of several tokens, where the strided view arises
    head_inputs = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: head_inputs.append(args[0]))
    try:
        HFRolloutEngine(env, max_turns=1, max_new_tokens_per_turn=3).generate(
            model, tok, [ids(tok, "Who wrote Hamlet?"), ids(tok, "x")], FaissSearch(), greedy=True
        )
    finally:
        handle.remove()
    assert head_inputs and all(x.shape[1] == 1 and x.is_contiguous() for x in head_inputs)
    assert head_inputs[0].shape[0] == 2  # the prefill: both prompts, several tokens each


def test_bad_inputs(model, tok, env):
    engine = HFRolloutEngine(env, max_turns=1, max_new_tokens_per_turn=8)
    with pytest.raises(ValueError, match="prompts"):
        engine.generate(model, tok, [[]], FaissSearch())
    with pytest.raises(ValueError, match="max_turns"):
        HFRolloutEngine(env, max_turns=0)
    with pytest.raises(ValueError, match="temperature"):
        HFRolloutEngine(env, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        HFRolloutEngine(env, top_p=0.0)
    prompt = ids(tok, "go")
    with bigram_bias(model, grammar_table(tok) | chain([prompt[-1], one(tok, "<")])):
        with pytest.raises(ValueError, match="2 outcomes for 1 queries"):
            engine.generate(model, tok, [prompt], lambda qs: [FaissSearch().lookup(q) for q in qs * 2],
                            greedy=True)


def test_the_steering_helper_refuses_to_bias_a_forward_outside_generation(model):
    """``bigram_bias`` steers generation only; a forward elsewhere (as in a loss) fails the test that made it."""
    ids = torch.tensor([[1, 2, 3]])
    with bigram_bias(model, {}), torch.no_grad(), pytest.raises(AssertionError, match="outside HFRolloutEngine"):
        model(input_ids=ids)
    with bigram_bias(model, {}), pytest.raises(AssertionError, match="outside HFRolloutEngine"):
        model(input_ids=ids)
