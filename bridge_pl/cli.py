"""``bridge-pl``: a thin ``main()`` over LightningCLI (fit / validate / test / predict) plus ``world``.

Errors end the command with one line on stderr naming what is wrong (exit status 1; option errors found while
parsing: usage and exit status 2); ``BRIDGE_PL_DEBUG=1`` shows the Python traceback instead.

``bridge-pl world --out DIR [--seed N]`` writes the built-in synthetic world as FlashRAG-style jsonl.
``bridge-pl index build|info`` builds an on-disk corpus index (``bridge_pl.index_cli``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from bridge_pl.bilevel import make_solver
from bridge_pl.checkpoint_io import (
    AtomicCheckpointIO,
    callback_problems,
    check_run_start,
    checkpoint_folders,
    fit_problem,
    flat_run_config,
    is_named,
    resolve_checkpoint,
)
from bridge_pl.config import (
    FINITE,
    LEARNING_RATE,
    SolverConfig,
    group_problems,
    minibatch_problem,
    raise_problems,
    rule_problems,
)
from bridge_pl.data.datamodule import RolloutDataModule
from bridge_pl.data.prompt_length import rollout_problems
from bridge_pl.data.settings import DATA_RULES, data_problems, read_stage_sources
from bridge_pl.data.sources import check_corpus
from bridge_pl.distributed import FSDP1_REFUSAL, is_fsdp1
from bridge_pl.module import BridgeModule
from bridge_pl.rollout.engine import RolloutAbandoned
from bridge_pl.run_lock import FolderNotWritable, RunLock, write_problem
from bridge_pl.signals import StopOnSignal, exit_line

DEBUG_ENV = "BRIDGE_PL_DEBUG"  # set to 1: errors show their Python traceback


_OWN_RETRIEVERS = ("bridge_pl.retrieval.dense.DenseRetriever", "bridge_pl.retrieval.bm25.BM25Retriever")


def _warn(message: str) -> None:
    sys.stderr.write(f"bridge-pl: warning: {message}\n")


class _LightningTips(logging.Filter):
    """Drops Lightning's "💡 Tip: ..." lines (try litlogger, try litmodels): advertisements, shown by Lightning
    whenever the run has no LitLogger; its other lines (the devices, ``Trainer.fit`` stopped, ...) pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip:")


def _quiet_lightning() -> None:
    """What Lightning prints that a bridge-pl user did not ask for and cannot act on, left out (once per process):

    - its tips (:class:`_LightningTips`);
    - the FutureWarning torch raises at Lightning's own use of ``torch.utils._pytree.LeafSpec`` (a deprecation met
      in bridge-pl's code or a plug-in's still shows);
    - its advice to log with ``sync_dist=True``, given for every epoch-level value logged while torch.distributed
      is initialized (a vLLM engine initializes a one-process group too), for the names bridge-pl logs so: the
      ``val/*`` and ``test/*`` values are pooled across ranks before they are logged (QAMetrics, MissReport,
      QAEval) and ``step`` is the same on every rank.
    """
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where rank_zero_info writes
    if not any(isinstance(f, _LightningTips) for f in rank_zero_logger.filters):
        rank_zero_logger.addFilter(_LightningTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('((val|test)/[^']*|step)', ",
                            module=r"lightning\.pytorch\.trainer\.connectors\.logger_connector\.result")


def _launching_process() -> bool:
    """Whether this is the process a user started, not a rank Lightning or a launcher (torchrun, srun) started."""
    ranks = (os.environ.get(name, "0") for name in ("LOCAL_RANK", "RANK", "NODE_RANK", "SLURM_PROCID"))
    return all(rank == "0" for rank in ranks)


def _number_problems(config) -> list[str]:
    """Non-finite numbers and learning rates <= 0 among the ``model.*`` and ``data.*`` options (optimizer
    ``init_args`` included), as messages naming the option: every number's rule is :data:`FINITE`, or, for an
    option whose last name part is ``lr`` or ``neumann_lr``, :data:`LEARNING_RATE`."""
    numeric = {key: value for key, value in config.items() if key.startswith(("model.", "data."))
               and isinstance(value, (int, float)) and not isinstance(value, bool)}
    rules = {key: LEARNING_RATE if key.rsplit(".", 1)[-1] in ("lr", "neumann_lr") else FINITE for key in numeric}
    return rule_problems("", numeric, rules)


