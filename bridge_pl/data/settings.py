"""The datamodule's settings checks and the QA sets each stage reads.

Shared by the CLI (on the parsed config, before any model loads) and ``RolloutDataModule.__init__`` (a datamodule
built in Python); every message names the option (``data.<name>``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from bridge_pl.config import AT_LEAST_ONE, OPEN_CLOSED_UNIT_INTERVAL, Rule, rule_problems
from bridge_pl.data.sources import load_qa
from bridge_pl.records import QAExample, QASpec
from bridge_pl.rollout.prompts import template_problem

MIN_TEMPERATURE = 0.01  # data.temperature floor: below it sampling is greedy in float32 and a GRPO group's
# samples are all alike (no advantage signal); evaluation is greedy anyway

# option (without ``data.``) -> its rule (a non-finite number is refused by rule_problems whatever the rule)
DATA_RULES: dict[str, Rule] = {
    **dict.fromkeys(("batch_size", "n_samples", "eval_batch_size", "max_turns", "max_new_tokens_per_turn",
                     "max_response_tokens", "max_sampling_rounds"), AT_LEAST_ONE),
    "temperature": Rule(lambda v: v >= MIN_TEMPERATURE,
                        f"a finite number >= {MIN_TEMPERATURE} (below it every sample of a group is the same)"),
    "max_eval_examples": AT_LEAST_ONE.worded("null (all) or an integer >= 1"),
    "top_p": OPEN_CLOSED_UNIT_INTERVAL,
    "type_mixture": Rule(lambda v: all(math.isfinite(w) and w >= 0 for w in v.values()) and sum(v.values()) > 0,
                         "finite weights >= 0 with a positive sum"),
}


def data_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with the datamodule's settings ``values`` (option name -> value, unset optional ones None),
    as messages that name the option (``data.<name>``); empty when they are fine."""
    problems = rule_problems("data", values, DATA_RULES)
    for key, extra in (("instruction", ()), ("choice_instruction", ("options",))):
        if values.get(key) is not None and (requirement := template_problem(values[key], extra)):
            problems.append(f"data.{key} must be {requirement}")
    return problems


DEFAULT_VAL = {"world_dev": "world/dev"}
DEFAULT_TEST = {"world_test": "world/test"}


def source_key(source: QASpec) -> str:
    """The key a QA set is cached under: its name or path, or the identity of an inline list."""
    return source if isinstance(source, str) else f"<inline list {id(source)}>"


def read_stage_sources(stage: str, data: Mapping[str, Any], known: Mapping[str, list[QAExample]] | None = None,
                       ) -> dict[str, list[QAExample]]:
    """Read (and so check) every QA set ``stage`` reads, by source key, from the datamodule's settings ``data``
    (``train``, ``val``, ``test``, ``batch_size``, ``type_mixture``; unset val/test: the defaults); sets in
    ``known`` are not read again. For ``fit``, a ``data.batch_size`` larger than the training set is an error.

    Raises:
        DataFormatError: a malformed set (the message names file:line and field); ValueError: the batch size.
    """
    val = data.get("val") if data.get("val") is not None else DEFAULT_VAL
    test = data.get("test") if data.get("test") is not None else DEFAULT_TEST
    sources = {"fit": [data["train"], *val.values()], "validate": list(val.values())}.get(stage, list(test.values()))
    sets = dict(known or {})
    for source in sources:
        if source_key(source) not in sets:
            sets[source_key(source)] = load_qa(source)
    if stage == "fit" and data.get("type_mixture") is None:  # a mixture draws with replacement
        train_size, batch_size = len(sets[source_key(data["train"])]), data["batch_size"]
        if batch_size > train_size:
            name = data["train"] if isinstance(data["train"], str) else "(inline list)"
            raise ValueError(f"data.batch_size ({batch_size}) is larger than the training set {name} "
                             f"({train_size} examples)")
    return sets
