"""Distributed-safe QA metrics for search-agent rollouts.

One ``QAMetrics`` instance accumulates, over all the questions it is shown, the answer scores of
``bridge_pl.rewards`` and the rollout's behaviour counts, as summed scalar states that torchmetrics
all-reduces (sum) across processes when ``compute()`` runs. Every process must call ``compute()``
(it is a collective), including a process that saw no data.

Why one Metric returning a dict: the six numbers come from the same rollouts in one ``update`` call and
share the question count, so one object per dataset keeps them consistent. Lightning cannot log a
dict-valued Metric object directly, so log the computed values and reset yourself::

    self.val_metrics = torch.nn.ModuleDict({name: QAMetrics() for name in dataset_names})
    # validation_step:
    self.val_metrics[name].update(predictions, golds, turns, searches, valid_actions, actions)
    # on_validation_epoch_end:
    for name, metric in self.val_metrics.items():
        self.log_dict({f"val/{name}/{key}": value for key, value in metric.compute().items()})
        metric.reset()

The values are already synchronised, so ``sync_dist`` is not needed.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchmetrics import Metric

from bridge_pl.rewards import answer_scores, choice_scores

if TYPE_CHECKING:
    from bridge_pl.rollout.batch import RolloutBatch

_STATES = ("em", "f1", "sub_em", "turns", "searches", "questions", "valid_actions", "actions", "correct_choices",
           "choice_questions")


class QAMetrics(Metric):
    """Question-answering and agent-behaviour averages over a set of rollouts.

    ``compute()`` returns float32 scalars:

    - ``em``, ``f1``, ``sub_em``: mean over questions of the best score against the question's golds
      (a ``None`` prediction, i.e. no answer, scores 0); on a multiple-choice question all three are 1 when the
      letter its reward read is the gold letter and 0 otherwise (:func:`trajectory_scores`);
    - ``accuracy``: share of the multiple-choice questions answered with the gold option; present only when
      the set has multiple-choice questions;
    - ``turns``: mean generation turns per question;
    - ``searches``: mean search calls per question;
    - ``valid_action_rate``: total valid actions / total actions, pooled over all questions (not a mean
      of per-question rates), in [0, 1].

    With no data every value is 0 (not NaN), and ``compute()`` before ``update()`` does not warn.
    Sums are kept in float64 so the result does not depend on how questions are split across processes;
    they follow the module's device but never its dtype (a bf16-cast LightningModule keeps them float64).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    em: Tensor
    f1: Tensor
    sub_em: Tensor
    turns: Tensor
    searches: Tensor
    questions: Tensor
    valid_actions: Tensor
    actions: Tensor
    correct_choices: Tensor
    choice_questions: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in _STATES:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        predictions: Sequence[str | None],
        golds: Sequence[Sequence[str]],
        turns: Sequence[int] | Tensor,
        searches: Sequence[int] | Tensor,
        valid_actions: Sequence[int] | Tensor,
        actions: Sequence[int] | Tensor,
        options: Sequence[dict[str, str] | None] | None = None,
        choices: Sequence[str | None] | None = None,
    ) -> None:
        """Add one batch of ``n`` questions; every argument has ``n`` entries (counts: ints or shape (n,)).

        ``options``: per question, its ``{letter: text}`` options if it is multiple choice (its gold is the
        letter), else None; None for the whole argument means no question is multiple choice. ``choices``: per
        question, the option letter its answer was read as (``bridge_pl.rewards.choice_letter``, as the reward read
        it; None: no option named); needed when some question is multiple choice, ignored for free-text ones.
        """
        n = len(predictions)
        options = [None] * n if options is None else options
        if choices is None and any(options):
            raise ValueError("QAMetrics.update: multiple-choice questions need choices, the letters their answers "
                             "were read as")
        choices = [None] * n if choices is None else choices
        counts = {"turns": turns, "searches": searches, "valid_actions": valid_actions, "actions": actions}
        for field, values in {"golds": golds, "options": options, "choices": choices, **counts}.items():
            if len(values) != n:
                raise ValueError(f"QAMetrics.update: {field} has {len(values)} entries, predictions has {n}")
        tensors = {k: torch.as_tensor(v, dtype=torch.float64).reshape(n) for k, v in counts.items()}
        for field, values in tensors.items():
            if (values < 0).any():
                raise ValueError(f"QAMetrics.update: {field} must be non-negative, got {values.tolist()}")
        if (tensors["valid_actions"] > tensors["actions"]).any():
            raise ValueError(
                "QAMetrics.update: valid_actions exceeds actions for some question: "
                f"{tensors['valid_actions'].tolist()} vs {tensors['actions'].tolist()}"
            )

        scores = [trajectory_scores(p, g, o, c) for p, g, o, c in zip(predictions, golds, options, choices)]
        for name in ("em", "f1", "sub_em"):
            setattr(self, name, getattr(self, name) + sum(score[name] for score in scores))
        correct = [score["em"] for score, o in zip(scores, options) if o]
        self.correct_choices += sum(correct)
        self.choice_questions += len(correct)
        for field, values in tensors.items():
            setattr(self, field, getattr(self, field) + values.sum().item())
        self.questions += n

    def update_from_rollouts(self, batch: RolloutBatch) -> None:
        """Add one evaluation ``RolloutBatch``: its answers, golds, turn and search counts, actions, the options of
        its multiple-choice questions (``metadata["options"]``) and the letters their rewards read (``choices``)."""
        self.update(
            batch.answers, batch.golds, batch.turns.tolist(), batch.num_searches.tolist(),
            batch.valid_actions.tolist(), (batch.valid_actions + batch.invalid_actions).tolist(),
            [m.get("options") for m in batch.metadata], batch.choices,
        )

    def compute(self) -> dict[str, Tensor]:
        """``{em, f1, sub_em, turns, searches, valid_action_rate}`` and, with multiple-choice questions,
        ``accuracy``; synchronised across processes."""
        # Numerators are 0 whenever their denominator is, so clamping the denominator maps "no data" to 0.
        questions = self.questions.clamp(min=1)
        means = ("em", "f1", "sub_em", "turns", "searches")
        values = {name: getattr(self, name) / questions for name in means}
        values["valid_action_rate"] = valid_action_rate(self.valid_actions, self.actions)
        if self.choice_questions > 0:
            values["accuracy"] = self.correct_choices / self.choice_questions
        return {name: value.to(torch.float32) for name, value in values.items()}

    def _wrap_compute(self, compute: Callable) -> Callable:
        # torchmetrics warns when compute() precedes update(); for this metric that is well defined (zeros),
        # and it happens every epoch for a dataset or rank that got no batch, so silence that one warning.
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def quiet_compute(*args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The ``compute`` method of metric", UserWarning)
                return wrapped(*args, **kwargs)

        return quiet_compute

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ()) -> Metric:
        # The states follow the module's device but never its dtype: Lightning's "bf16-true"/"16-true"
        # precision casts the whole LightningModule with .to(dtype), which would turn the sums into bf16.
        this = super()._apply(fn, exclude_state=(*exclude_state, *_STATES))
        for name in _STATES:
            this._defaults[name] = this._defaults[name].to(this.device)
            setattr(this, name, getattr(this, name).to(this.device))
        return this


