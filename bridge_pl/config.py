"""The typed settings groups of ``BridgeModule`` (``model.rl``, ``model.solver``, ``model.retrieval``), and the one
way every setting's range is checked.

Each group is a frozen dataclass: LightningCLI shows it as one section of ``bridge-pl fit --help`` with every
field's type, default and description (from the ``Args:`` below), and rejects unknown keys and values outside
a ``Literal``. Ranges and cross-field rules are checked in ``__post_init__``; :func:`group_problems` runs the same
checks on a parsed config before any model loads. Every message names the option (``model.rl.clip_low``).

The range checks of the whole library are :class:`Rule` tables (option -> test and what the value must be) turned
into messages by :func:`rule_problems` and raised together by :func:`raise_problems`: these groups, the
datamodule's (``data.*``, ``data.vllm.*``), the rollout engines', ``DenseRetriever``'s, ``WarmStart``'s and the CLI's
finiteness and learning-rate checks.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, NamedTuple, get_args


class Rule(NamedTuple):
    """A range check on one option: its value passes when ``ok(value)`` holds; ``requirement`` completes "must be
    ..." in the message when it does not (:func:`rule_problems`)."""

    ok: Callable[[Any], bool]
    requirement: str

    def worded(self, requirement: str) -> Rule:
        """The same test, described as ``requirement`` (a unit, what null means, a hint)."""
        return Rule(self.ok, requirement)


AT_LEAST_ONE = Rule(lambda v: v >= 1, "an integer >= 1")
POSITIVE = Rule(lambda v: v > 0, "> 0")
NON_NEGATIVE = Rule(lambda v: v >= 0, ">= 0")
UNIT_INTERVAL = Rule(lambda v: 0 <= v <= 1, "in [0, 1]")
OPEN_UNIT_INTERVAL = Rule(lambda v: 0 < v < 1, "in (0, 1)")
OPEN_CLOSED_UNIT_INTERVAL = Rule(lambda v: 0 < v <= 1, "in (0, 1]")
FINITE = Rule(math.isfinite, "a finite number")
LEARNING_RATE = POSITIVE.worded("> 0 (a learning rate)")


def one_of(choices: Any) -> Rule:
    """The rule that a value is one of the ``Literal`` ``choices``."""
    allowed = get_args(choices)
    return Rule(lambda v: v in allowed, f"one of {list(allowed)}")


def _problem(option: str, requirement: str, value: Any) -> str:
    return f"{option} must be {requirement}, got {value!r}"


def rule_problems(prefix: str | Callable[[str], str], values: Mapping[str, Any], rules: Mapping[str, Rule],
                  ) -> list[str]:
    """The messages "<option> must be <requirement>, got <value>" for the ``values`` (option key -> value) that
    break their ``rules`` (option key -> :class:`Rule`), in the order of ``rules``; empty when all pass.

    A value that is None (an unset optional option) or absent is skipped. A number that is not finite (nan, ±inf)
    is reported as such ("must be a finite number"), whatever its rule. ``prefix`` names the options: a string
    is put before the key with a dot (``"model.rl"`` -> ``model.rl.clip_low``; ``""``: the key is the whole name),
    a function maps the key to the name (``DenseRetriever option 'batch_size'``).
    """
    name = prefix if callable(prefix) else (lambda key: f"{prefix}.{key}" if prefix else key)
    found = []
    for key, (ok, requirement) in rules.items():
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, numbers.Real) and not math.isfinite(value):
            found.append(_problem(name(key), FINITE.requirement, value))
        elif not ok(value):
            found.append(_problem(name(key), requirement, value))
    return found


def raise_problems(problems: Iterable[str]) -> None:
    """Raise one ValueError holding every message of ``problems``, joined by "; "; nothing when there are none."""
    problems = list(problems)
    if problems:
        raise ValueError("; ".join(problems))


