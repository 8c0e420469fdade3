"""Whether a run's rollouts fit its policy, checked before any model loads (:func:`rollout_problems`): only the
tokenizer and the model's Hugging Face config are read (no weights).

- The model's context. A trajectory grows to its prompt plus ``data.max_response_tokens`` at most. Past the policy's
  ``max_position_embeddings`` the model runs at positions it was never trained on (or has no embedding for), and a
  budget far beyond it lets one rollout run for hours. Checked for every engine.
- The vLLM engine's length. vLLM serves sequences of at most ``max_model_len`` tokens. A turn whose prompt plus
  budget passes it is cut short without notice, and the next turn's prompt (the row's ids so far) is then longer than
  the limit, which vLLM refuses mid-run. Checked when vLLM may generate (:func:`length_problem`).
- vLLM's CPU attention kernels, which need heads at least :data:`VLLM_CPU_MIN_HEAD_DIM` wide: checked for
  ``data.engine=vllm`` without CUDA (``auto`` falls back to ``hf`` by itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from bridge_pl.models import load_tokenizer, resolve_model
from bridge_pl.records import QAExample
from bridge_pl.rollout.env import EnvConfig
from bridge_pl.rollout.prompts import PromptBuilder, options_text
from bridge_pl.rollout.vllm_engine import DEFAULT_MAX_MODEL_LEN, engine_max_model_len, vllm_available

# Tokens by which the length of a prompt may differ from the template's plus its question's (and options'): a token
# merged across a seam between template and question text, at most one per side of each seam, kept generous.
SEAM_SLACK = 8
# The narrowest attention head vLLM's CPU attention backend takes (its supported head sizes start at 32).
VLLM_CPU_MIN_HEAD_DIM = 32
# Hugging Face config attributes that hold a model's context length, by architecture, the first one set wins.
_CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def length_problem(longest_prompt: int, max_response_tokens: int, max_model_len: int, derived: bool) -> str | None:
    """One line saying that ``longest_prompt + max_response_tokens`` (tokens) exceeds the engine's ``max_model_len``
    (``derived``: not set, the model's limit), naming the options to change; None when it fits."""
    needed = longest_prompt + max_response_tokens
    if needed <= max_model_len:
        return None
    limit = (f"the vLLM engine's max_model_len ({max_model_len}: data.vllm.max_model_len is unset, so the model's "
             f"max_position_embeddings, at most {DEFAULT_MAX_MODEL_LEN})" if derived
             else f"data.vllm.max_model_len ({max_model_len})")
    return (f"{limit} is shorter than the longest prompt ({longest_prompt} tokens) plus data.max_response_tokens "
            f"({max_response_tokens}), {needed} tokens: vLLM would cut turns short and then refuse the next turn's "
            f"prompt; set data.vllm.max_model_len to at least {needed} or lower data.max_response_tokens")


def _question_text(example: QAExample) -> str:
    """What of ``example`` goes into its prompt: the question, and the options of a multiple-choice one."""
    options = example.metadata.get("options")
    return f"{example.question}\n{options_text(options)}" if options else example.question


class LongestPrompt(NamedTuple):
    """The longest prompt of a run's QA sets: its length in ``tokens`` and the ``example_id`` of its question (None
    for no examples)."""

    tokens: int
    example_id: str | None


def longest_prompt(prompts: PromptBuilder, tokenizer, examples: Sequence[QAExample]) -> LongestPrompt:
    """The longest prompt of ``examples``, built by ``prompts``.

    Every question (with its options) is tokenised alone, in one batch; whole prompts are built only for those
    within :data:`SEAM_SLACK` tokens of the longest of their template (free-text or multiple-choice), since the
    prompt adds the same template to each. ``(0, None)`` for no examples.
    """
    longest = LongestPrompt(0, None)
    for choice in (False, True):
        group = [ex for ex in examples if bool(ex.metadata.get("options")) is choice]
        if not group:
            continue
        sizes = [len(ids) for ids in tokenizer([_question_text(ex) for ex in group],
                                               add_special_tokens=False)["input_ids"]]
        cutoff = max(sizes) - SEAM_SLACK
        for ex, size in zip(group, sizes, strict=True):
            if size >= cutoff:
                tokens = len(prompts.ids(tokenizer, ex.question, ex.metadata.get("options")))
                longest = max(longest, LongestPrompt(tokens, ex.id), key=lambda found: found.tokens)
    return longest


def _prompt_builder(data: Mapping[str, Any]) -> PromptBuilder:
    """The prompt builder of the datamodule settings ``data`` (``env``, ``instruction``, ``choice_instruction``,
    ``use_chat_template``; parsed options or their values)."""
    env = data.get("env")
    if env is not None and not isinstance(env, EnvConfig):
        env = EnvConfig(**dict(env.items()))
    return PromptBuilder(data["instruction"], data["choice_instruction"], env or EnvConfig(), data["use_chat_template"])


def model_context(hf_config) -> int | None:
    """The longest sequence the model takes, in tokens, from its Hugging Face config (``max_position_embeddings`` or
    its equivalent); None when the config names none."""
    for name in _CONTEXT_ATTRIBUTES:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def context_problem(longest_prompt: int, max_response_tokens: int, context: int, model: str) -> str | None:
    """One line saying that ``longest_prompt + max_response_tokens`` exceeds the policy ``model``'s ``context``,
    naming the option to change; None when it fits."""
    needed = longest_prompt + max_response_tokens
    if needed <= context:
        return None
    limit = f"the policy's context ({context} tokens: max_position_embeddings of {model})"
    if longest_prompt >= context:
        return (f"the longest prompt ({longest_prompt} tokens) does not fit {limit}; shorten data.instruction or the "
                "questions, or use a model with a longer context")
    return (f"data.max_response_tokens ({max_response_tokens}) plus the longest prompt ({longest_prompt} tokens) is "
            f"{needed} tokens, more than {limit}; set data.max_response_tokens to at most {context - longest_prompt}")


def head_dim(hf_config) -> int | None:
    """The width of the model's attention heads (``head_dim``, else ``hidden_size / num_attention_heads``); None
    when the config gives neither."""
    width = getattr(hf_config, "head_dim", None)
    if isinstance(width, int) and width > 0:
        return width
    hidden, heads = getattr(hf_config, "hidden_size", None), getattr(hf_config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def vllm_cpu_problem(hf_config, model: str) -> str | None:
    """One line saying that vLLM's CPU attention cannot run ``model`` (heads narrower than
    :data:`VLLM_CPU_MIN_HEAD_DIM`), naming ``data.engine`` and the fix; None when it can or the width is unknown."""
    width = head_dim(hf_config)
    if width is None or width >= VLLM_CPU_MIN_HEAD_DIM:
        return None
    return (f"data.engine=vllm cannot run {model} without CUDA: vLLM's CPU attention needs heads at least "
            f"{VLLM_CPU_MIN_HEAD_DIM} wide, {model}'s are {width}; set data.engine=hf (or auto, which uses hf where "
            "vLLM cannot run the policy)")


def _vllm_length_problem(data: Mapping[str, Any], hf_config, longest: int) -> str | None:
    """The :func:`length_problem` of the vLLM engine that ``data`` (the parsed ``data`` options) configures."""
    max_model_len = getattr(data.get("vllm"), "max_model_len", None)
    limit = engine_max_model_len(max_model_len, hf_config)
    problem = length_problem(longest, data["max_response_tokens"], limit, derived=max_model_len is None)
    if problem is not None and data["engine"] == "auto":
        problem += " (data.engine=auto generates with vLLM where it imports; data.engine=hf does not use it)"
    return problem


def rollout_problems(data: Mapping[str, Any], model: str | None, sets: Iterable[list[QAExample]]) -> list[str]:
    """What keeps a run's rollouts from fitting its policy (see the module docstring), as one-line messages naming
    the options; empty when they fit. ``data``: the parsed ``data`` options; ``model``:
    ``model.policy.init_args.model`` (None: not checked); ``sets``: the QA sets the run reads (evaluation sets whole).

    vLLM's length is checked where the vLLM backend may generate: ``data.engine=vllm``, or ``auto`` wherever vLLM
    imports (whatever the number of processes, and even if vLLM would then turn out unable to run the policy).
    """
    if model is None:
        return []
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(resolve_model(model))
    engine = data["engine"]
    kernels = vllm_cpu_problem(hf_config, model) if engine == "vllm" and not torch.cuda.is_available() else None
    longest = longest_prompt(_prompt_builder(data), load_tokenizer(model), [ex for s in sets for ex in s])
    length = None
    if engine == "vllm" or (engine == "auto" and vllm_available()):
        length = _vllm_length_problem(data, hf_config, longest.tokens)
    context = model_context(hf_config)
    if length is None and context is not None:  # vLLM's length, when too short, says enough
        length = context_problem(longest.tokens, data["max_response_tokens"], context, model)
    if length is not None:
        length += f" (the longest prompt is question {longest.example_id})"
    return [problem for problem in (kernels, length) if problem is not None]