def config_problems(config) -> list[str]:
    """What is wrong with a parsed ``fit``/``validate``/... config (ranges, cross-field rules, solver settings the
    mode does not use), as messages that name the option; empty when it is fine. Runs before any class is
    instantiated."""
    problems = _number_problems(config)
    data = config.get("data")
    if data is not None:
        problems += data_problems({key: data.get(key) for key in (*DATA_RULES, "instruction", "choice_instruction")})
    strategy = config.get("trainer.strategy")
    if strategy is not None and is_fsdp1(strategy):
        problems.append(FSDP1_REFUSAL)
    model = config.get("model")
    problems += group_problems(model)
    if problem := minibatch_problem(config.get("model.rl.minibatches"), config.get("data.n_samples")):
        problems.append(problem)
    problems += callback_problems(config.get("trainer.callbacks"))
    if not problems and model is not None and model.get("solver") is not None:
        try:
            make_solver(model.get("mode"), SolverConfig(**dict(model.get("solver").items())))
        except ValueError as error:
            problems.append(str(error))
    return list(dict.fromkeys(problems))  # a number its group's rules check too (nan, neumann_lr) is named once


class BridgeCLI(LightningCLI):
    """LightningCLI with bridge-pl's defaults: the run's config saved with overwrite, verified atomic checkpoints,
    one run per directory, a checkpoint on SIGTERM / SIGINT, no model summary unless asked for
    (``trainer.enable_model_summary: true``), and none of Lightning's tips."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # two optimizers come from model init args
        kwargs["trainer_defaults"] = {"enable_model_summary": False, **(kwargs.get("trainer_defaults") or {})}
        _quiet_lightning()
        self._lock: RunLock | None = None
        self._qa_sets: dict[str, list] | None = None  # the command's QA sets, read while checking the config
        try:
            super().__init__(BridgeModule, RolloutDataModule, *args, **kwargs)  # parses, and runs the command
        finally:
            if self._lock is not None:
                self._lock.release()

    def _lock_run_directory(self, root: Path) -> None:
        """Hold ``root``'s run lock while the command runs (a no-op once held)."""
        if self._lock is None:
            self._lock = RunLock(root)
            if note := self._lock.acquire():
                _warn(note)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        problems = config_problems(config)
        if problems:
            self.parser.error("; ".join(problems))
        if config.get("trainer.strategy") == "ddp":
            # an iteration may skip θ's step (no group with signal, a non-finite loss), which plain DDP refuses
            config["trainer.strategy"] = "ddp_find_unused_parameters_true"
        root = Path(config.get("trainer.default_root_dir") or os.getcwd())
        if self.subcommand is not None and _launching_process():
            self._check_writable(config, root)
        if self.subcommand is not None and root.is_dir() and _launching_process():
            self._lock_run_directory(root)  # a second run on a directory in use stops here, before any model loads
        if self.subcommand == "fit" and _launching_process():
            check_run_start(config)  # continues the run its folder holds; a resume's options fit its checkpoint
        if self.subcommand is not None and config.get("data") is not None:  # QA sets checked before models load
            self._qa_sets = read_stage_sources(self.subcommand, config.get("data"))
            # budgets and engine against the tokenizer and HF config
            raise_problems(rollout_problems(config.get("data"), config.get("model.policy.init_args.model"),
                                            self._qa_sets.values()))
        corpus = config.get("model.retriever.init_args.corpus")
        if self.subcommand is not None and config.get("model.retriever.class_path") in _OWN_RETRIEVERS \
                and corpus is not None:  # None: a built index (index_path) holds the passages, checked when opened
            check_corpus(corpus)  # and the corpus

    def _check_writable(self, config, root: Path) -> None:
        """Refuse a command whose run directory, or (``fit``) checkpoint folder, does not take files."""
        folders = {root: "trainer.default_root_dir"}
        if self.subcommand == "fit" and config.get("trainer.enable_checkpointing") is not False:
            folders |= {folder: "the run's checkpoints" for folder in checkpoint_folders(config)
                        if folder not in folders}
        for folder, role in folders.items():
            if problem := write_problem(folder):
                raise FolderNotWritable(f"{problem} ({role})")

    def _parse_ckpt_path(self) -> None:
        """Check an explicit ``--ckpt_path`` file. LightningCLI's own step is left out: it would replace the config's
        model options with the hyperparameters stored in the file, so that a path and ``last`` ran different configs
        and the options given were dropped without a word; the run-defining ones are compared instead
        (``check_run_start``)."""
        subcommand = self.config.get("subcommand")
        spec = self.config[subcommand].get("ckpt_path") if subcommand else None
        if spec is not None and not is_named(spec):
            resolve_checkpoint(spec, Path(spec).parent)  # raises CheckpointError naming a damaged or foreign file

    def instantiate_trainer(self, **kwargs):
        # When a command runs, data errors surface before the trainer (and its run directory) exists: the QA sets and
        # a bridge-pl retriever's corpus were read before the models loaded; a plug-in retriever's corpus is read here.
        if self.subcommand is not None and isinstance(self.datamodule, RolloutDataModule):
            self.datamodule.load_sources(self.subcommand, self._qa_sets)
        if self.subcommand is not None and isinstance(self.model, BridgeModule):
            self.model.retriever.passages  # noqa: B018 - the property reads and checks the corpus
        trainer = super().instantiate_trainer(**kwargs)
        for callback in trainer.checkpoint_callbacks:  # one fixed place per run dir, so `--ckpt_path last` finds it
            if getattr(callback, "dirpath", "") is None:
                callback.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        run_config = flat_run_config(self.config[self.subcommand] if self.subcommand else self.config)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # sharded strategies keep their own
            trainer.strategy.checkpoint_io = AtomicCheckpointIO(run_config)
        if self.subcommand is not None:
            self._prepare_run(trainer, run_config)
        return trainer

    def _prepare_run(self, trainer, run_config: dict[str, str]) -> None:
        """Choose and check the checkpoint to start from, then lock the run directory (all before anything is
        written, so a refused run leaves no directory behind); a stop on SIGTERM / SIGINT."""
        config = self.config[self.subcommand]
        folder = Path(trainer.default_root_dir) / "checkpoints"
        if trainer.checkpoint_callbacks and getattr(trainer.checkpoint_callbacks[0], "dirpath", None):
            folder = Path(trainer.checkpoint_callbacks[0].dirpath)
        ckpt_path, notes = resolve_checkpoint(config.get("ckpt_path"), folder)
        for note in notes:
            _warn(note)
        if ckpt_path is not None and Path(ckpt_path).exists():
            if problem := fit_problem(ckpt_path, self.model, run_config):
                raise ValueError(problem)
            for callback in trainer.checkpoint_callbacks:
                # the run continues the folder's last.ckpt (not last-v1.ckpt beside it), also when the folder was
                # moved or copied (Lightning then forgets which last.ckpt it wrote); the lock keeps it one run's
                callback._enable_version_counter = False
        self.config_init[self.subcommand]["ckpt_path"] = ckpt_path
        if self.subcommand in ("validate", "test") and ckpt_path is None \
                and not config.get("model.policy.init_args.adapter"):
            _warn(f"{self.subcommand} without --ckpt_path or model.policy.init_args.adapter scores the untrained "
                  "weights")
        if trainer.global_rank == 0 and _launching_process():
            self._lock_run_directory(Path(trainer.default_root_dir))
        trainer.callbacks.append(StopOnSignal())

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


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' appears twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _config_file_problem(argv: list[str]) -> str | None:
    """A missing or unparsable ``--config`` / ``-c`` file, named with the line of a YAML error (a key given twice
    included), or one that is not a mapping of options; else None."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        if not Path(path).is_file():
            return f"config file {path}: no such file"
        try:
            content = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506
        except yaml.constructor.ConstructorError as err:
            return f"config file {path}:{err.problem_mark.line + 1}: {err.problem}"
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else path
            return f"config file {where}: YAML syntax error ({getattr(err, 'problem', None) or err})"
        except UnicodeDecodeError:
            return f"config file {path}: not UTF-8 text"
        if content is not None and not isinstance(content, dict):
            kind = type(content).__name__
            return f"config file {path}: expected a mapping of options (key: value), got a YAML {kind}"
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
    except (SIGTERMException, RolloutAbandoned) as stop:  # a stop on SIGTERM, SIGINT or SIGHUP, without a code
        line, status = exit_line(stop, argv)
        if _launching_process():  # every rank stops at the same iteration; one says so
            sys.stderr.write(line + "\n")
        raise SystemExit(status) from None
    except KeyboardInterrupt:  # a Ctrl-C before the loops run, or a second one
        sys.stderr.write("bridge-pl: interrupted (Ctrl-C) before an iteration ended; nothing was saved\n")
        raise SystemExit(130) from None
    except Exception as error:  # one line for the user; the traceback on request
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        sys.stderr.write(f"bridge-pl: error: {type(error).__name__}: {error}\n"
                         f"(set {DEBUG_ENV}=1 to see the traceback)\n")
        raise SystemExit(1) from None



if __name__ == "__main__":
    main()