def require_choice(option: str, value: Any, choices: Any) -> Any:
    """``value`` if it is one of the ``Literal`` ``choices``, else a ValueError naming ``option`` and the choices.

    LightningCLI already refuses other values when it parses; this guards direct Python construction, where a
    typo would otherwise fall through to a default branch.
    """
    rule = one_of(choices)
    if not rule.ok(value):
        raise ValueError(_problem(option, rule.requirement, value))
    return value


Algorithm = Literal["grpo", "ppo"]
KLKind = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass(frozen=True)  # all-dataclass bases: jsonargparse then parses a group as plain fields, not a class_path
class Checked:
    """A frozen settings group checked when built: ``RULES`` maps a field to its :class:`Rule` (:func:`rule_problems`
    under ``PREFIX``: None skips, a non-finite number is refused), ``cross_field_problems`` adds what no single field
    shows; ``__post_init__`` raises them all in one ValueError (:func:`raise_problems`)."""

    PREFIX: ClassVar[str]
    RULES: ClassVar[dict[str, Rule]] = {}

    def problems(self) -> list[str]:
        """What is wrong with these settings, one message per option; empty when they are fine."""
        return rule_problems(self.PREFIX, vars(self), self.RULES) + self.cross_field_problems()

    def cross_field_problems(self) -> list[str]:
        return []

    def __post_init__(self) -> None:
        raise_problems(self.problems())


@dataclass(frozen=True)
class RLConfig(Checked):
    """The RL losses (``model.rl``): surrogate, KL, critic, aggregation, memory budget.

    Args:
        algorithm: ``grpo`` (group-normalised outcome advantages, no critic) or ``ppo`` (value head + GAE).
        clip_low: PPO ratio clip below, the ratio is kept >= 1 - clip_low.
        clip_high: PPO ratio clip above, the ratio is kept <= 1 + clip_high (DAPO's clip-higher: > clip_low).
        dual_clip: dual-clip constant c > 1 bounding the loss of negative-advantage tokens; null: off.
        kl_coef: weight of the KL penalty to the reference policy (the base, adapter off) in the loss; 0 drops
            the term and its reference forward.
        kl_kind: KL estimator per token: ``k1`` (log-ratio), ``k2`` (half squared log-ratio), ``k3`` (low-variance).
        entropy_coef: weight of the entropy bonus (0: off).
        loss_agg: how token losses become one number (bridge_pl.rl.agg_loss): ``token-mean`` over all action
            tokens of the batch, or a mean over sequences of a per-sequence sum / mean / sum over the budget.
        scale_by_std: GRPO divides each group's centred rewards by the group's std (off: Dr. GRPO).
        gamma: PPO discount per token, in [0, 1].
        gae_lambda: PPO GAE λ, in [0, 1].
        value_coef: PPO weight of the value loss.
        value_clip: PPO value clip around the old values (reward units); null: off.
        mask_observations: train only on policy-written tokens; false is the ablation that also trains on the
            retrieved ``<information>`` tokens.
        micro_batch_tokens: rows x padded length of one forward/backward in the policy update and in LM-credit
            scoring (gradient accumulation; the result equals the full-batch loss). Lower it to save memory.
        minibatches: policy optimizer steps per pass over the rollout batch (PPO's mini-batches, verl's
            ``ppo_mini_batch_size`` as a count): the batch's rows, in order, are split into this many contiguous
            parts, each its own loss aggregate and step. π_old stays the policy that sampled the batch, so from
            the second step on the ratio and its clip are live. At most the rows of one GRPO group
            (``data.n_samples``), so that no part is empty.
        tis_cap: truncated importance sampling against the sampler (docs/method.md section 10): each action
            token's loss is weighted by ``min(π_old / π_sampler, tis_cap)``, where π_sampler is the generation
            engine's own log-prob of the token (vLLM's, or the merged bf16 weights') and π_old the trainer's first
            forward; null (default): off, the loss as if the sampler were π_old. verl's default cap is 2.
    """

    PREFIX: ClassVar[str] = "model.rl"
    RULES: ClassVar[dict[str, Rule]] = {
        "clip_low": POSITIVE, "clip_high": POSITIVE, "kl_coef": NON_NEGATIVE, "entropy_coef": NON_NEGATIVE,
        "gamma": UNIT_INTERVAL, "gae_lambda": UNIT_INTERVAL, "value_coef": NON_NEGATIVE,
        "value_clip": POSITIVE, "micro_batch_tokens": AT_LEAST_ONE, "minibatches": AT_LEAST_ONE,
        "dual_clip": Rule(lambda v: v > 1, "> 1 (or null: off)"), "tis_cap": AT_LEAST_ONE.worded(">= 1 (or null: off)"),
    }

    algorithm: Algorithm = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.001
    kl_kind: KLKind = "k3"
    entropy_coef: float = 0.0
    loss_agg: LossAgg = "token-mean"
    scale_by_std: bool = True
    gamma: float = 1.0
    gae_lambda: float = 1.0
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    mask_observations: bool = True
    micro_batch_tokens: int = 4096
    minibatches: int = 1
    tis_cap: float | None = None