def trajectory_scores(answer: str | None, golds: Sequence[str], options: dict[str, str] | None, choice: str | None
                      ) -> dict[str, float]:
    """``{em, f1, sub_em}`` of one trajectory: on a multiple-choice question (``options``) from ``choice``, the letter
    its reward read (never from ``answer`` again, so the score is the reward's); else from the free-text ``answer``."""
    return choice_scores(choice, golds) if options else answer_scores(answer, golds)


def valid_action_rate(valid_actions: Tensor, actions: Tensor) -> Tensor:
    """Share of well-formed actions (a search or an answer), pooled: ``sum(valid_actions) / sum(actions)``.

    Both are counts of the same shape (any; e.g. ``[B]`` per trajectory); the result is a float scalar in
    [0, 1], 0 when there are no actions.
    """
    return valid_actions.sum() / actions.sum().clamp(min=1)


def set_means(per_set: dict[str, dict[str, float]], stage: str) -> dict[str, float]:
    """The unweighted means over evaluation sets that the module logs next to each set's own values.

    ``per_set`` maps ``"<stage>/<set>"`` to that set's ``{metric: value}``. Returned: ``<stage>/<metric>``, the
    mean over the sets that have the metric (``accuracy`` only over multiple-choice sets), and for sets named
    ``<group>/<member>`` (the MIRAGE subsets ``mirage/medqa``, ...) ``<stage>/<group>/<metric>``, the macro
    average over the group's members: the number the MIRAGE benchmark reports.
    """
    groups: dict[str, dict[str, list[float]]] = {}
    for key, values in per_set.items():
        name = key.removeprefix(f"{stage}/")
        owners = [stage] + ([f"{stage}/{name.rpartition('/')[0]}"] if "/" in name else [])
        for owner in owners:
            for metric, value in values.items():
                groups.setdefault(owner, {}).setdefault(metric, []).append(value)
    return {f"{owner}/{metric}": sum(vs) / len(vs) for owner, ms in groups.items() for metric, vs in ms.items()}


class StepLogKeys:
    """Every key the training steps have logged so far, to log nan for those a step leaves out.

    Lightning keeps a step-level logged value until the epoch ends and sends it to the logger again at every later
    step that does not log the key: an iteration that skips its θ step (no reward variance) would show the previous
    iteration's ``loss/policy`` and ``grad_norm/policy`` in TensorBoard. nan marks the gap instead. (A resumed run
    starts with an empty set and a fresh Lightning record, so a key its first steps leave out is simply absent.)
    """

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def fill(self, logs: dict[str, float]) -> dict[str, float]:
        """``logs`` plus nan for every key logged at an earlier step and missing from it."""
        self.seen.update(logs)
        return {**dict.fromkeys(sorted(self.seen - logs.keys()), float("nan")), **logs}
