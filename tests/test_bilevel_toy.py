"""The BRIDGE and implicit solvers on docs/method.md section 8's toy bilevel problem (closed-form solution)."""

import pytest
import torch
from toy_parameters import ToyParameters

from bridge_pl.bilevel import BridgeSolver, ImplicitSolver, ParamUpdate, Updates

H = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
B = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
C = torch.tensor([1.0, -1.0], dtype=torch.float64)
MU = 0.1
X_STAR = torch.tensor([0.776841, -1.429095], dtype=torch.float64)
HYPERGRAD_AT_0 = torch.tensor([0.571429, 1.428571], dtype=torch.float64)


class ToyProblem(ToyParameters):
    """x = θ (upper), y = φ, z = ψ. G = ½yᵀHy − yᵀBx, F = ½‖y − c‖² + ½μ‖x‖²."""

    def __init__(self) -> None:
        self.x = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        self.y = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        self.z = torch.zeros(2, dtype=torch.float64, requires_grad=True)

    def _g(self, x, y):
        return 0.5 * y @ H @ y - y @ B @ x

    def policy_loss(self):
        return 0.5 * ((self.y.detach() - C) ** 2).sum() + 0.5 * MU * (self.x**2).sum()

    def retriever_upper_loss(self):
        return 0.5 * ((self.y - C) ** 2).sum()

    def lower_loss(self, encoder, detach_teacher=True):
        y = self.y if encoder == "phi" else self.z
        x = self.x.detach() if detach_teacher else self.x
        return self._g(x, y)

    def refresh_teacher(self):
        """The toy's teacher reads x when the loss is built; nothing is cached."""

    def coupling_loss(self, lam):
        return lam * (self._g(self.x, self.y.detach()) - self._g(self.x, self.z.detach()))

    def policy_loss_parts(self, minibatch=None):
        yield self.policy_loss()

    def coupling_loss_parts(self, lam):
        yield self.coupling_loss(lam)


def sgd(param, lr):
    return ParamUpdate(torch.optim.SGD([param], lr=lr))


def theta_step_gradient(solver, toy: ToyProblem) -> torch.Tensor:
    """The gradient a training iteration's θ step follows: one ``solver.step`` with SGD at lr 1 on x and φ, ψ held
    (lr 0), read back as x before − x after."""
    before = toy.x.detach().clone()
    solver.step(toy, Updates(policy=sgd(toy.x, 1.0), phi=sgd(toy.y, 0.0), psi=sgd(toy.z, 0.0)))
    return before - toy.x.detach()


def test_bridge_solver_reaches_closed_form_solution():
    toy = ToyProblem()
    # λ ramps to 1000 in 1,000 steps, then x settles; what remains of its distance to x* is the O(1/λ) bias at
    # λ = 1000, 3.447e-4 (a ramp of 0.05 per step needed 20,000 steps and 13 times the time for the same bound)
    solver = BridgeSolver(phi_steps=10, psi_steps=10, lam_init=1.0, lam_delta=1.0, lam_max=1000.0)
    updates = Updates(policy=sgd(toy.x, 0.05), phi=sgd(toy.y, 0.4), psi=sgd(toy.z, 0.4))
    for _ in range(2_000):
        solver.step(toy, updates)
    assert solver.lam.value == 1000.0
    assert torch.linalg.norm(toy.x.detach() - X_STAR) < 3.5e-4


def test_unscaled_phi_step_diverges_for_large_lambda():
    toy = ToyProblem()
    solver = BridgeSolver(phi_steps=10, psi_steps=10, lam_init=100.0, lam_max=100.0)
    phi = sgd(toy.y, 0.4)
    for _ in range(5):  # the same φ loss F + λG with the step not scaled by 1/(1+λ)
        for _ in range(solver.phi_steps):
            phi.step(toy.retriever_upper_loss() + solver.lam.value * toy.lower_loss("phi"))
    assert not torch.isfinite(toy.y).all() or toy.y.abs().max() > 1e6


def test_implicit_theta_step_follows_the_closed_form_hypergradient():
    toy = ToyProblem()  # x = 0 => y*(x) = 0, where y already is
    solver = ImplicitSolver(neumann_steps=200, neumann_lr=0.3)
    assert torch.allclose(theta_step_gradient(solver, toy), HYPERGRAD_AT_0, atol=1e-5)


@pytest.mark.parametrize("lam", [10.0, 100.0, 1000.0])
def test_bridge_theta_step_error_is_order_one_over_lambda(lam):
    toy = ToyProblem()
    with torch.no_grad():  # x held at 0, so the upper update is skipped: solve y, z exactly
        toy.z.zero_()
        toy.y.copy_(torch.linalg.solve(torch.eye(2) + lam * H, C))  # argmin F + λG at x = 0
    solver = BridgeSolver(lam_init=lam, lam_max=lam)
    error = torch.linalg.norm(theta_step_gradient(solver, toy) - HYPERGRAD_AT_0)
    assert error * lam < 2.5  # O(1/λ): error·λ → 2.12 as λ grows
    assert error > 0


class NoUpperRetrieverToy(ToyProblem):
    """The toy with F blind to y: φ's own objective is then λG, so φ should track ψ and the coupling stay 0."""

    def retriever_upper_loss(self):
        return 0.0 * self.y.sum()


@pytest.mark.parametrize("lam", [1.0, 9.0])
def test_clipped_phi_step_moves_as_far_as_psi(lam):
    """With the retriever clip active (gradients ≫ the clip, as in the demo), φ's step lr/(1+λ) on λ∇G must move φ
    as far as ψ's lr on ∇G. Clipping the raw gradient would shrink φ's step (1+λ)-fold, open a φ−ψ gap that F
    did not cause, and the coupling λ(∇θG(θ,φ) − ∇θG(θ,ψ)) would push θ by an optimizer artefact."""
    toy = NoUpperRetrieverToy()
    with torch.no_grad():
        toy.x.copy_(torch.tensor([30.0, -20.0], dtype=torch.float64))  # ‖∇_y G‖ ≈ 36 at y = 0, clip 1
    solver = BridgeSolver(phi_steps=3, psi_steps=3, lam_init=lam, lam_max=lam)
    clipped = [ParamUpdate(torch.optim.SGD([p], lr=0.1), clip_norm=1.0) for p in (toy.y, toy.z)]
    solver.inner_steps(toy, Updates(policy=sgd(toy.x, 0.0), phi=clipped[0], psi=clipped[1]))
    assert torch.linalg.norm(toy.z.detach()) == pytest.approx(0.3)  # three clipped steps of lr × clip
    torch.testing.assert_close(toy.y, toy.z)
    (coupling,) = torch.autograd.grad(toy.coupling_loss(lam), toy.x)
    assert torch.linalg.norm(coupling) < 1e-6  # rounding; clipping the raw gradient: 0.20 (λ 1), 3.2 (λ 9)
