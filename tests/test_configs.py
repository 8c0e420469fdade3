"""Every config in configs/ parses and instantiates (models replaced by tiny ones, CPU, one process).

A recipe in a folder with a ``base.yaml`` (``configs/qwen2.5/``) is given after that base, as its header says.
"""

from pathlib import Path

import pytest
import torch

from bridge_pl.cli import BridgeCLI
from bridge_pl.module import BridgeModule

ROOT = Path(__file__).parents[1] / "configs"


def _with_base(recipe: Path) -> tuple[Path, ...]:
    base = recipe.parent / "base.yaml"
    return (base, recipe) if base.is_file() and recipe != base else (recipe,)


CONFIGS = [_with_base(p) for p in sorted(ROOT.rglob("*.yaml")) if p.name != "base.yaml"]
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
    assert {str(c[-1].relative_to(ROOT)) for c in CONFIGS} >= {
        "demo.yaml", "smollm2_wiki.yaml", "qwen2.5/search_r1_3b.yaml", "qwen2.5/bridge_3b.yaml",
        "qwen2.5/bridge_7b.yaml",
    }


def test_recipe_headers_give_the_command_that_runs_them():
    for configs in CONFIGS:
        if len(configs) > 1:
            command = " ".join(f"--config {c.relative_to(ROOT.parent)}" for c in configs)
            assert command in configs[-1].read_text(), configs[-1]


@pytest.mark.parametrize("configs", CONFIGS, ids=lambda c: str(c[-1].relative_to(ROOT)))
def test_config_instantiates(configs, tmp_path):
    args = [arg for config in configs for arg in ("--config", str(config))]
    cli = BridgeCLI(args=[*args, *TINY, f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert isinstance(cli.model, BridgeModule)
    assert cli.model.solver.name == cli.config["model"]["mode"]
    assert cli.datamodule.train_source == cli.config["data"]["train"]
    optimizers, _ = cli.model.configure_optimizers()  # the optimizer callables from YAML are callables
    assert all(isinstance(opt, torch.optim.Optimizer) for opt in optimizers)


@pytest.mark.parametrize("configs", CONFIGS, ids=lambda c: str(c[-1].relative_to(ROOT)))
def test_a_named_strategy_is_one_this_module_supports(configs):
    """FSDP1 ('fsdp') cannot run manual optimization; the recipes name ddp, fsdp2 or nothing."""
    import yaml
    from lightning.pytorch.strategies import StrategyRegistry

    from bridge_pl.distributed import is_fsdp1

    strategy = None
    for config in configs:
        strategy = (yaml.safe_load(config.read_text()).get("trainer") or {}).get("strategy", strategy)
    if strategy is not None:
        assert not is_fsdp1(strategy)
        assert strategy == "auto" or strategy in StrategyRegistry, strategy