def minibatch_problem(minibatches: int | None, n_samples: int | None) -> str | None:
    """The message for ``model.rl.minibatches`` above ``data.n_samples`` (a rollout batch may hold a single GRPO
    group, and every mini-batch needs rows); None when they fit or either is unknown. Checked by the CLI before
    anything is built and by ``BridgeModule.setup`` for runs built in Python (when the fit has a datamodule with
    ``n_samples``), both before the warm start."""
    if minibatches is None or n_samples is None or minibatches <= n_samples:
        return None
    return (f"model.rl.minibatches ({minibatches}) must be <= data.n_samples ({n_samples}): a rollout batch may "
            "hold a single group, and every mini-batch needs rows")


@dataclass(frozen=True)
class SolverConfig(Checked):
    """How many steps each part takes per iteration and the step rules (``model.solver``).

    A setting the chosen ``model.mode`` does not use (λ outside ``bridge``, the Neumann series outside
    ``implicit``, ψ steps outside ``bridge``) must stay at its default: changing it is an error, not a no-op.

    Args:
        phi_steps: inner steps on the query encoder φ per iteration (K_φ; every mode that trains the retriever).
        psi_steps: inner steps on ψ, φ's reference copy, per iteration (K_ψ; ``bridge``).
        policy_epochs: passes of the policy update over the rollout batch.
        lam_init: the penalty λ at the first iteration (``bridge``).
        lam_delta: λ's growth per iteration (``bridge``).
        lam_max: λ's cap (``bridge``); >= lam_init.
        theta_coupling: the scale c of the coupling term c·λ(∇θG(θ,φ) − ∇θG(θ,ψ)) in the θ step (``bridge``);
            >= 0. 1 is the method; 0 is the ablation whose θ steps on F alone (no backward through the LM-credit
            scores, so none of its forward or graph either).
        neumann_steps: terms of the Neumann series for the inverse Hessian-vector product (``implicit``).
        neumann_lr: the Neumann series' step η (``implicit``); needs η < 2 / the top Hessian eigenvalue.
        grad_clip_policy: max global grad norm of the policy (and critic) step; null: no clipping.
        grad_clip_retriever: max global grad norm of each φ / ψ step, after the step's learning-rate scaling
            (φ's 1/(1+λ) in ``bridge``: the clip bounds the step, so φ and ψ move alike); null: no clipping.
        max_nonfinite_skips: an update whose loss or gradient is not finite is skipped (weights, optimizer state
            and λ untouched; warned, logged as ``nonfinite/skipped``); this many iterations in a row with such a
            skip stop the run with ``NonFiniteTrainingError``.
        warn_no_signal_after: this many iterations in a row in which θ took no step (no group of trajectories
            with differing rewards: ``policy/skipped`` = 1) are warned once, with the reward and the action-format
            rate; the run goes on (a collapsed policy cannot recover by itself, a saturated one needs harder data).
    """

    PREFIX: ClassVar[str] = "model.solver"
    RULES: ClassVar[dict[str, Rule]] = {
        "phi_steps": AT_LEAST_ONE, "psi_steps": AT_LEAST_ONE, "policy_epochs": AT_LEAST_ONE,
        "lam_init": NON_NEGATIVE, "lam_delta": NON_NEGATIVE, "lam_max": NON_NEGATIVE, "theta_coupling": NON_NEGATIVE,
        "neumann_steps": AT_LEAST_ONE, "neumann_lr": LEARNING_RATE, "grad_clip_policy": POSITIVE,
        "grad_clip_retriever": POSITIVE, "max_nonfinite_skips": AT_LEAST_ONE,
        "warn_no_signal_after": AT_LEAST_ONE,
    }

    phi_steps: int = 1
    psi_steps: int = 1
    policy_epochs: int = 1
    lam_init: float = 1.0
    lam_delta: float = 0.0
    lam_max: float = 10.0
    theta_coupling: float = 1.0
    neumann_steps: int = 5
    neumann_lr: float = 0.1
    grad_clip_policy: float | None = 1.0
    grad_clip_retriever: float | None = 1.0
    max_nonfinite_skips: int = 3
    warn_no_signal_after: int = 4

    def cross_field_problems(self) -> list[str]:
        if self.lam_init > self.lam_max:
            return [f"model.solver.lam_init ({self.lam_init}) must be <= model.solver.lam_max ({self.lam_max})"]
        return []

    def changed(self) -> set[str]:
        """The fields set to something other than their default."""
        return {f.name for f in fields(self) if getattr(self, f.name) != f.default}


