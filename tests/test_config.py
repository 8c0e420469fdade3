"""The one way settings' ranges are checked (``bridge_pl.config``): :class:`Rule` tables, :func:`rule_problems` and
:func:`raise_problems`, and the groups and classes that declare their rules with them."""

import math
from typing import Literal

import pytest

from bridge_pl.config import (
    AT_LEAST_ONE,
    FINITE,
    LEARNING_RATE,
    NON_NEGATIVE,
    OPEN_CLOSED_UNIT_INTERVAL,
    OPEN_UNIT_INTERVAL,
    POSITIVE,
    UNIT_INTERVAL,
    RetrievalSampling,
    RLConfig,
    Rule,
    SolverConfig,
    group_problems,
    one_of,
    raise_problems,
    require_choice,
    rule_problems,
)
from bridge_pl.data.settings import data_problems
from bridge_pl.rollout.vllm_engine import VLLMConfig


@pytest.mark.parametrize(
    ("rule", "passing", "failing"),
    [
        (AT_LEAST_ONE, [1, 7], [0, -3]),
        (POSITIVE, [1e-9, 2], [0, -1.0]),
        (NON_NEGATIVE, [0, 0.5], [-1e-9]),
        (UNIT_INTERVAL, [0, 0.5, 1], [-0.1, 1.01]),
        (OPEN_UNIT_INTERVAL, [0.01, 0.99], [0, 1]),
        (OPEN_CLOSED_UNIT_INTERVAL, [1e-6, 1], [0, 1.5]),
        (FINITE, [0, -5.5, 1e300], [math.inf, -math.inf, math.nan]),
        (LEARNING_RATE, [1e-5], [0, -0.01]),
    ],
)
def test_the_shared_rules(rule, passing, failing):
    assert all(rule.ok(v) for v in passing)
    assert not any(rule.ok(v) for v in failing)


def test_messages_name_the_option_the_requirement_and_the_value_in_the_order_of_the_rules():
    rules = {"b": AT_LEAST_ONE, "a": UNIT_INTERVAL, "c": POSITIVE}
    assert rule_problems("model.x", {"a": 2.5, "b": 0, "c": 3}, rules) == [
        "model.x.b must be an integer >= 1, got 0",
        "model.x.a must be in [0, 1], got 2.5",
    ]
    assert rule_problems("model.x", {"a": 0.5, "b": 1, "c": 3}, rules) == []


def test_none_and_absent_values_are_skipped_and_other_keys_ignored():
    rules = {"a": POSITIVE, "b": POSITIVE}
    assert rule_problems("p", {"a": None, "other": -1}, rules) == []


def test_a_non_finite_number_is_reported_as_such_whatever_its_rule():
    rules = {"nan": POSITIVE, "inf": NON_NEGATIVE, "minus_inf": Rule(lambda v: True, "anything")}
    assert rule_problems("g", {"nan": math.nan, "inf": math.inf, "minus_inf": -math.inf}, rules) == [
        "g.nan must be a finite number, got nan",
        "g.inf must be a finite number, got inf",
        "g.minus_inf must be a finite number, got -inf",
    ]


def test_values_that_are_not_numbers_go_to_their_rule():
    rules = {"mixture": Rule(lambda v: sum(v.values()) > 0, "weights with a positive sum"),
             "mode": one_of(Literal["x"])}
    assert rule_problems("data", {"mixture": {"a": 0}, "mode": "y"}, rules) == [
        "data.mixture must be weights with a positive sum, got {'a': 0}",
        "data.mode must be one of ['x'], got 'y'",
    ]


def test_the_prefix_names_the_option():
    rules = {"batch_size": AT_LEAST_ONE.worded(">= 1")}
    assert rule_problems("", {"batch_size": 0}, rules) == ["batch_size must be >= 1, got 0"]
    assert rule_problems(lambda key: f"Thing option '{key}'", {"batch_size": 0}, rules) == [
        "Thing option 'batch_size' must be >= 1, got 0"]


def test_worded_keeps_the_test_and_changes_the_requirement():
    rule = AT_LEAST_ONE.worded("null (all) or an integer >= 1")
    assert rule.ok is AT_LEAST_ONE.ok and rule.requirement == "null (all) or an integer >= 1"
    assert AT_LEAST_ONE.requirement == "an integer >= 1"


