"""``callbacks.checkpoint.ValidatedCheckpoint``: an iteration followed by a validation is saved after that validation
(so the validation's state is in the file and a resumed run does not skip it); every other save is
``ModelCheckpoint``'s. The resume itself, killed during a validation, is in ``tests/test_fault_injection.py``."""

import lightning as L
import pytest
import torch
from helpers import TINY, fit_tiny

from bridge_pl.cli import main
from callbacks.checkpoint import ValidatedCheckpoint

COMMON = ("--trainer.max_steps=4", "--trainer.val_check_interval=2", "--data.reward=plugins.DistinctWordsReward")


class Events(L.Callback):
    """``("val", step)`` at each validation's end and ``("save", step)`` at each checkpoint file written."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_validation_end(self, trainer, pl_module):
        self.events.append(("val", trainer.global_step))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.events.append(("save", trainer.global_step))


@pytest.mark.parametrize("save_top_k", [0, 1])
def test_an_iteration_with_a_validation_is_saved_after_it(tmp_path, save_top_k, recwarn):
    events = Events()
    checkpoint = ValidatedCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True,
                                     save_top_k=save_top_k)
    fit_tiny(tmp_path, *COMMON, callbacks=(events, checkpoint))
    writes = 1 + save_top_k  # last.ckpt, and the top-k file
    save = [("save", 1)] * writes
    assert events.events == [*save, ("val", 2), *[("save", 2)] * writes, *[("save", 3)] * writes, ("val", 4),
                             *[("save", 4)] * writes]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 1 + save_top_k
    # Lightning's warning that a manually optimized module is saved after its step: right for an RL iteration
    assert not [w for w in recwarn if "manual optimization" in str(w.message)]


def test_without_dev_questions_every_iteration_is_saved_at_its_end(tmp_path):
    """A validation with no batches never ends (no ``on_validation_end``): its iteration is saved as usual."""
    events = Events()
    checkpoint = ValidatedCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True, save_top_k=0)
    fit_tiny(tmp_path, *COMMON, "--data.val={}", callbacks=(events, checkpoint))
    assert events.events == [("save", 1), ("save", 2), ("save", 3), ("save", 4)]


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_keep_last_below_one_is_one_line_naming_the_option_and_its_values(tmp_path, capfd, value):
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, f"--trainer.default_root_dir={root}", "--trainer.enable_checkpointing=true",
              "--trainer.callbacks+=callbacks.checkpoint.ValidatedCheckpoint",
              f"--trainer.callbacks.keep_last={value}"])
    err = capfd.readouterr().err
    assert exit_info.value.code == 2 and not root.exists()
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors == [f"error: trainer.callbacks[0] (ValidatedCheckpoint): option keep_last must be an integer >= 1 "
                      f"(the newest N iteration checkpoints kept) or null (ModelCheckpoint's own save_top_k), got "
                      f"{value}"], err
