"""Update schedules for the policy θ, the retriever query encoder φ and its reference copy ψ.

One :class:`Solver` per ``mode`` (docs/method.md sections 4-5). Solvers only see a :class:`BilevelProblem`
(losses on the current rollout batch) and :class:`ParamUpdate` objects (one optimizer each), so the
same update rule runs the LLM/retriever problem in :mod:`bridge_pl.module` and the closed-form toy
problem of docs/method.md section 8 in the tests. The module never branches on the mode.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bridge_pl.config import SolverConfig
from bridge_pl.distributed import ShardedGradients, any_across_ranks, full_tensor


class BilevelProblem(Protocol):
    """Losses on one training iteration's data.

    Upper level F(θ, φ) (the RL objective), lower level G(θ, φ) (the retriever's LM-supervised loss).
    """

    def policy_parameters(self) -> list[torch.Tensor]:
        """θ."""

    def phi_parameters(self) -> list[torch.Tensor]:
        """φ (the query encoder in use)."""

    def psi_parameters(self) -> list[torch.Tensor]:
        """ψ's query encoder, parameter for parameter as :meth:`phi_parameters` (empty without ψ)."""

    def signal_minibatches(self) -> list[int]:
        """The mini-batches of the batch, in order, on which F has a reward signal for θ (GRPO: some group's rewards
        differ); the policy takes one step on each. Without signal, the θ gradient is only penalty/coupling noise,
        which an adaptive optimizer would blow up into a full-size step."""

    def policy_loss(self) -> torch.Tensor:
        """F as a function of θ (clipped surrogate + penalties)."""

    def policy_loss_parts(self, minibatch: int | None = None) -> Iterator[torch.Tensor]:
        """:meth:`policy_loss` (or F on mini-batch ``minibatch`` alone) as micro-batch terms that sum to it (each
        backpropagated, then freed)."""

    def retriever_upper_loss(self) -> torch.Tensor:
        """F as a function of φ (policy-gradient credit for the retrieved lists)."""

    def lower_loss(self, encoder: str, detach_teacher: bool = True) -> torch.Tensor:
        """G(θ, φ) for ``encoder="phi"`` or G(θ, ψ) for ``"psi"``; the teacher Q(θ) detached unless told."""

    def refresh_teacher(self) -> None:
        """Recompute the teacher Q(θ) of :meth:`lower_loss` with the current θ (after a policy step)."""

    def coupling_loss_parts(self, lam: float) -> Iterator[torch.Tensor]:
        """Micro-batch terms whose sum's θ-gradient is λ (∇θ G(θ, φ) − ∇θ G(θ, ψ)), the same samples for both."""


@dataclass
class ParamUpdate:
    """One optimizer and how a step is taken with it.

    Args:
        optimizer: built over the parameters this update owns.
        backward: how to backpropagate a loss (Lightning's ``manual_backward`` in the module).
        clip_norm: max global norm of this optimizer's gradients times the step's ``lr_scale`` (None: no clipping).
        on_step: called after every step (e.g. bump the retriever version).
        name: what this update trains (``policy``, ``phi``, ``psi``), for the non-finite report.
        sync_grads: called with the parameters after the backward, before clipping (e.g. averaging the gradients
            of parameters replicated across data-parallel ranks).
        sharded: FSDP2-sharded parameters: the loss parts accumulate gradients locally, then one reduction
            pass runs on every rank (ranks may have different numbers of parts).

    A non-finite loss or gradient norm skips the step: the gradients are dropped, the weights and the
    optimizer state stay as they were, ``on_step`` is not called, and ``nonfinite`` records what went bad.
    """

    optimizer: torch.optim.Optimizer
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    clip_norm: float | None = None
    on_step: Callable[[], None] | None = None
    name: str = ""
    sync_grads: Callable[[list[torch.Tensor]], None] | None = None
    sharded: ShardedGradients | None = None
    nonfinite: list[str] = field(default_factory=list)  # e.g. ["loss", "grad"] of skipped steps

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, loss: torch.Tensor, lr_scale: float = 1.0) -> float:
        """Backward ``loss``, clip, step with learning rates scaled by ``lr_scale``; returns the grad norm."""
        return self.step_parts([loss], lr_scale)[1]

    def step_parts(self, parts: Iterable[torch.Tensor], lr_scale: float = 1.0) -> tuple[float, float]:
        """Backward each term of a loss in turn (gradient accumulation), then one step.

        Returns (the summed loss, the grad norm before clipping). In a multi-process run the skip for a
        non-finite loss is decided over all ranks, so that they all step or all skip.
        """
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        with self.sharded.accumulating() if self.sharded is not None else contextlib.nullcontext():
            for part in parts:
                if part.requires_grad:  # a term with no data (e.g. no searches this batch) has no graph
                    self.backward(part)
                total += float(part.detach())
        if self.sharded is not None:
            self.sharded.reduce(self.backward)
        if any_across_ranks(not math.isfinite(total)):
            self._skip("loss")
            return total, float("nan")
        return total, self.apply_grads(lr_scale)

    def _skip(self, what: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.append(what)

    def apply_grads(self, lr_scale: float = 1.0) -> float:
        """Clip and step on gradients already in ``.grad``; returns the grad norm before clipping.

        ``clip_norm`` bounds the norm of the scaled gradient (``lr_scale`` × grad), so the threshold on the raw
        gradient is ``clip_norm / lr_scale``: scaling the learning rate and clipping commute. Clipping the raw
        gradient instead would undo the scaling whenever the clip is active: BRIDGE's φ step, lr/(1+λ) on a
        gradient about (1+λ) times ψ's, would move φ (1+λ) times less far than ψ (docs/method.md 4.3).
        A non-finite norm (a NaN or inf anywhere in the gradients) skips the step (class docstring).
        """
        if self.sync_grads is not None:
            self.sync_grads(self.params)
        grads = [p for p in self.params if p.grad is not None]
        threshold = self.clip_norm / lr_scale if self.clip_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(grads, threshold) if grads else torch.zeros((), dtype=torch.float32)
        norm = full_tensor(norm)  # FSDP2: the norm of sharded gradients is a DTensor
        if not torch.isfinite(norm):
            self._skip("grad")
            return float(norm)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * lr_scale
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.on_step is not None:
            self.on_step()
        return float(norm)


@dataclass
class Updates:
    """The optimizers a solver may use. ``phi``/``psi`` are None when the retriever does not train."""

    policy: ParamUpdate
    phi: ParamUpdate | None = None
    psi: ParamUpdate | None = None

    def nonfinite(self) -> dict[str, list[str]]:
        """The updates that skipped a step for a non-finite loss or gradient: {name: ["loss" | "grad", ...]}."""
        return {u.name: list(u.nonfinite) for u in (self.policy, self.phi, self.psi) if u is not None and u.nonfinite}


def gradient_split(total: Sequence[torch.Tensor | None], first: Sequence[torch.Tensor | None]) -> dict[str, float]:
    """How a gradient accumulated in two parts splits: ``first`` is g_F (the RL loss's θ-gradient), ``total`` is
    g_F + g_C after the coupling's backward; tensors matched by position, None read as 0 (a parameter the part
    did not reach).

    Returns ``bridge/grad_norm_rl`` ‖g_F‖, ``bridge/grad_norm_coupling`` ‖g_C‖ = ‖total − first‖ and
    ``bridge/cos_step_rl`` cos(g_F + g_C, g_F) (nan when either vector is 0), norms in gradient units (float32 per
    tensor, summed over tensors in float64).
    """
    ff = tt = tf = cc = 0.0
    for t, f in zip(total, first, strict=True):
        if t is None and f is None:
            continue
        t = (torch.zeros_like(f) if t is None else t).detach().flatten().float()
        f = (torch.zeros_like(t) if f is None else f).detach().flatten().float()
        ff += float(f @ f)
        tt += float(t @ t)
        tf += float(t @ f)
        cc += float(torch.linalg.vector_norm(t - f)) ** 2
    cosine = tf / math.sqrt(tt * ff) if tt > 0 and ff > 0 else float("nan")
    return {"bridge/grad_norm_rl": math.sqrt(ff), "bridge/grad_norm_coupling": math.sqrt(cc),
            "bridge/cos_step_rl": cosine}


def parameter_distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """‖a − b‖ over matched parameter lists (e.g. φ and ψ), the square root of the summed squared differences."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(x.detach().float() - y.detach().float())) ** 2
                         for x, y in zip(a, b, strict=True)))


class GradientProbe:
    """Splits the θ step that carries the coupling into its RL part g_F and its coupling part g_C.

    Both backpropagate into the same ``.grad`` (one accumulated step), so :meth:`wrap` snapshots the gradients
    when the coupling's first part is asked for, after F's backward, and compares them with the sum after its
    last part, before clipping: one copy of θ's gradients (LoRA-sized by default), no extra forward.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.logs: dict[str, float] = {}

    def wrap(self, parts: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """``parts`` (the coupling's), with the gradients read before the first and after the last backward."""
        first = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        yield from parts
        self.logs = gradient_split([p.grad for p in self.params], first)

    def record_norm(self, norm: float, clip_norm: float | None) -> None:
        """``bridge/policy_clipped``: 1 if the step's norm ``norm`` (before clipping) exceeded ``clip_norm``."""
        self.logs["bridge/policy_clipped"] = float(clip_norm is not None and norm > clip_norm)


class Solver(ABC):
    """One training iteration's updates, in the order the mode prescribes.

    Args:
        phi_steps: inner steps on φ per iteration (K_φ).
        psi_steps: inner steps on ψ per iteration (K_ψ; ``bridge`` only).
        policy_epochs: passes of the policy update over the rollout batch.
    """

    name: str = ""
    settings: ClassVar[tuple[str, ...]] = ("phi_steps", "policy_epochs")  # the SolverConfig fields __init__ takes
    trains_retriever: bool = True
    needs_psi: bool = False
    uses_coupling: bool = False  # the θ step backpropagates through the LM-credit scores
    lower_level_needs_sgd: bool = False  # φ/ψ steps follow an SGD step-size rule (adaptive optimizers refused)

    def __init__(self, phi_steps: int = 1, psi_steps: int = 1, policy_epochs: int = 1) -> None:
        self.phi_steps = phi_steps
        self.psi_steps = psi_steps
        self.policy_epochs = policy_epochs

    @abstractmethod
    def step(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        """Run one iteration; returns scalars to log."""

    def _policy_steps(self, problem: BilevelProblem, updates: Updates, extra=None,
                      probe: GradientProbe | None = None) -> dict[str, float]:
        """``policy_epochs`` passes over the batch, one step on F per mini-batch with signal; ``extra()`` (more
        loss terms: ``bridge``'s coupling parts, ``implicit``'s correction) joins each pass's first step, so a pass
        carries it once, as with one mini-batch. In the first pass that step is at the θ that sampled the batch,
        where ``bridge``'s kept LM-credit graph was built; later steps would move θ under it.

        Skipped (``policy/skipped`` = 1) when F has no reward signal for θ. Logs the last pass's mean loss and grad
        norm over its steps, and ``policy/steps``, the steps taken. ``probe`` splits each pass's first step into F's
        and ``extra``'s gradients (its logs are then the last pass's).
        """
        logs: dict[str, float] = {"policy/skipped": 0.0}
        minibatches = problem.signal_minibatches()
        if not minibatches:
            logs["policy/skipped"] = 1.0
            return logs
        for _ in range(self.policy_epochs):
            steps = []
            for k in minibatches:
                parts = problem.policy_loss_parts(k)
                first = extra is not None and k == minibatches[0]
                if first:
                    parts = itertools.chain(parts, extra() if probe is None else probe.wrap(extra()))
                steps.append(updates.policy.step_parts(parts))
                if first and probe is not None:
                    probe.record_norm(steps[-1][1], updates.policy.clip_norm)
            logs["loss/policy"], logs["grad_norm/policy"] = (sum(values) / len(steps) for values in zip(*steps))
        logs["policy/steps"] = float(self.policy_epochs * len(minibatches))
        return logs

    def _phi_steps_on_lower(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        assert updates.phi is not None
        logs: dict[str, float] = {}
        for _ in range(self.phi_steps):
            loss = problem.lower_loss("phi")
            logs["loss/retriever_G"] = float(loss.detach())
            logs["grad_norm/phi"] = updates.phi.step(loss)
        return logs

    def state_dict(self) -> dict[str, float]:
        return {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` saved."""


class FrozenSolver(Solver):
    """``frozen`` (Search-R1): the retriever is fixed; policy RL only."""

    name = "frozen"
    settings = ("policy_epochs",)
    trains_retriever = False

    def step(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        return self._policy_steps(problem, updates)


class PolicyFirstSolver(Solver):
    """``policy_first``: a θ step, then φ steps on G(θ_new, φ).

    The teacher Q(θ) is recomputed after the θ step. Without that the two alternating orders would make
    identical updates: on a fixed rollout batch the θ step does not depend on φ, and G would see the old θ.
    """

    name = "policy_first"

    def step(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        logs = self._policy_steps(problem, updates)
        problem.refresh_teacher()
        logs.update(self._phi_steps_on_lower(problem, updates))
        return logs


class RetrieverFirstSolver(Solver):
    """``retriever_first``: φ steps on G(θ, φ), then a θ step (the order docs/method.md section 1 finds better).

    The θ step sees the new φ through the retriever ratios r_i = P_φ(D_i)/P_φ_start(D_i) that weight each
    trajectory's advantage (docs/method.md section 4.2); with θ first (``policy_first``) they are 1.
    """

    name = "retriever_first"

    def step(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        logs = self._phi_steps_on_lower(problem, updates)
        logs.update(self._policy_steps(problem, updates))
        return logs


class PenaltySchedule:
    """λ_t of the penalty method: starts at ``init``, grows by ``delta`` per iteration, capped at ``max``."""

    def __init__(self, init: float = 1.0, delta: float = 0.0, max: float = float("inf")) -> None:  # noqa: A002
        if init < 0 or delta < 0 or max < init:
            raise ValueError(f"penalty schedule needs 0 <= init <= max and delta >= 0, got {init}, {delta}, {max}")
        self.value = init
        self.delta = delta
        self.max = max

    def advance(self) -> None:
        self.value = min(self.max, self.value + self.delta)


class BridgeSolver(Solver):
    """``bridge``: first-order penalty bilevel step (docs/method.md section 4; F2SA / V-PBGD family).

    Per iteration: K_ψ steps of ψ on G; K_φ steps of φ on F + λG with step size scaled by 1/(1+λ);
    policy steps on F plus the coupling term c·λ(∇θG(θ,φ) − ∇θG(θ,ψ)); then λ ← min(λ_max, λ + δ), unless an
    update of the iteration was skipped for a non-finite value (λ is then held).

    Args:
        lam_init, lam_delta, lam_max: the penalty schedule.
        theta_coupling: c, the scale of the coupling term in the θ step (1: the method; 0: θ steps on F alone, and
            the LM-credit scores are computed without grad, as no backward goes through them).
    """

    name = "bridge"
    settings = ("phi_steps", "psi_steps", "policy_epochs", "lam_init", "lam_delta", "lam_max", "theta_coupling")
    needs_psi = True
    lower_level_needs_sgd = True

    def __init__(
        self,
        phi_steps: int = 1,
        psi_steps: int = 1,
        policy_epochs: int = 1,
        lam_init: float = 1.0,
        lam_delta: float = 0.0,
        lam_max: float = 10.0,
        theta_coupling: float = 1.0,
    ) -> None:
        super().__init__(phi_steps, psi_steps, policy_epochs)
        if theta_coupling < 0:
            raise ValueError(f"theta_coupling must be >= 0, got {theta_coupling}")
        self.lam = PenaltySchedule(lam_init, lam_delta, lam_max)
        self.theta_coupling = theta_coupling
        self.uses_coupling = theta_coupling > 0

    def inner_steps(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        """The lower-level (ψ) and retriever-first (φ) steps of one iteration."""
        assert updates.phi is not None and updates.psi is not None
        lam = self.lam.value
        logs: dict[str, float] = {}
        for _ in range(self.psi_steps):
            loss = problem.lower_loss("psi")
            logs["loss/retriever_G_psi"] = float(loss.detach())
            logs["grad_norm/psi"] = updates.psi.step(loss)
        for _ in range(self.phi_steps):
            lower = problem.lower_loss("phi")
            loss = problem.retriever_upper_loss() + lam * lower
            logs["loss/retriever_G"] = float(lower.detach())
            logs["loss/retriever_penalised"] = float(loss.detach())
            logs["grad_norm/phi"] = updates.phi.step(loss, lr_scale=1.0 / (1.0 + lam))
        return logs

    def step(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        """One iteration; besides the losses, logs the solver's ``bridge/`` diagnostics (docs/method.md 4.5)."""
        logs = self.inner_steps(problem, updates)
        logs["bridge/phi_psi_distance"] = parameter_distance(problem.phi_parameters(), problem.psi_parameters())
        scaled = self.theta_coupling * self.lam.value
        # a sharded policy's gradients are local shards until the step's reduction: no split of them
        probe = GradientProbe(updates.policy.params) if updates.policy.sharded is None else None
        logs.update(self._policy_steps(problem, updates, extra=lambda: problem.coupling_loss_parts(scaled),
                                       probe=probe))
        if probe is not None:
            logs.update(probe.logs)
        logs["lambda"] = self.lam.value
        if not updates.nonfinite():  # an iteration with a skipped (non-finite) update leaves λ where it was
            self.lam.advance()
        return logs

    def state_dict(self) -> dict[str, float]:
        return {"lambda": self.lam.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.lam.value = float(state["lambda"])


class ImplicitSolver(Solver):
    """``implicit``: second-order reference (implicit differentiation through the retriever).

    φ is the lower-level variable: K_φ steps on G approximate φ*(θ). The policy then steps on the
    hypergradient ∇θF − ∇²θφG [∇²φφG]⁻¹ ∇φF, with the inverse-Hessian-vector product approximated by a
    Neumann series of Hessian-vector products: H⁻¹v ≈ η Σ_{j<J} (I − ηH)^j v.

    Args:
        neumann_steps: J, terms of the series.
        neumann_lr: η; needs η < 2/λ_max(H) to converge.
    """

    name = "implicit"
    settings = ("phi_steps", "policy_epochs", "neumann_steps", "neumann_lr")

    def __init__(
        self, phi_steps: int = 1, policy_epochs: int = 1, neumann_steps: int = 5, neumann_lr: float = 0.1
    ) -> None:
        super().__init__(phi_steps, 0, policy_epochs)
        self.neumann_steps = neumann_steps
        self.neumann_lr = neumann_lr

    def inverse_hvp(self, problem: BilevelProblem, vector: list[torch.Tensor]) -> list[torch.Tensor]:
        """≈ [∇²φφ G]⁻¹ ``vector`` by the Neumann series (HVPs through the retriever only)."""
        phi = problem.phi_parameters()
        grads = torch.autograd.grad(problem.lower_loss("phi"), phi, create_graph=True)
        term = [v.detach().clone() for v in vector]
        total = [t.clone() for t in term]
        curved = any(g.requires_grad for g in grads)  # no lower-level data in the batch: H = 0
        for _ in range(self.neumann_steps):
            hvp = (
                torch.autograd.grad(grads, phi, grad_outputs=term, retain_graph=True)
                if curved
                else [torch.zeros_like(t) for t in term]
            )
            term = [t - self.neumann_lr * h for t, h in zip(term, hvp)]
            total = [s + t for s, t in zip(total, term)]
        return [self.neumann_lr * s for s in total]

    def correction_loss(self, problem: BilevelProblem) -> torch.Tensor:
        """A scalar whose θ-gradient is −∇²θφG · [∇²φφG]⁻¹ ∇φF."""
        # Fused attention kernels have no double backward; second-order terms need the math kernel.
        with sdpa_kernel(SDPBackend.MATH):
            return self._correction_loss(problem)

    def _correction_loss(self, problem: BilevelProblem) -> torch.Tensor:
        phi = problem.phi_parameters()
        v = torch.autograd.grad(problem.retriever_upper_loss(), phi, allow_unused=True)
        v = [torch.zeros_like(p) if g is None else g for p, g in zip(phi, v)]
        p = self.inverse_hvp(problem, v)
        grads = torch.autograd.grad(problem.lower_loss("phi", detach_teacher=False), phi, create_graph=True)
        return -sum(((g * q).sum() for g, q in zip(grads, p) if g.requires_grad), phi[0].new_zeros(()))

    def step(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        logs = self._phi_steps_on_lower(problem, updates)
        # The whole θ step on the math kernel: with activation checkpointing, the backward recomputes the
        # correction's forward, and it must see the kernel the forward saw.
        with sdpa_kernel(SDPBackend.MATH):
            logs.update(self._policy_steps(problem, updates, extra=lambda: [self.correction_loss(problem)]))
        return logs


SOLVERS: dict[str, type[Solver]] = {
    cls.name: cls for cls in (FrozenSolver, PolicyFirstSolver, RetrieverFirstSolver, BridgeSolver, ImplicitSolver)
}


# SolverConfig fields the module applies in every mode (the retriever's clip only where the retriever trains).
_MODULE_SETTINGS = ("grad_clip_policy", "max_nonfinite_skips", "warn_no_signal_after")


def _used_settings(mode: str) -> set[str]:
    cls = SOLVERS[mode]
    return {*cls.settings, *_MODULE_SETTINGS, *(("grad_clip_retriever",) if cls.trains_retriever else ())}


def unused_settings(mode: str, config: SolverConfig) -> list[str]:
    """The ``model.solver`` fields set away from their defaults that ``mode`` would not use."""
    return sorted(config.changed() - _used_settings(mode))


def mode_arguments(mode: str) -> list[str]:
    """CLI arguments that switch any config to ``mode``: ``--model.mode`` and, back at their defaults, the
    ``model.solver`` settings ``mode`` does not use (for sweeps over modes from one config)."""
    used = _used_settings(mode)
    return [f"--model.mode={mode}"] + [
        f"--model.solver.{f.name}={'null' if f.default is None else f.default}"
        for f in fields(SolverConfig) if f.name not in used
    ]


def make_solver(mode: str, config: SolverConfig | None = None) -> Solver:
    """The solver for ``mode`` with its settings from ``config``.

    Raises ValueError for an unknown mode, or a setting changed from its default that the mode does not use.
    """
    if mode not in SOLVERS:
        raise ValueError(f"model.mode must be one of {sorted(SOLVERS)}, got '{mode}'")
    config = config or SolverConfig()
    unused = unused_settings(mode, config)
    if unused:
        defaults = " ".join(f"--model.solver.{n}={SolverConfig.__dataclass_fields__[n].default}" for n in unused)
        raise ValueError(
            f"model.mode '{mode}' does not use {', '.join('model.solver.' + n for n in unused)}: remove "
            f"{'it' if len(unused) == 1 else 'them'} from the config or set the default ({defaults}); the mode "
            f"uses {', '.join(SOLVERS[mode].settings)}"
        )
    cls = SOLVERS[mode]
    return cls(**{name: getattr(config, name) for name in cls.settings})
