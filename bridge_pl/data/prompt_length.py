"""Whether the vLLM engine's length holds every prompt plus a whole response, checked before any model loads.

vLLM serves sequences of at most ``max_model_len`` tokens. A turn whose prompt plus budget passes it is cut short
without notice, and the next turn's prompt (the row's ids so far) is then longer than the limit, which vLLM
refuses mid-run. A trajectory grows to its prompt plus ``data.max_response_tokens`` at most, so a config whose
longest prompt plus that exceeds the engine's length is refused up front (:func:`vllm_length_problem`). Only the
tokenizer and the model's Hugging Face config are read (no weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bridge_pl.data.datamodule import RolloutDataModule, options_text
from bridge_pl.data.qa import QAExample
from bridge_pl.models import load_tokenizer, resolve_model
from bridge_pl.rollout.env import EnvConfig
from bridge_pl.rollout.vllm_engine import DEFAULT_MAX_MODEL_LEN, engine_max_model_len, vllm_available

# Tokens by which the length of a prompt may differ from the template's plus its question's (and options'): a token
# merged across a seam between template and question text, at most one per side of each seam, kept generous.
SEAM_SLACK = 8


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


def longest_prompt(data: RolloutDataModule, tokenizer, examples: Sequence[QAExample]) -> int:
    """The length in tokens of the longest prompt of ``examples``, built by :meth:`RolloutDataModule.prompt_ids`.

    Every question (with its options) is tokenised alone, in one batch; whole prompts are built only for those
    within :data:`SEAM_SLACK` tokens of the longest of their template (free-text or multiple-choice), since the
    prompt adds the same template to each. 0 for no examples.
    """
    longest = 0
    for choice in (False, True):
        group = [ex for ex in examples if bool(ex.metadata.get("options")) is choice]
        if not group:
            continue
        sizes = [len(ids) for ids in tokenizer([_question_text(ex) for ex in group],
                                               add_special_tokens=False)["input_ids"]]
        cutoff = max(sizes) - SEAM_SLACK
        for ex, size in zip(group, sizes, strict=True):
            if size >= cutoff:
                longest = max(longest, len(data.prompt_ids(tokenizer, ex.question, ex.metadata.get("options"))))
    return longest


def _prompt_builder(data: Mapping[str, Any]) -> RolloutDataModule:
    """A datamodule with the prompt settings of ``data`` (``env``, ``instruction``, ``choice_instruction``,
    ``use_chat_template``; parsed options or their values), to build prompts with."""
    env = data.get("env")
    if env is not None and not isinstance(env, EnvConfig):
        env = EnvConfig(**dict(env.items()))
    return RolloutDataModule(env=env, instruction=data["instruction"], choice_instruction=data["choice_instruction"],
                             use_chat_template=data["use_chat_template"])


def vllm_length_problem(data: Mapping[str, Any], model: str | None, sets: Iterable[list[QAExample]]) -> str | None:
    """The :func:`length_problem` of a run's datamodule settings ``data`` (the parsed ``data`` options), its policy
    ``model`` (``model.policy.init_args.model``) and the QA sets it reads (``sets``, evaluation sets whole), or None.

    Checked when the vLLM backend may generate: ``data.engine=vllm``, or ``auto`` wherever vLLM imports (whatever
    the number of processes, and even if vLLM would then turn out unable to run the policy); never for ``hf``.
    """
    engine = data["engine"]
    if model is None or engine == "hf" or (engine == "auto" and not vllm_available()):
        return None
    from transformers import AutoConfig

    tokenizer = load_tokenizer(model)
    max_model_len = getattr(data.get("vllm"), "max_model_len", None)
    limit = engine_max_model_len(max_model_len, AutoConfig.from_pretrained(resolve_model(model)))
    examples = [ex for examples in sets for ex in examples]
    problem = length_problem(longest_prompt(_prompt_builder(data), tokenizer, examples),
                             data["max_response_tokens"], limit, derived=max_model_len is None)
    if problem is not None and engine == "auto":
        problem += " (data.engine=auto generates with vLLM where it imports; data.engine=hf does not use it)"
    return problem
