"""Miss analysis on hand-built trajectories, and MissReport's logged rates on hand-built batches."""

import types
from dataclasses import replace

import pytest
import torch

from bridge_pl.miss_analysis import (
    MissCounts,
    Verdict,
    batch_verdicts,
    check_gold_passages,
    classify,
    hop_recall,
    retriever_hop_recall,
    trajectory_searches,
)
from bridge_pl.records import Passage, QAExample
from bridge_pl.rollout.batch import RolloutBatch
from callbacks.miss_report import CreditReport, MissReport

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
    assert classify("Lyon", ["france"], [lyon, paris]).reasoning_miss  # "It is PARIS, France": SQuAD-normalised
    parisian = Passage("p9", "Food", "Parisian food is rich.")
    assert classify("Lyon", ["Paris"], [parisian]).retrieval_miss  # whole words only (rewards.contains_answer)
    assert classify("Lyon", ["The"], [paris]).retrieval_miss  # a gold that normalises to "" never matches
    assert hop_recall(["a", "c"], [["a"], ["b"], ["c", "d"]]) == pytest.approx(2 / 3)


def test_retriever_hop_recall_pools_the_hops_of_every_question():
    """The query encoder's own recall@k: every hop query of the world's questions, scored against its gold passage
    by ``hop_recall`` of its top k ids, the mean over all hops (not per question)."""
    examples = [
        QAExample("single", "Capital of France?", ["Paris"],
                  {"type": "single", "gold_passages": [["p0"]], "hop_queries": ["capital of france"]}),
        QAExample("bridge", "Country of Germany's capital?", ["Germany"],
                  {"type": "bridge", "gold_passages": [["p3"], ["p1"]], "hop_queries": ["berlin", "lyon country"]}),
    ]
    # -1: padding, no passage (not PASSAGES[-1], which is p3, the gold of "berlin")
    top = {"capital of france": [0, 3], "berlin": [1, -1], "lyon country": [2, 1]}
    retriever = types.SimpleNamespace(
        search=lambda queries, k: (torch.zeros(len(queries), k), torch.tensor([top[q][:k] for q in queries])),
        passage=PASSAGES.__getitem__,
    )
    # single: p0 in top 2; bridge hop 1 ("berlin" -> p3): missed; bridge hop 2 ("lyon country" -> p1): found
    assert retriever_hop_recall(retriever, examples, 2) == pytest.approx(2 / 3)
    assert retriever_hop_recall(retriever, examples, 1) == pytest.approx(1 / 3)  # p1 is second for "lyon country"


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
    counts = MissCounts.of(verdicts)
    assert counts == MissCounts(trajectories=4, failed=3, retrieval_misses=2, reasoning_misses=1,
                                  judged_by_gold_ids=1, recall_sum=1.5, with_gold_ids=2)
    assert counts.rates() == pytest.approx({"failure_rate": 0.75, "retrieval_miss_rate": 2 / 3,
                                            "reasoning_miss_rate": 1 / 3, "gold_id_share": 1 / 3, "recall@k": 0.75})
    assert MissCounts.from_tensor(counts.to_tensor()) == counts
    assert counts + counts == MissCounts.of(verdicts * 2)
    assert MissCounts.of([Verdict(False, False, "answer_string", None)]).rates() == {"failure_rate": 0.0}


def test_a_multiple_choice_trajectory_is_scored_by_the_letter_its_reward_read():
    """``RolloutBatch.choices`` decides failure (the answer text is not read again); the string looked for in the
    shown passages is the gold option's text."""
    options = {"A": "Lyon", "B": "Paris"}
    batch = rollout_batch(answers=["The answer is B", "The answer is B"], golds=[["B"], ["B"]],
                          searches=[(0, "capital", [0, 2]), (1, "capital", [2, 1])],
                          metadata=[{"options": options}, {"options": options}])
    verdicts = batch_verdicts(replace(batch, choices=["B", None]), PASSAGES.__getitem__)
    assert [(v.failed, v.retrieved, v.method) for v in verdicts] == [
        (False, True, "answer_string"), (True, False, "answer_string"),  # "Paris" shown to 0, not to 1
    ]


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
    """The parts of BridgeModule that MissReport reads, recording what it logs."""

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
    report = MissReport()
    report.on_train_batch_end(_trainer(), module, None, hand_batch(), 0)
    assert module.logged == pytest.approx({
        "miss/failure_rate": 3 / 4, "miss/retrieval_miss_rate": 2 / 3, "miss/reasoning_miss_rate": 1 / 3,
        "miss/gold_id_share": 2 / 3, "miss/recall@k": 2 / 3,
    })

    batches = {"val/dev": [hand_batch("dev"), hand_batch("dev")], "val/other": []}
    module = _Module(batches)
    datamodule = types.SimpleNamespace(val_sources={"dev": "world/dev", "other": "x.jsonl"})
    report.on_validation_epoch_end(_trainer(datamodule=datamodule), module)
    assert module.logged["val/dev/miss/retrieval_miss_rate"] == pytest.approx(2 / 3)
    assert not any(k.startswith("val/other") for k in module.logged)  # no data: nothing to report
    assert report.methods == {"val/dev": "mixed"} and report.last["val/dev"].trajectories == 8


def test_report_rejects_non_rollout_batches():
    with pytest.raises(TypeError, match="MissReport needs RolloutBatch"):
        MissReport().on_train_batch_end(_trainer(), _Module(), None, torch.zeros(2), 0)


def test_the_former_name_still_loads_and_logs_the_new_names():
    """``callbacks.CreditReport`` in an older config: a warning naming ``MissReport``, and the ``miss/`` names."""
    import callbacks

    with pytest.warns(FutureWarning, match="callbacks.MissReport"):
        report = callbacks.CreditReport()
    assert isinstance(report, MissReport) and callbacks.CreditReport is CreditReport
    module = _Module()
    report.on_train_batch_end(_trainer(), module, None, hand_batch(), 0)
    assert module.logged["miss/failure_rate"] == pytest.approx(3 / 4)
