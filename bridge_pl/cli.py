"""``bridge-pl``: a thin ``main()`` over LightningCLI (fit / validate / test / predict) plus ``world``.

``bridge-pl world --out DIR [--seed N]`` writes the built-in synthetic world as FlashRAG-style jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

from bridge_pl.data.datamodule import RolloutDataModule
from bridge_pl.module import BridgeModule


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints to a temp file and renames it into place; loads with ``weights_only=True``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


class BridgeCLI(LightningCLI):
    """LightningCLI with bridge-pl's defaults: the run's config saved with overwrite, atomic checkpoints."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # two optimizers come from model init args
        super().__init__(BridgeModule, RolloutDataModule, *args, **kwargs)

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # sharded strategies keep their own
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def before_fit(self) -> None:
        logger = self.trainer.logger
        if logger is not None and self.trainer.is_global_zero and getattr(logger, "log_dir", None):
            print(f"bridge-pl: TensorBoard logs in {logger.log_dir}  (tensorboard --logdir {logger.save_dir})")


def world_main(argv: list[str]) -> None:
    """``bridge-pl world``: write the synthetic world (corpus + train/dev/test jsonl)."""
    from bridge_pl.data.world import write_world

    parser = argparse.ArgumentParser(prog="bridge-pl world", description=world_main.__doc__)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="world seed (same seed, same bytes)")
    args = parser.parse_args(argv)
    for name, path in write_world(args.out, seed=args.seed).items():
        print(f"{name}: {path}")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``bridge-pl`` command (returns None: the console script exits with status 0)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["world"]:
        world_main(argv[1:])
    else:
        BridgeCLI(args=args)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
