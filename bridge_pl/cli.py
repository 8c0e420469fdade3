"""``bridge-pl``: a thin ``main()`` over LightningCLI (fit / validate / test / predict) plus ``world``.

Errors end the command with one line on stderr naming what is wrong (exit status 1; option errors found while
parsing: usage and exit status 2); ``BRIDGE_PL_DEBUG=1`` shows the Python traceback instead.

``bridge-pl world --out DIR [--seed N]`` writes the built-in synthetic world as FlashRAG-style jsonl.
``bridge-pl index build|info`` builds an on-disk corpus index (``bridge_pl.index_cli``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

from bridge_pl.bilevel import make_solver
from bridge_pl.config import SolverConfig, group_problems, minibatch_problem
from bridge_pl.data.datamodule import RolloutDataModule
from bridge_pl.distributed import FSDP1_REFUSAL, is_fsdp1
from bridge_pl.module import BridgeModule

DEBUG_ENV = "BRIDGE_PL_DEBUG"  # set to 1: errors show their Python traceback


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints to a temp file and renames it into place; loads with ``weights_only=True``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a process killed mid-write
            stale.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


# The data module's ranges, checked when the config is parsed, before any model loads: option -> (test, what it
# must be). The model's settings groups check themselves (bridge_pl.config).
_DATA_AT_LEAST_ONE = ("batch_size", "n_samples", "eval_batch_size", "max_turns", "max_new_tokens_per_turn",
                      "max_response_tokens", "max_sampling_rounds")
_DATA_RULES: dict[str, tuple[Any, str]] = {
    **{f"data.{key}": (lambda v: v >= 1, "an integer >= 1") for key in _DATA_AT_LEAST_ONE},
    "data.temperature": (lambda v: v > 0, "> 0"),
    "data.max_eval_examples": (lambda v: v >= 1, "null (all) or an integer >= 1"),
    "data.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "data.type_mixture": (lambda v: min(v.values(), default=0) >= 0 and sum(v.values()) > 0,
                          "weights >= 0 with a positive sum"),
    "data.instruction": (lambda v: "{question}" in v, "a template containing '{question}'"),
}


def config_problems(config) -> list[str]:
    """What is wrong with a parsed ``fit``/``validate``/... config (ranges, cross-field rules, solver settings the
    mode does not use), as messages that name the option; empty when it is fine. Runs before any class is
    instantiated."""
    problems = []
    for key, (ok, requirement) in _DATA_RULES.items():
        value = config.get(key)
        if value is not None and not ok(value):  # None: an optional setting left unset
            problems.append(f"{key} must be {requirement}, got {value!r}")
    strategy = config.get("trainer.strategy")
    if strategy is not None and is_fsdp1(strategy):
        problems.append(FSDP1_REFUSAL)
    model = config.get("model")
    problems += group_problems(model)
    if problem := minibatch_problem(config.get("model.rl.minibatches"), config.get("data.n_samples")):
        problems.append(problem)
    if not problems and model is not None and model.get("solver") is not None:
        try:
            make_solver(model.get("mode"), SolverConfig(**dict(model.get("solver").items())))
        except ValueError as error:
            problems.append(str(error))
    return problems


class BridgeCLI(LightningCLI):
    """LightningCLI with bridge-pl's defaults: the run's config saved with overwrite, atomic checkpoints."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # two optimizers come from model init args
        super().__init__(BridgeModule, RolloutDataModule, *args, **kwargs)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        problems = config_problems(config)
        if problems:
            self.parser.error("; ".join(problems))

    def instantiate_trainer(self, **kwargs):
        # When a command runs, data errors surface here, before the trainer (and its run directory) exists:
        # the QA sets the command reads, and the retriever's corpus (read lazily otherwise).
        if self.subcommand is not None and isinstance(self.datamodule, RolloutDataModule):
            self.datamodule.load_sources(self.subcommand)
        if self.subcommand is not None and isinstance(self.model, BridgeModule):
            self.model.retriever.passages  # noqa: B018 - the property reads and checks the corpus
        trainer = super().instantiate_trainer(**kwargs)
        for callback in trainer.checkpoint_callbacks:  # one fixed place per run dir, so `--ckpt_path last` finds it
            if getattr(callback, "dirpath", "") is None:
                callback.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
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


def _config_file_problem(argv: list[str]) -> str | None:
    """A missing or unparsable ``--config`` / ``-c`` file, named with the line of a YAML error; else None."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        if not Path(path).is_file():
            return f"config file {path}: no such file"
        try:
            yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else path
            return f"config file {where}: YAML syntax error ({getattr(err, 'problem', None) or err})"
        except UnicodeDecodeError:
            return f"config file {path}: not UTF-8 text"
    return None


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``bridge-pl`` command (returns None: the console script exits with status 0)."""
    argv = sys.argv[1:] if args is None else list(args)
    problem = _config_file_problem(argv)
    if problem is not None:
        sys.stderr.write(f"bridge-pl: error: {problem}\n")
        raise SystemExit(2)
    try:
        if argv[:1] == ["world"]:
            world_main(argv[1:])
        elif argv[:1] == ["index"]:
            from bridge_pl.index_cli import index_main

            index_main(argv[1:])
        else:
            BridgeCLI(args=args, parser_kwargs={"allow_abbrev": False})  # None: LightningCLI reads sys.argv
    except Exception as error:  # one line for the user; the traceback on request
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        sys.stderr.write(f"bridge-pl: error: {type(error).__name__}: {error}\n"
                         f"(set {DEBUG_ENV}=1 to see the traceback)\n")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
