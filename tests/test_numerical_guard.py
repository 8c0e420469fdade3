"""The numerical guard: a non-finite loss or gradient skips that update (weights, optimizer state and λ
untouched), is reported, and too many in a row stop the run with a clear error."""

import copy

import lightning as L
import pytest
import torch
from helpers import fit_tiny

from bridge_pl.bilevel import ParamUpdate
from bridge_pl.module import NonFiniteTrainingError


def _adam_update():
    layer = torch.nn.Linear(3, 1)
    update = ParamUpdate(torch.optim.Adam(layer.parameters(), lr=0.1), name="phi")
    update.step(layer(torch.ones(1, 3)).sum())  # a first good step, so Adam has state to keep
    return layer, update


@pytest.mark.parametrize("bad", ["loss", "grad"])
def test_a_non_finite_loss_or_gradient_skips_the_step_and_keeps_the_optimizer_state(bad):
    layer, update = _adam_update()
    weights = copy.deepcopy(layer.state_dict())
    state = copy.deepcopy(update.optimizer.state_dict())
    x = torch.tensor([[1.0, float("nan"), 2.0]]) if bad == "loss" else torch.ones(1, 3)
    handle = layer.weight.register_hook(lambda g: g * float("inf")) if bad == "grad" else None
    update.step(layer(x).sum())
    if handle is not None:
        handle.remove()
    assert update.nonfinite == [bad]
    assert all(torch.equal(weights[k], v) for k, v in layer.state_dict().items())
    after = update.optimizer.state_dict()["state"]
    assert all(torch.equal(state["state"][i][k], after[i][k]) for i in after for k in after[i])
    assert all(p.grad is None for p in layer.parameters())
    update.step(layer(torch.ones(1, 3)).sum())  # the next finite step goes through
    assert update.nonfinite == [bad] and not torch.equal(weights["weight"], layer.weight)


class PoisonPhi(L.Callback):
    """Makes φ's gradients infinite in the given iterations (0-based); records φ and λ around each one."""

    def __init__(self, iterations: set[int]) -> None:
        self.iterations, self.handles, self.records = iterations, [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        encoder = module.retriever.query_encoder
        self.before = (copy.deepcopy(encoder.state_dict()), module.solver.lam.value)
        if batch_idx in self.iterations:
            self.handles = [p.register_hook(lambda g: g * float("inf")) for p in encoder.parameters()
                            if p.requires_grad]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        encoder = module.retriever.query_encoder
        unchanged = all(torch.equal(v, encoder.state_dict()[k]) for k, v in self.before[0].items())
        self.records.append((batch_idx, unchanged, self.before[1], module.solver.lam.value,
                             float(trainer.callback_metrics["nonfinite/skipped"])))


def test_a_poisoned_iteration_is_skipped_and_the_run_goes_on(tmp_path):
    poison = PoisonPhi({1})
    fit_tiny(tmp_path, "--trainer.max_steps=3", "--model.solver.lam_delta=0.5", callbacks=(poison,))
    # (iteration, φ unchanged, λ before, λ after, nonfinite/skipped)
    assert [r[1:] for r in poison.records] == [
        (False, 1.0, 1.5, 0.0), (True, 1.5, 1.5, 1.0), (False, 1.5, 2.0, 0.0)
    ]


def test_too_many_non_finite_iterations_in_a_row_stop_the_run_naming_the_part(tmp_path):
    with pytest.raises(NonFiniteTrainingError, match=r"non-finite phi \(grad\).*2 iterations in a row.*"
                                                     r"model.solver.max_nonfinite_skips=2"):
        fit_tiny(tmp_path, "--trainer.max_steps=4", "--model.solver.max_nonfinite_skips=2",
                 callbacks=(PoisonPhi({0, 1, 2}),))


class NoReward(L.Callback):
    """Sets every reward of the rollout batch to 0 before the update, as after a collapse of the action format."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        batch.rewards.zero_()


def test_iterations_without_reward_signal_are_warned_once_per_streak(tmp_path):
    with pytest.warns(UserWarning) as caught:
        cli = fit_tiny(tmp_path, "--trainer.max_steps=3", "--model.solver.warn_no_signal_after=2",
                       callbacks=(NoReward(),))
    stalls = [str(w.message) for w in caught if "taken no step" in str(w.message)]
    assert len(stalls) == 1, stalls  # at the second skipped iteration, not again at the third
    assert stalls[0].startswith("iteration 2: θ has taken no step for 2 iterations in a row")
    assert "train/reward 0.000" in stalls[0] and "model.solver.warn_no_signal_after=2" in stalls[0]
    assert float(cli.trainer.callback_metrics["policy/skipped"]) == 1.0
