"""The parameter accessors a solver reads from a toy bilevel problem: θ = ``x``, φ = ``y``, ψ = ``z``, one
mini-batch (bridge_pl.bilevel.BilevelProblem)."""

import torch


class ToyParameters:
    """Base of the tests' toy problems; a subclass sets the three ``[2]`` float64 tensors ``x``, ``y`` and ``z``."""

    x: torch.Tensor
    y: torch.Tensor
    z: torch.Tensor

    def policy_parameters(self) -> list[torch.Tensor]:
        return [self.x]

    def phi_parameters(self) -> list[torch.Tensor]:
        return [self.y]

    def psi_parameters(self) -> list[torch.Tensor]:
        return [self.z]

    def signal_minibatches(self) -> list[int]:
        return [0]
