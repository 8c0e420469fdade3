"""Loss-landscape probes (docs/method.md section 7): random slices, sharpness and a PL estimate.

Every function takes a loss closure ``loss_fn() -> scalar tensor`` and the list of parameters it
probes, moves the parameters in place, and leaves them bit-identical to how it found them (they are
saved as clones and copied back, never "un-perturbed" by subtraction, which would drift in floating
point). None of them changes ``.grad``: gradients are taken with :func:`torch.autograd.grad`, or, for parameters
sharded by FSDP2 (DTensors, whose gradients FSDP computes outside autograd's view), by a backward pass whose
``.grad`` is read and then put back as it was. Random draws are made at full size on every rank and sharded like
the parameter, so a sharded probe moves the weights exactly as a single-process probe does.

- :func:`filter_normalized_direction`: Li et al. (2018) random directions, one row per output unit
  rescaled to the norm of the parameter's row; 1-D parameters (biases, norm gains) get a zero direction.
- :func:`loss_surface`, :func:`slice_1d`, :func:`grid_2d`: L(θ + Σ_i c_i d_i) at given coordinates.
- :func:`top_hessian_eigenvalue`: sharpness by power iteration on finite-difference Hessian-vector
  products [∇L(θ + εv) − ∇L(θ − εv)] / 2ε (first order: two gradients per product, no double
  backward).
- :func:`descent_trace` + :func:`pl_estimate`: (G, ‖∇G‖²) along plain gradient descent and the
  Polyak-Łojasiewicz constant μ̂ = min_t ‖∇G_t‖² / 2(G_t − Ĝ*).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from bridge_pl.distributed import full_tensor, is_dtensor, shard_like

LossFn = Callable[[], torch.Tensor]
Direction = list[torch.Tensor]  # one tensor per probed parameter, same shapes




@contextmanager
def restored(params: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Save clones of ``params``, yield them (the origin θ), and copy them back bit-exactly on exit."""
    origin = [p.detach().clone() for p in params]
    try:
        yield origin
    finally:
        with torch.no_grad():
            for p, saved in zip(params, origin, strict=True):
                p.copy_(saved)


def set_offset(
    params: Sequence[torch.Tensor], origin: Sequence[torch.Tensor], directions: Sequence[Direction],
    coeffs: Sequence[float],
) -> None:
    """In place: ``p ← origin + Σ_i coeffs[i] · directions[i][p]`` for every probed parameter."""
    with torch.no_grad():
        for j, (p, p0) in enumerate(zip(params, origin, strict=True)):
            moved = p0.clone()
            for d, c in zip(directions, coeffs, strict=True):
                moved.add_(d[j], alpha=float(c))
            p.copy_(moved)


