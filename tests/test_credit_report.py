"""Credit analysis on hand-built trajectories, and CreditReport's logged rates on hand-built batches."""

import types

import pytest
import torch

from bridge_pl.credit_analysis import (
    CreditCounts,
    Verdict,
    answer_in_texts,
    batch_verdicts,
    check_gold_passages,
    classify,
    hop_recall,
    trajectory_searches,
)
from bridge_pl.data.qa import Passage
from bridge_pl.rollout.batch import RolloutBatch
from callbacks.credit_report import CreditReport

PASSAGES = [
    Passage("p0", "Paris", "Paris is the capital of France."),
    Passage("p1", "France", "France is a country in Europe."),
    Passage("p2", "Lyon", "Lyon lies on the Rhone."),
    Passage("p3", "Berlin", "Berlin is the capital of Germany."),
]


def rollout_batch(answers, golds, searches, metadata=None, rewards=None, dataset="train") -> RolloutBatch:
    """A RolloutBatch with only the fields the callbacks read.

    ``searches``: (trajectory, query, shown rows), the same number of shown rows for every search.
    """
    B = len(answers)
    k = max((len(rows) for _, _, rows in searches), default=0)
    candidates = torch.full((len(searches), k + 1), -1, dtype=torch.long)
    order = torch.zeros(len(searches), k, dtype=torch.long)
    for s, (_, _, rows) in enumerate(searches):
        # candidates hold the shown rows in reverse, behind one unshown row, so that order must be followed
        unshown = next(r for r in range(len(PASSAGES)) if r not in rows)
        candidates[s] = torch.tensor([unshown, *reversed(rows)])
        order[s] = torch.arange(k, 0, -1)
    return RolloutBatch(
        input_ids=torch.zeros(B, 1, dtype=torch.long), attention_mask=torch.ones(B, 1, dtype=torch.long),
        action_mask=torch.ones(B, 1),
        rewards=torch.tensor(rewards if rewards is not None else [0.0] * B),
        group_ids=torch.arange(B), turns=torch.ones(B, dtype=torch.long),
        valid_actions=torch.ones(B, dtype=torch.long), invalid_actions=torch.zeros(B, dtype=torch.long),
        search_traj=torch.tensor([b for b, _, _ in searches], dtype=torch.long),
        search_candidates=candidates, search_order=order, search_logprob=torch.zeros(len(searches)),
        search_queries=[q for _, q, _ in searches], responses=[f"<answer> {a} </answer>" for a in answers],
        answers=answers, golds=golds, questions=[f"q{b}?" for b in range(B)], example_ids=[f"e{b}" for b in range(B)],
        metadata=metadata if metadata is not None else [{} for _ in range(B)], policy_version=0, retriever_version=0,
        dataset=dataset,
    )


def test_classify_by_gold_passage_ids():
    two_hops = [["p1"], ["p0", "p2"]]  # hop 2 has two alternative passages
    paris, france, lyon = PASSAGES[0], PASSAGES[1], PASSAGES[2]
    assert classify("Paris", ["Paris"], [paris], two_hops) == Verdict(False, False, "gold_passages", 0.5)
    assert classify("Lyon", ["Paris"], [france, lyon], two_hops) == Verdict(True, True, "gold_passages", 1.0)
    miss = classify(None, ["Paris"], [france, PASSAGES[3]], two_hops)
    assert miss.retrieval_miss and not miss.reasoning_miss and miss.recall == 0.5
    # the gold answer occurring in the text does not count when gold ids are known
    assert classify("x", ["Paris"], [paris], [["p3"]]).retrieval_miss


