"""The typed settings groups of ``BridgeModule``: ``model.rl``, ``model.solver`` and ``model.retrieval``.

Each group is a frozen dataclass: LightningCLI shows it as one section of ``bridge-pl fit --help`` with every
field's type, default and description (from the ``Args:`` below), and rejects unknown keys and values outside
a ``Literal``. Ranges and cross-field rules are checked in ``__post_init__``; :func:`group_problems` runs the same
checks on a parsed config before any model loads. Every message names the option (``model.rl.clip_low``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, get_args


def require_choice(option: str, value: Any, choices: Any) -> Any:
    """``value`` if it is one of the ``Literal`` ``choices``, else a ValueError naming ``option`` and the choices.

    LightningCLI already refuses other values when it parses; this guards direct Python construction, where a
    typo would otherwise fall through to a default branch.
    """
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{option} must be one of {list(allowed)}, got {value!r}")
    return value


Algorithm = Literal["grpo", "ppo"]
KLKind = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

_AT_LEAST_ONE: tuple[Callable[[Any], bool], str] = (lambda v: v >= 1, "an integer >= 1")
_POSITIVE: tuple[Callable[[Any], bool], str] = (lambda v: v > 0, "> 0")
_NON_NEGATIVE: tuple[Callable[[Any], bool], str] = (lambda v: v >= 0, ">= 0")
_UNIT_INTERVAL: tuple[Callable[[Any], bool], str] = (lambda v: 0 <= v <= 1, "in [0, 1]")


@dataclass(frozen=True)  # all-dataclass bases: jsonargparse then parses a group as plain fields, not a class_path
class _Checked:
    """Range checks for a settings group: ``RULES`` maps a field to (test, what it must be); None skips."""

    PREFIX: ClassVar[str]
    RULES: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    def problems(self) -> list[str]:
        """What is wrong with these settings, one message per option; empty when they are fine."""
        found = []
        for name, (ok, requirement) in self.RULES.items():
            value = getattr(self, name)
            if value is not None and not ok(value):
                found.append(f"{self.PREFIX}.{name} must be {requirement}, got {value!r}")
        return found + self.cross_field_problems()

    def cross_field_problems(self) -> list[str]:
        return []

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))


@dataclass(frozen=True)
class RLConfig(_Checked):
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
    RULES: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "clip_low": _POSITIVE, "clip_high": _POSITIVE, "kl_coef": _NON_NEGATIVE, "entropy_coef": _NON_NEGATIVE,
        "gamma": _UNIT_INTERVAL, "gae_lambda": _UNIT_INTERVAL, "value_coef": _NON_NEGATIVE,
        "value_clip": _POSITIVE, "micro_batch_tokens": _AT_LEAST_ONE, "minibatches": _AT_LEAST_ONE,
        "dual_clip": (lambda v: v > 1, "> 1 (or null: off)"), "tis_cap": (lambda v: v >= 1, ">= 1 (or null: off)"),
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
class SolverConfig(_Checked):
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
    RULES: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "phi_steps": _AT_LEAST_ONE, "psi_steps": _AT_LEAST_ONE, "policy_epochs": _AT_LEAST_ONE,
        "lam_init": _NON_NEGATIVE, "lam_delta": _NON_NEGATIVE, "lam_max": _NON_NEGATIVE,
        "neumann_steps": _AT_LEAST_ONE, "neumann_lr": _POSITIVE, "grad_clip_policy": _POSITIVE,
        "grad_clip_retriever": _POSITIVE, "max_nonfinite_skips": _AT_LEAST_ONE,
        "warn_no_signal_after": _AT_LEAST_ONE,
    }

    phi_steps: int = 1
    psi_steps: int = 1
    policy_epochs: int = 1
    lam_init: float = 1.0
    lam_delta: float = 0.0
    lam_max: float = 10.0
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
class RetrievalSampling(_Checked):
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
    RULES: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "candidates": _AT_LEAST_ONE, "top_k": _AT_LEAST_ONE, "temperature": _POSITIVE,
        "teacher_temperature": _POSITIVE, "credit_queries": _AT_LEAST_ONE,
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


GROUPS: dict[str, type[_Checked]] = {"rl": RLConfig, "solver": SolverConfig, "retrieval": RetrievalSampling}


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