def filter_normalized_direction(
    params: Sequence[torch.Tensor], generator: torch.Generator, zero_row_norm: float = 0.0
) -> Direction:
    """A random direction with each output row scaled to the norm of the parameter's row (Li et al. 2018).

    Rows are slices along dim 0 (an ``nn.Linear`` weight ``[out, in]`` has one row per output unit).
    Parameters with fewer than 2 dims get a zero direction. A row whose weights are all zero (LoRA's B
    starts at zero) gets norm ``zero_row_norm`` (default 0: that row is not probed, as Li et al.'s rule
    gives). Draws come from ``generator`` (a CPU generator) in float32, so the direction does not depend
    on the device; it is returned in each parameter's device and dtype.
    """
    direction = []
    for p in params:
        if p.dim() < 2:
            direction.append(torch.zeros_like(p))
            continue
        rows = full_tensor(p.detach()).float().reshape(p.shape[0], -1).cpu()
        d = torch.randn(rows.shape, generator=generator)
        target = rows.norm(dim=1, keepdim=True)
        target = torch.where(target > 0, target, torch.full_like(target, zero_row_norm))
        d = d * target / d.norm(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        direction.append(shard_like(d.reshape(p.shape), p))
    return direction


def loss_surface(
    loss_fn: LossFn, params: Sequence[torch.Tensor], directions: Sequence[Direction], coords: torch.Tensor
) -> torch.Tensor:
    """``L(θ + Σ_i coords[n, i] · directions[i])`` for each row n of ``coords`` ``[N, len(directions)]``.

    Returns ``[N]`` float64 losses (evaluated without grad); ``params`` are restored afterwards.
    """
    if coords.dim() != 2 or coords.shape[1] != len(directions):
        raise ValueError(f"coords must be [N, {len(directions)}], got shape {tuple(coords.shape)}")
    out = torch.empty(coords.shape[0], dtype=torch.float64)
    with restored(params) as origin, torch.no_grad():
        for n, row in enumerate(coords.tolist()):
            set_offset(params, origin, directions, row)
            out[n] = float(loss_fn())
    return out


def slice_1d(
    loss_fn: LossFn, params: Sequence[torch.Tensor], direction: Direction, alphas: torch.Tensor
) -> torch.Tensor:
    """``[A]``: L(θ + α δ) for α in ``alphas`` ``[A]``."""
    return loss_surface(loss_fn, params, [direction], alphas.reshape(-1, 1))


def grid_2d(
    loss_fn: LossFn, params: Sequence[torch.Tensor], directions: tuple[Direction, Direction],
    alphas: torch.Tensor, betas: torch.Tensor,
) -> torch.Tensor:
    """``[A, B]``: L(θ + α δ + β η); α from ``alphas`` ``[A]`` by row, β from ``betas`` ``[B]`` by column."""
    coords = torch.cartesian_prod(alphas.double(), betas.double()).reshape(-1, 2)
    return loss_surface(loss_fn, params, list(directions), coords).reshape(len(alphas), len(betas))


def gradient(loss_fn: LossFn, params: Sequence[torch.Tensor]) -> Direction:
    """∇L at the current parameters (zeros for parameters the loss does not use); ``.grad`` as it was."""
    if any(is_dtensor(p) for p in params):
        return _gradient_by_backward(loss_fn, params)
    with torch.enable_grad():
        grads = torch.autograd.grad(loss_fn(), list(params), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]


def _gradient_by_backward(loss_fn: LossFn, params: Sequence[torch.Tensor]) -> Direction:
    """FSDP2-sharded parameters: one backward pass (FSDP reduces the gradients over ranks), ``.grad`` restored."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with torch.enable_grad():
            loss_fn().backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def _dot(a: Direction, b: Direction) -> float:
    return float(sum(full_tensor((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True)))


def finite_difference_hvp(
    loss_fn: LossFn, params: Sequence[torch.Tensor], v: Direction, eps: float
) -> Direction:
    """H v ≈ [∇L(θ + εv) − ∇L(θ − εv)] / 2ε (exact for quadratics up to rounding); ``params`` restored."""
    with restored(params) as origin:
        set_offset(params, origin, [v], [eps])
        plus = gradient(loss_fn, params)
        set_offset(params, origin, [v], [-eps])
        minus = gradient(loss_fn, params)
    return [(a - b) / (2 * eps) for a, b in zip(plus, minus)]


def top_hessian_eigenvalue(
    loss_fn: LossFn, params: Sequence[torch.Tensor], generator: torch.Generator, iters: int = 10,
    eps: float = 1e-3, tol: float = 1e-4,
) -> tuple[float, list[float]]:
    """Sharpness: the dominant Hessian eigenvalue of L at θ by power iteration on finite-difference HVPs.

    ``v`` starts as a unit Gaussian vector over all ``params`` (drawn from the CPU ``generator``); each
    iteration takes v ← Hv/‖Hv‖ and records the Rayleigh quotient vᵀHv. Power iteration finds the
    eigenvalue of largest magnitude, so a strongly concave direction can give a negative value. Stops
    after ``iters`` products or when the quotient changes by less than ``tol`` (relative). ``eps`` is the
    finite-difference step in parameter units along the unit vector v.

    Returns:
        (eigenvalue, the Rayleigh quotient after each iteration).
    """
    if iters < 1 or eps <= 0:
        raise ValueError(f"top_hessian_eigenvalue needs iters >= 1 and eps > 0, got {iters}, {eps}")
    v = [shard_like(torch.randn(p.shape, generator=generator), p) for p in params]
    norm = math.sqrt(_dot(v, v))
    v = [x / norm for x in v]
    history: list[float] = []
    for _ in range(iters):
        hv = finite_difference_hvp(loss_fn, params, v, eps)
        history.append(_dot(v, hv))
        norm = math.sqrt(_dot(hv, hv))
        if norm == 0:  # v lies in the null space: the Hessian is zero along every direction tried
            break
        v = [x / norm for x in hv]
        if len(history) > 1 and abs(history[-1] - history[-2]) <= tol * max(abs(history[-1]), 1e-12):
            break
    return history[-1], history


def descent_trace(
    loss_fn: LossFn, params: Sequence[torch.Tensor], lr: float, steps: int
) -> tuple[list[float], list[float]]:
    """Run ``steps`` of plain gradient descent θ ← θ − lr ∇L, recording (L_t, ‖∇L_t‖²), t = 0..steps.

    The parameters are restored afterwards. Returns two lists of ``steps + 1`` floats.
    """
    losses, grad_sq = [], []
    with restored(params):
        for t in range(steps + 1):
            with torch.no_grad():
                losses.append(float(loss_fn()))
            grads = gradient(loss_fn, params)
            grad_sq.append(_dot(grads, grads))
            if t < steps:
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(g, alpha=lr)
    return losses, grad_sq


def pl_estimate(
    losses: Sequence[float], grad_sq_norms: Sequence[float], g_star: float | None = None
) -> float:
    """Polyak-Łojasiewicz constant along a trajectory: μ̂ = min_t ‖∇G_t‖² / 2(G_t − Ĝ*).

    ``Ĝ*`` is ``g_star`` when the minimum is known, else the smallest observed loss. Edge cases:
    points with G_t − Ĝ* ≤ 0 (the argmin itself, or any point at or below a given ``g_star``) carry no
    information and are skipped; if none is left (fewer than two distinct values) the result is NaN.
    Because min observed G ≥ the true G*, the estimate with ``g_star=None`` overstates μ slightly.
    Non-finite inputs or mismatched lengths raise ``ValueError``.
    """
    if len(losses) != len(grad_sq_norms):
        raise ValueError(f"pl_estimate: {len(losses)} losses but {len(grad_sq_norms)} gradient norms")
    values = [*losses, *grad_sq_norms]
    if not all(math.isfinite(x) for x in values):
        raise ValueError("pl_estimate: losses and squared gradient norms must be finite")
    if not losses:
        return math.nan
    floor = min(losses) if g_star is None else g_star
    ratios = [g / (2 * (loss - floor)) for loss, g in zip(losses, grad_sq_norms) if loss - floor > 0]
    return min(ratios) if ratios else math.nan