def test_raise_problems_joins_every_message_and_is_quiet_without_any():
    raise_problems([])
    raise_problems(iter(()))
    with pytest.raises(ValueError) as error:
        raise_problems(iter(["a must be > 0, got 0", "b must be >= 1, got -1"]))
    assert str(error.value) == "a must be > 0, got 0; b must be >= 1, got -1"


def test_require_choice_refuses_none_unlike_a_range_rule():
    assert require_choice("k", "a", Literal["a", "b"]) == "a"
    with pytest.raises(ValueError, match=r"^k must be one of \['a', 'b'\], got None$"):
        require_choice("k", None, Literal["a", "b"])


def test_a_group_raises_all_its_problems_at_once_and_group_problems_lists_them():
    with pytest.raises(ValueError) as error:
        RLConfig(kl_coef=-1, gamma=2, tis_cap=0.5)
    assert str(error.value).split("; ") == [
        "model.rl.kl_coef must be >= 0, got -1",
        "model.rl.gamma must be in [0, 1], got 2",
        "model.rl.tis_cap must be >= 1 (or null: off), got 0.5",
    ]
    assert group_problems({"solver": {"neumann_lr": 0.0, "lam_init": 20.0},
                           "retrieval": {"top_k": 5, "candidates": 4}}) == [
        "model.solver.neumann_lr must be > 0 (a learning rate), got 0.0",
        "model.solver.lam_init (20.0) must be <= model.solver.lam_max (10.0)",
        "model.retrieval.top_k (5) must be <= model.retrieval.candidates (4)",
    ]
    assert SolverConfig(grad_clip_policy=None).problems() == [] and RetrievalSampling().problems() == []


def test_a_group_refuses_a_non_finite_number_its_rule_would_pass():
    with pytest.raises(ValueError, match=r"^model.rl.kl_coef must be a finite number, got inf$"):
        RLConfig(kl_coef=math.inf)


def test_the_vllm_settings_are_a_group():
    assert VLLMConfig().problems() == []
    with pytest.raises(ValueError) as error:
        VLLMConfig(kv_cache_gb=0, gpu_memory_utilization=1.0, max_model_len=1, max_num_seqs=0, block_size=24)
    assert str(error.value).split("; ") == [
        "data.vllm.kv_cache_gb must be >= 1 (GiB), got 0",
        "data.vllm.gpu_memory_utilization must be in (0, 1), got 1.0",
        "data.vllm.max_model_len must be >= 2, got 1",
        "data.vllm.max_num_seqs must be >= 1, got 0",
        "data.vllm.block_size must be a positive multiple of 16, got 24",
    ]
    with pytest.raises(ValueError, match=r"^data.vllm.weight_sync must be one of \['auto', 'merged', 'adapter'\]"):
        VLLMConfig(weight_sync="lora")


def test_data_problems_use_the_shared_rules():
    assert data_problems({"batch_size": 0, "max_eval_examples": 0, "top_p": 0, "temperature": math.nan,
                          "n_samples": None}) == [
        "data.batch_size must be an integer >= 1, got 0",
        "data.temperature must be a finite number, got nan",
        "data.max_eval_examples must be null (all) or an integer >= 1, got 0",
        "data.top_p must be in (0, 1], got 0",
    ]


def test_the_engines_the_dense_retriever_and_the_warm_start_check_their_tables():
    from bridge_pl.retrieval.dense import DenseRetriever
    from bridge_pl.rollout.engine import HFRolloutEngine
    from callbacks.warm_start import WarmStart

    with pytest.raises(ValueError) as error:
        HFRolloutEngine(None, max_turns=0, temperature=0.0, top_p=math.nan)
    assert str(error.value).split("; ") == [
        "HFRolloutEngine.max_turns must be >= 1, got 0",
        "HFRolloutEngine.temperature must be > 0 (use greedy=True), got 0.0",
        "HFRolloutEngine.top_p must be a finite number, got nan",
    ]
    with pytest.raises(ValueError, match=r"^DenseRetriever option 'batch_size' must be >= 1, got 0; "
                                         r"DenseRetriever option 'max_passage_length' must be >= 1, got -1$"):
        DenseRetriever(corpus="world", batch_size=0, max_passage_length=-1)  # refused before any weights load
    with pytest.raises(ValueError, match=r"^WarmStart.noise must be in \[0, 1\], got 1.5$"):
        WarmStart(noise=1.5)