def test_classify_by_answer_string():
    paris, lyon = PASSAGES[0], PASSAGES[2]
    v = classify("Lyon", ["the Paris"], [lyon, paris])
    assert v == Verdict(True, True, "answer_string", None) and v.reasoning_miss
    assert classify("Lyon", ["Paris"], [lyon]).retrieval_miss
    assert classify("Lyon", ["Paris"], []).retrieval_miss  # never searched
    assert not classify("Lyon", ["Lyon"], []).failed
    assert answer_in_texts(["It is PARIS, France"], ["paris"])
    assert not answer_in_texts(["Parisian food"], ["Paris"])  # whole tokens only
    assert not answer_in_texts(["the"], ["The"])  # a gold that normalises to "" never matches
    assert hop_recall(["a", "c"], [["a"], ["b"], ["c", "d"]]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("value", ["p1", [["p1", 3]], [["p1"], "p2"]])
def test_bad_gold_passages_are_named(value):
    with pytest.raises(ValueError, match="example 'e7'.*gold_passages"):
        check_gold_passages(value, "example 'e7'")


def test_empty_gold_passages_fall_back_to_answer_string():
    assert check_gold_passages([], "x") is None and check_gold_passages([[], []], "x") is None
    assert check_gold_passages(None, "x") is None


def test_counts_and_rates():
    verdicts = [
        Verdict(False, True, "gold_passages", 1.0),
        Verdict(True, False, "gold_passages", 0.5),
        Verdict(True, True, "answer_string", None),
        Verdict(True, False, "answer_string", None),
    ]
    counts = CreditCounts.of(verdicts)
    assert counts == CreditCounts(trajectories=4, failed=3, retrieval_misses=2, reasoning_misses=1,
                                  judged_by_gold_ids=1, recall_sum=1.5, with_gold_ids=2)
    assert counts.rates() == pytest.approx({"failure_rate": 0.75, "retrieval_miss_rate": 2 / 3,
                                            "reasoning_miss_rate": 1 / 3, "gold_id_share": 1 / 3, "recall@k": 0.75})
    assert CreditCounts.from_tensor(counts.to_tensor()) == counts
    assert counts + counts == CreditCounts.of(verdicts * 2)
    assert CreditCounts.of([Verdict(False, False, "answer_string", None)]).rates() == {"failure_rate": 0.0}


def hand_batch(dataset="train") -> RolloutBatch:
    """Four trajectories (shown passages come from search_order), hand-labelled:

    0: correct, recall 1.  1: wrong, both hops shown -> reasoning miss, recall 1.
    2: wrong, "Berlin" not shown -> retrieval miss (answer string).  3: no search -> retrieval miss, recall 0.
    """
    return rollout_batch(
        answers=["Paris", "Lyon", "Rome", None],
        golds=[["Paris"], ["Paris"], ["Berlin"], ["Paris"]],
        searches=[
            (0, "capital of france", [0, 3]), (1, "france", [1, 0]), (2, "germany", [2, 1]), (1, "again", [2, 1]),
        ],
        metadata=[{"gold_passages": [["p0"]]}, {"gold_passages": [["p1"], ["p0"]]}, {}, {"gold_passages": [["p0"]]}],
        dataset=dataset,
    )


def test_batch_verdicts_follow_the_shown_order():
    batch = hand_batch()
    searches = trajectory_searches(batch, PASSAGES.__getitem__)
    assert [[(s.query, [p.id for p in s.passages]) for s in t] for t in searches] == [
        [("capital of france", ["p0", "p3"])], [("france", ["p1", "p0"]), ("again", ["p2", "p1"])],
        [("germany", ["p2", "p1"])], [],
    ]
    verdicts = batch_verdicts(batch, PASSAGES.__getitem__)
    assert [(v.failed, v.retrieved, v.method, v.recall) for v in verdicts] == [
        (False, True, "gold_passages", 1.0), (True, True, "gold_passages", 1.0),
        (True, False, "answer_string", None), (True, False, "gold_passages", 0.0),
    ]


class _Module:
    """The parts of BridgeModule that CreditReport reads, recording what it logs."""

    def __init__(self, last_eval_batches=None) -> None:
        self.retriever = types.SimpleNamespace(passage=PASSAGES.__getitem__)
        self.device = torch.device("cpu")
        self.last_eval_batches = last_eval_batches or {}
        self.logged = {}

    def log(self, name, value, **kwargs):
        self.logged[name] = value


def _trainer(**kwargs):
    strategy = types.SimpleNamespace(reduce=lambda tensor, reduce_op: tensor)
    return types.SimpleNamespace(strategy=strategy, sanity_checking=False, **kwargs)


def test_report_logs_the_hand_counted_rates():
    module = _Module()
    report = CreditReport()
    report.on_train_batch_end(_trainer(), module, None, hand_batch(), 0)
    assert module.logged == pytest.approx({
        "credit/failure_rate": 3 / 4, "credit/retrieval_miss_rate": 2 / 3, "credit/reasoning_miss_rate": 1 / 3,
        "credit/gold_id_share": 2 / 3, "credit/recall@k": 2 / 3,
    })

    batches = {"val/dev": [hand_batch("dev"), hand_batch("dev")], "val/other": []}
    module = _Module(batches)
    datamodule = types.SimpleNamespace(val_sources={"dev": "world/dev", "other": "x.jsonl"})
    report.on_validation_epoch_end(_trainer(datamodule=datamodule), module)
    assert module.logged["val/dev/credit/retrieval_miss_rate"] == pytest.approx(2 / 3)
    assert not any(k.startswith("val/other") for k in module.logged)  # no data: nothing to report
    assert report.methods == {"val/dev": "mixed"} and report.last["val/dev"].trajectories == 8


def test_report_rejects_non_rollout_batches():
    with pytest.raises(TypeError, match="CreditReport needs RolloutBatch"):
        CreditReport().on_train_batch_end(_trainer(), _Module(), None, torch.zeros(2), 0)
