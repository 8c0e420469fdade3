"""Every config in configs/ parses and instantiates (models replaced by tiny ones, CPU, one process)."""

from pathlib import Path

import pytest
import torch

from bridge_pl.cli import BridgeCLI
from bridge_pl.module import BridgeModule

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
TINY = [
    "--model.policy.init_args.model=tiny-llama",
    "--model.policy.init_args.dtype=float32",
    "--model.policy.init_args.gradient_checkpointing=false",
    "--model.retriever.init_args.encoder=tiny-bert",
    "--model.retriever.init_args.corpus=world",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.strategy=auto",
    "--trainer.precision=32-true",
    "--trainer.logger=false",
]


def test_every_recipe_is_covered():
    assert {p.name for p in CONFIGS} >= {
        "demo.yaml", "smollm2_wiki.yaml", "search_r1_qwen2.5-3b.yaml",
        "bridge_qwen2.5-3b.yaml", "bridge_qwen2.5-7b.yaml",
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_instantiates(config, tmp_path):
    cli = BridgeCLI(args=["--config", str(config), *TINY, f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert isinstance(cli.model, BridgeModule)
    assert cli.model.solver.name == cli.config["model"]["mode"]
    assert cli.datamodule.train_source == cli.config["data"]["train"]
    optimizers, _ = cli.model.configure_optimizers()  # the optimizer callables from YAML are callables
    assert all(isinstance(opt, torch.optim.Optimizer) for opt in optimizers)
