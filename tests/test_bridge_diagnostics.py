"""The ``bridge`` solver's diagnostics (docs/method.md 4.5) and its θ-coupling scale, on a linear toy with hand-computed
gradients, and the pure functions behind them against hand-computed numbers."""

import math

import pytest
import torch
from toy_parameters import ToyParameters

from bridge_pl.bilevel import BridgeSolver, ParamUpdate, Updates, gradient_split, make_solver, parameter_distance
from bridge_pl.config import SolverConfig
from bridge_pl.retrieval.credit import gold_candidate_mask

G_F = torch.tensor([3.0, 0.0], dtype=torch.float64)  # θ-gradient of the toy's F
C = torch.tensor([0.0, 4.0], dtype=torch.float64)  # θ-gradient of the toy's coupling per unit of λ


class LinearToy(ToyParameters):
    """θ = x, φ = y, ψ = z. F = G_F·x (or ``policy_value`` when set, e.g. inf), coupling λ C·x, G = ‖·‖²."""

    def __init__(self, policy_value: float | None = None) -> None:
        self.x = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        self.y = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
        self.z = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
        self.policy_value = policy_value
        self.coupling_lams: list[float] = []

    def policy_loss_parts(self, minibatch=None):
        loss = G_F @ self.x
        yield loss if self.policy_value is None else loss * 0 + self.policy_value

    def retriever_upper_loss(self):
        return 0.0 * self.y.sum()

    def lower_loss(self, encoder, detach_teacher=True):
        return ((self.y if encoder == "phi" else self.z) ** 2).sum()

    def coupling_loss_parts(self, lam):
        self.coupling_lams.append(lam)
        if lam:
            yield lam * (C @ self.x)


def updates(toy: LinearToy, clip: float | None = None) -> Updates:
    """SGD at lr 1 on θ (so θ moves by minus its step's gradient), φ and ψ held (lr 0)."""
    return Updates(policy=ParamUpdate(torch.optim.SGD([toy.x], lr=1.0), clip_norm=clip),
                   phi=ParamUpdate(torch.optim.SGD([toy.y], lr=0.0)), psi=ParamUpdate(torch.optim.SGD([toy.z], lr=0.0)))


def test_gradient_split_against_hand_numbers():
    # g_F = (3, 0), g_C = (0, 4): ‖g_F‖ = 3, ‖g_C‖ = 4, cos((3, 4), (3, 0)) = 9 / (5 · 3) = 0.6
    logs = gradient_split([torch.tensor([3.0, 4.0]), None], [torch.tensor([3.0, 0.0]), None])
    assert logs == pytest.approx({"bridge/grad_norm_rl": 3.0, "bridge/grad_norm_coupling": 4.0,
                                  "bridge/cos_step_rl": 0.6})
    # a parameter only the coupling reached: g_F = (1, 0 | 0), g_C = (0, 0 | 2); cos = 1 / (√5 · 1)
    logs = gradient_split([torch.tensor([1.0, 0.0]), torch.tensor([2.0])], [torch.tensor([1.0, 0.0]), None])
    assert logs == pytest.approx({"bridge/grad_norm_rl": 1.0, "bridge/grad_norm_coupling": 2.0,
                                  "bridge/cos_step_rl": 1 / math.sqrt(5)})
    assert math.isnan(gradient_split([torch.tensor([1.0])], [None])["bridge/cos_step_rl"])  # g_F = 0


def test_parameter_distance_against_hand_numbers():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    b = [torch.tensor([1.0, 0.0]), torch.tensor([[3.0]])]
    assert parameter_distance(a, b) == pytest.approx(math.sqrt(4 + 9))


def test_gold_candidate_mask():
    mask = gold_candidate_mask([["a", "b", None], ["a", "c", "d"]], [{"b", "z"}, None])
    assert mask.tolist() == [[False, True, False], [False, False, False]]  # unknown gold: nothing is gold
    assert gold_candidate_mask([], []).shape == (0, 0)


def test_the_solver_logs_the_split_of_the_coupled_step():
    toy = LinearToy()
    solver = BridgeSolver(lam_init=1.0, lam_max=1.0)
    logs = solver.step(toy, updates(toy, clip=1.0))
    assert logs["bridge/grad_norm_rl"] == pytest.approx(3.0)
    assert logs["bridge/grad_norm_coupling"] == pytest.approx(4.0)
    assert logs["bridge/cos_step_rl"] == pytest.approx(0.6)
    assert logs["bridge/policy_clipped"] == 1.0 and logs["grad_norm/policy"] == pytest.approx(5.0)
    assert logs["bridge/phi_psi_distance"] == pytest.approx(2.0)  # y = (1, 2), z = (1, 0)
    toy = LinearToy()
    assert solver.step(toy, updates(toy, clip=10.0))["bridge/policy_clipped"] == 0.0


@pytest.mark.parametrize(("scale", "expected"), [(0.0, G_F), (1.0, G_F + 1.5 * C), (2.0, G_F + 2 * 1.5 * C)])
def test_theta_coupling_scales_the_coupling_part_of_the_theta_step(scale: float, expected: torch.Tensor):
    """0: the θ step follows F's gradient alone; 2: the coupling part is twice that of 1 (λ = 1.5)."""
    toy = LinearToy()
    solver = BridgeSolver(lam_init=1.5, lam_max=1.5, theta_coupling=scale)
    logs = solver.step(toy, updates(toy))
    torch.testing.assert_close(-toy.x.detach(), expected)
    assert toy.coupling_lams == [scale * 1.5]
    assert logs["bridge/grad_norm_coupling"] == pytest.approx(float((expected - G_F).norm()))
    assert solver.uses_coupling == (scale > 0)  # 0: no LM-credit graph is kept for a backward that never runs


def test_theta_coupling_is_a_checked_bridge_setting():
    assert make_solver("bridge", SolverConfig(theta_coupling=0.0)).theta_coupling == 0.0
    with pytest.raises(ValueError, match=r"model.solver.theta_coupling must be >= 0, got -1.0"):
        SolverConfig(theta_coupling=-1.0)
    with pytest.raises(ValueError, match="does not use model.solver.theta_coupling"):
        make_solver("retriever_first", SolverConfig(theta_coupling=0.0))


@pytest.mark.parametrize("policy_value", [float("inf"), None], ids=["skipped", "finite"])
def test_lambda_ramps_only_after_an_iteration_without_a_skip(policy_value):
    """A non-finite loss skips the θ step and leaves λ where it was (docs/method.md 4.1, step 6)."""
    toy = LinearToy(policy_value)
    solver = BridgeSolver(lam_init=1.0, lam_delta=0.5, lam_max=10.0)
    update = updates(toy)
    logs = solver.step(toy, update)
    assert logs["lambda"] == 1.0
    assert solver.lam.value == (1.0 if policy_value is not None else 1.5)
    assert bool(update.nonfinite()) == (policy_value is not None)