@dataclass(frozen=True)
class RetrievalSampling(Checked):
    """How a search becomes shown passages, and how shown lists are credited (``model.retrieval``).

    Args:
        candidates: K′, candidates fetched from the index per search.
        top_k: k, passages shown to the policy per search (sampled by Plackett-Luce from the K′ candidates
            in training, the top k in evaluation); <= candidates.
        temperature: τ_r of P_φ = softmax(score / τ_r) over the candidates (score units: the retriever's, e.g.
            cosine similarity); used to sample the shown list and in the retriever losses.
        teacher_temperature: β of the LM teacher Q_θ = softmax(ℓ_θ / β) over candidates (ℓ_θ: log-likelihood of
            the gold answer given one candidate, in nats).
        credit_queries: at most this many search calls per rollout batch get LM credit (one ℓ_θ per candidate);
            the cost of the lower-level loss G grows with it.
    """

    PREFIX: ClassVar[str] = "model.retrieval"
    RULES: ClassVar[dict[str, Rule]] = {
        "candidates": AT_LEAST_ONE, "top_k": AT_LEAST_ONE, "temperature": POSITIVE,
        "teacher_temperature": POSITIVE, "credit_queries": AT_LEAST_ONE,
    }

    candidates: int = 10
    top_k: int = 3
    temperature: float = 0.1
    teacher_temperature: float = 1.0
    credit_queries: int = 16

    def cross_field_problems(self) -> list[str]:
        if self.top_k > self.candidates:
            return [f"model.retrieval.top_k ({self.top_k}) must be <= model.retrieval.candidates ({self.candidates})"]
        return []


GROUPS: dict[str, type[Checked]] = {"rl": RLConfig, "solver": SolverConfig, "retrieval": RetrievalSampling}


def group_problems(model_config: Any) -> list[str]:
    """Range and cross-field problems of the groups in a parsed ``model`` config (a jsonargparse Namespace or a
    dict), one message per option, without instantiating anything else."""
    found = []
    for key, cls in GROUPS.items():
        values = model_config.get(key) if model_config is not None else None
        if values is None:
            continue
        try:
            cls(**dict(values.items()))
        except ValueError as error:
            found += str(error).split("; ")
    return found
