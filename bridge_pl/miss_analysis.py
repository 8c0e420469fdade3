"""Miss analysis of failed trajectories: was the gold evidence never retrieved, or retrieved and misused?

Failure attribution, not LM credit (the policy's log-likelihood of the gold answer per candidate passage,
:mod:`bridge_pl.retrieval.credit`). Definitions (used by ``callbacks.miss_report.MissReport``):

- A trajectory **failed** when its extracted answer has exact match 0 against the gold answers (the
  outcome the policy is rewarded for, independent of any format shaping of the reward); on a multiple-choice
  question, when the option letter its reward read (``RolloutBatch.choices``) is not the gold letter, as in
  :func:`bridge_pl.metrics.trajectory_scores`.
- **Evidence retrieved**, judged by one of two methods:

  * ``gold_passages`` (when the example's ``metadata["gold_passages"]`` is a non-empty list per hop of
    alternative gold passage ids): every hop has at least one of its gold passages among the passages
    shown by the trajectory's searches (any search, any position);
  * ``answer_string`` (otherwise): some gold answer (on a multiple-choice question, the gold option's text)
    occurs as whole words in some shown passage's title + text (:func:`bridge_pl.rewards.contains_answer`).

- A failed trajectory is a **retrieval miss** if the evidence was not retrieved, else a **reasoning miss**.
- **recall@k** of one trajectory with gold passage ids: the share of its hops with a gold passage among the
  shown passages (k per search = ``model.retrieval.top_k``), over all its searches; a trajectory that never searched
  has recall 0. (:func:`retriever_hop_recall` is the query encoder's own recall@k on the world's hop queries.)

Rates over a set of trajectories (see :meth:`MissCounts.rates`):
``retrieval_miss_rate`` = retrieval misses / failed, ``reasoning_miss_rate`` = reasoning misses / failed
(the two sum to 1), ``failure_rate`` = failed / trajectories, ``recall@k`` = mean recall over trajectories
with gold passage ids, ``gold_id_share`` = failed trajectories judged by gold ids / failed (which method).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from bridge_pl.data.world import hop_probes
from bridge_pl.metrics import trajectory_scores
from bridge_pl.records import Passage, QAExample
from bridge_pl.rewards import contains_answer
from bridge_pl.rollout.batch import RolloutBatch

if TYPE_CHECKING:
    from bridge_pl.retrieval.base import Retriever

GoldPassages = Sequence[Sequence[str]]  # per hop, the alternative gold passage ids


@dataclass(frozen=True)
class SearchRecord:
    """One search call of a trajectory: the query and the passages shown for it, in order."""

    query: str
    passages: list[Passage]


@dataclass(frozen=True)
class Verdict:
    """The miss analysis of one trajectory.

    ``retrieved``: the gold evidence was shown by some search (judged by ``method``);
    ``recall``: share of hops retrieved, ``None`` without gold passage ids.
    """

    failed: bool
    retrieved: bool
    method: str  # "gold_passages" | "answer_string"
    recall: float | None

    @property
    def retrieval_miss(self) -> bool:
        return self.failed and not self.retrieved

    @property
    def reasoning_miss(self) -> bool:
        return self.failed and self.retrieved


def check_gold_passages(value: Any, where: str) -> list[list[str]] | None:
    """``metadata["gold_passages"]`` as a list of hops of ids, ``None`` when absent or empty.

    Raises ``ValueError`` naming ``where`` (e.g. the example id) for anything but a list of lists of strings.
    """
    if value is None or (isinstance(value, list | tuple) and len(value) == 0):
        return None
    ok = isinstance(value, list | tuple) and all(
        isinstance(hop, list | tuple) and all(isinstance(i, str) for i in hop) for hop in value
    )
    if not ok:
        raise ValueError(
            f"{where}: metadata['gold_passages'] must be a list (one entry per hop) of lists of passage id "
            f"strings, got {value!r}"
        )
    hops = [list(hop) for hop in value if hop]
    return hops or None


def hop_recall(shown_ids: Iterable[str], gold_passages: GoldPassages) -> float:
    """Share of hops (non-empty lists of alternative ids) with at least one id in ``shown_ids``."""
    shown = set(shown_ids)
    return sum(any(i in shown for i in hop) for hop in gold_passages) / len(gold_passages)


def retriever_hop_recall(retriever: Retriever, examples: Sequence[QAExample], k: int) -> float:
    """Recall@k of ``retriever``, with its current query encoder, on the gold passage of every hop of the world's
    ``examples``: each ``(query, gold id)`` pair of :func:`~bridge_pl.data.world.hop_probes` (the hop queries stored
    with the questions, not the policy's) scores :func:`hop_recall` of its top ``k`` ids (1 or 0); the mean is over
    all pairs of all examples. Padding rows (< 0) are no passage."""
    pairs = [pair for probe in hop_probes(list(examples)).values() for pair in probe]
    _, rows = retriever.search([query for query, _ in pairs], k)
    return statistics.mean(hop_recall((retriever.passage(r).id for r in top if r >= 0), [[gold]])
                           for (_, gold), top in zip(pairs, rows.tolist()))


def classify(
    answer: str | None,
    golds: Sequence[str],
    shown: Sequence[Passage],
    gold_passages: GoldPassages | None = None,
    options: dict[str, str] | None = None,
    choice: str | None = None,
) -> Verdict:
    """Classify one trajectory given its answer, the passages its searches showed, and its gold evidence.

    ``gold_passages`` (per hop, alternative ids) selects the ``gold_passages`` method; ``None`` or empty
    selects ``answer_string`` (a gold answer occurs as whole words in a shown passage's title or text). A
    multiple-choice question (``options``; ``golds`` is the gold letter) is scored by ``choice``, the letter the
    trajectory's reward read (``RolloutBatch.choices``; None: no option named), never by reading ``answer`` again,
    and the string looked for is the gold option's text.
    """
    failed = trajectory_scores(answer, golds, options, choice)["em"] == 0.0
    if gold_passages:
        recall = hop_recall((p.id for p in shown), gold_passages)
        return Verdict(failed=failed, retrieved=recall == 1.0, method="gold_passages", recall=recall)
    wanted = [options[golds[0]]] if options else golds
    retrieved = any(contains_answer(f"{p.title} {p.text}", wanted) for p in shown)
    return Verdict(failed=failed, retrieved=retrieved, method="answer_string", recall=None)


@dataclass
class MissCounts:
    """Additive tallies of verdicts; sum them across batches and processes, then take :meth:`rates`."""

    trajectories: float = 0.0
    failed: float = 0.0
    retrieval_misses: float = 0.0
    reasoning_misses: float = 0.0
    judged_by_gold_ids: float = 0.0  # failed trajectories judged with gold passage ids
    recall_sum: float = 0.0
    with_gold_ids: float = 0.0  # trajectories (failed or not) that have gold passage ids

    @classmethod
    def of(cls, verdicts: Iterable[Verdict]) -> MissCounts:
        counts = cls()
        for v in verdicts:
            counts.trajectories += 1
            counts.failed += v.failed
            counts.retrieval_misses += v.retrieval_miss
            counts.reasoning_misses += v.reasoning_miss
            counts.judged_by_gold_ids += v.failed and v.method == "gold_passages"
            if v.recall is not None:
                counts.recall_sum += v.recall
                counts.with_gold_ids += 1
        return counts

    def __add__(self, other: MissCounts) -> MissCounts:
        return MissCounts(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[7]`` float64 tensor of the tallies, in field order (for a sum all-reduce)."""
        return torch.tensor(astuple(self), dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> MissCounts:
        values = tensor.tolist()
        if len(values) != len(fields(cls)):
            raise ValueError(f"MissCounts.from_tensor: expected {len(fields(cls))} values, got {len(values)}")
        return cls(*values)

    def rates(self) -> dict[str, float]:
        """The rates of the module docstring; a rate whose denominator is 0 is left out (undefined)."""
        out = {}
        if self.trajectories:
            out["failure_rate"] = self.failed / self.trajectories
        if self.failed:
            out["retrieval_miss_rate"] = self.retrieval_misses / self.failed
            out["reasoning_miss_rate"] = self.reasoning_misses / self.failed
            out["gold_id_share"] = self.judged_by_gold_ids / self.failed
        if self.with_gold_ids:
            out["recall@k"] = self.recall_sum / self.with_gold_ids
        return out


def trajectory_searches(batch: RolloutBatch, passage: Callable[[int], Passage]) -> list[list[SearchRecord]]:
    """Per trajectory of ``batch``, its search calls in order, with the passages shown (``passage(row)``)."""
    out: list[list[SearchRecord]] = [[] for _ in range(batch.batch_size)]
    for s, b in enumerate(batch.search_traj.tolist()):
        out[b].append(SearchRecord(batch.search_queries[s], [passage(r) for r in batch.shown_rows(s)]))
    return out


def batch_verdicts(batch: RolloutBatch, passage: Callable[[int], Passage]) -> list[Verdict]:
    """:func:`classify` every trajectory of ``batch``; ``passage(row)`` looks up the retriever's passages."""
    verdicts = []
    for b, searches in enumerate(trajectory_searches(batch, passage)):
        where = f"example {batch.example_ids[b]!r} of dataset {batch.dataset!r}"
        gold_ids = check_gold_passages(batch.metadata[b].get("gold_passages"), where)
        shown = [p for search in searches for p in search.passages]
        verdicts.append(classify(batch.answers[b], batch.golds[b], shown, gold_ids, batch.metadata[b].get("options"),
                                 batch.choices[b]))
    return verdicts
