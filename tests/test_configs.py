"""Every config in configs/ parses and instantiates (models replaced by tiny ones, CPU, one process).

A recipe in a folder with a ``base.yaml`` (``configs/qwen2.5/``) is given after that base, as its header says.
"""

from pathlib import Path
from typing import get_args

import pytest
import torch

from bridge_pl.bilevel import mode_arguments
from bridge_pl.cli import BridgeCLI
from bridge_pl.module import BridgeModule, Mode

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
    "--model.retriever.init_args.index_path=null",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.strategy=auto",
    "--trainer.precision=32-true",
    "--trainer.logger=false",
]


def test_every_recipe_is_covered():
    assert {str(c[-1].relative_to(ROOT)) for c in CONFIGS} >= {
        "demo.yaml", "smollm2_wiki.yaml", "qwen2.5/search_r1_3b.yaml", "qwen2.5/bridge_3b.yaml",
        "qwen2.5/bridge_7b.yaml", "qwen2.5/medical_3b.yaml", "world_mc.yaml",
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


def _fit_recipe_at_precision(tmp_path, *overrides: str) -> tuple[BridgeCLI, float]:
    """One PPO iteration (it steps θ even when no reward differs) and one validation of the Qwen2.5 BRIDGE recipe
    with tiny models on the CPU, at the recipe's own precision unless ``overrides`` change it. Returns the CLI and
    the share of the decoder layers' trained weight elements that the step changed."""
    configs = _with_base(ROOT / "qwen2.5" / "bridge_3b.yaml")
    args = [arg for config in configs for arg in ("--config", str(config))]
    tiny = [arg for arg in TINY if not arg.startswith(("--trainer.precision", "--model.policy.init_args.dtype"))]
    cli = BridgeCLI(args=[
        *args, *tiny, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=1",
        "--trainer.val_check_interval=1", "--trainer.limit_val_batches=1", "--data.train=world/train",
        '--data.val={"world_dev": "world/dev"}', "--data.max_eval_examples=2", "--data.eval_batch_size=2",
        "--data.batch_size=1", "--data.n_samples=2",
        "--data.max_turns=1", "--data.max_new_tokens_per_turn=8", "--data.max_response_tokens=48",
        "--model.retrieval.credit_queries=2", "--model.rl.algorithm=ppo", *overrides,
    ], run=False)

    def layers() -> dict[str, torch.Tensor]:
        return {n: p for n, p in cli.model.policy.named_parameters() if p.requires_grad and ".layers." in n}

    before = {name: p.detach().clone() for name, p in layers().items()}
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 1 and "val/world_dev/em" in cli.trainer.callback_metrics
    after = layers()
    assert all(torch.isfinite(p).all() for p in after.values())
    moved = sum(int((value.to(after[name].dtype) != after[name]).sum()) for name, value in before.items())
    return cli, moved / sum(value.numel() for value in before.values())


@pytest.mark.parametrize("mode", get_args(Mode))
def test_the_gpu_recipes_train_at_their_own_precision(mode, tmp_path, recwarn):
    """configs/qwen2.5 compute in bf16 (``bf16-mixed``) on float32 weights: the first AdamW step, at the recipe's
    warm-up learning rate of 1e-8, moves nearly every trained weight. Every mode, with the recipe's callbacks; the
    rollouts run in the same autocast context as the steps."""
    cli, moved = _fit_recipe_at_precision(tmp_path, *mode_arguments(mode))
    assert cli.trainer.precision == "bf16-mixed"
    assert moved > 0.9, moved
    assert not [w for w in recwarn if "half precision" in str(w.message)]


def test_bf16_true_trains_but_warns_that_its_steps_are_rounded_away(tmp_path):
    """``bf16-true`` converts the trained weights to bfloat16. It runs (its precision plugin walks each loader batch,
    which once raised on the frozen QAExamples, seen on an H200 with benchmarks/gpu_check.sh; bfloat16 accumulators
    made by dtype-less factories in the RL math did too), but the same first step moves almost no weight, and the
    fit says so."""
    with pytest.warns(UserWarning, match="half precision"):
        cli, moved = _fit_recipe_at_precision(tmp_path, "--trainer.precision=bf16-true",
                                              "--model.policy.init_args.dtype=bfloat16")
    assert {p.dtype for p in cli.model.policy.parameters()} == {torch.bfloat16}
    assert moved < 0.1, moved


def test_the_medical_recipe_validates_on_mirage_and_a_medrag_corpus(tmp_path):
    """configs/qwen2.5/medical_3b.yaml with tiny models, the packaged MIRAGE-format and MedRAG-format test files:
    the five subsets are the validation sets (base.yaml's seven are replaced), each gets its accuracy, and
    val/mirage/accuracy is their macro average."""
    data = Path(__file__).parent / "data"
    configs = _with_base(ROOT / "qwen2.5" / "medical_3b.yaml")
    args = [arg for config in configs for arg in ("--config", str(config))]
    tiny = [arg for arg in TINY if not arg.startswith("--model.retriever.init_args.corpus")]
    cli = BridgeCLI(args=[
        *args, *tiny, f"--trainer.default_root_dir={tmp_path}",
        f"--model.retriever.init_args.corpus=medrag:{data}/medrag",
        f"--data.val={{'mirage': 'mirage:{data}/mirage/benchmark.json'}}", "--data.max_eval_examples=2",
        "--data.eval_batch_size=2", "--data.max_turns=1", "--data.max_new_tokens_per_turn=8",
        "--data.max_response_tokens=48", "--trainer.limit_val_batches=1",
    ], run=False)
    subsets = ["medqa", "medmcqa", "pubmedqa", "bioasq", "mmlu"]
    assert list(cli.datamodule.val_sources) == [f"mirage/{s}" for s in subsets]
    cli.trainer.validate(cli.model, cli.datamodule)
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    accuracies = [metrics[f"val/mirage/{s}/accuracy"] for s in subsets]
    assert all(a in (0.0, 0.5, 1.0) for a in accuracies)  # two questions each
    assert metrics["val/mirage/accuracy"] == pytest.approx(sum(accuracies) / 5)
    assert (tmp_path / "predictions" / "val_mirage_bioasq_step0.jsonl").is_file()
