"""Train each solver mode on the world with the same seeds and budget; compare test metrics and dev-EM curves.

Variants: ``frozen`` (Search-R1), ``policy_first``, ``retriever_first``, ``bridge``, and ``unmasked``
(``bridge`` trained on retrieved tokens too, ``model.rl.mask_observations=false``). Every step runs in its own
subprocess. Per seed, the config's ``WarmStart`` runs once (``<runs>/warm_seed<seed>``: the adapter and the dev EM
after it, the curves' step 0); every variant of that seed then starts from that adapter (``policy.adapter``), so
the variants differ only in what happens after it. Each (variant, seed) is one ``fit`` + ``test``; it records
``val/<dev>/em`` at every validation, the test metrics (``test/<test>/em``, ``f1``; ``MissReport``'s
retrieval-miss share and recall@k; ``hop recall@k``), from ``QAEval``'s predictions file each test question's EM
and the share of questions answered without a search, and its own peak RSS and fit time, into
``<runs>/<variant>_seed<seed>/result.json``.

**Records.** Each finished step's result, with the commit it ran at, its setup (config and a digest of what
the runs use of it, ``config_digest``; ``--max-steps``, overrides) and its machine (``machine``), is also written to
``<records>/<name>_seed<seed>.json`` (default ``<out>/records``, a few KB each, meant to be committed). The
table is built from the records, and a step with a record is not run again (delete the record to redo one), so a
comparison that takes longer than one machine session resumes from a fresh clone: a variant whose seed's warm-start
adapter is missing from ``<runs>`` makes the warm start again first, and the run stops if that warm start's dev EM
differs from its record's (the variants would not share a start; on another CPU the policy's ``auto`` dtype may
differ, and the error names both machines). A record made with another setup is refused, naming the file.

Outputs: ``<out>/compare_modes.md`` (per mode, mean ± std over seeds, with a ``warm start`` row for the policy every
mode starts from; the paired difference of each mode vs ``frozen``, mean ± standard error; the paper's claims and the
budget check ``frozen`` > its warm start, each reproduced, refuted or within noise by a paired t-interval whose
error counts both the seeds and the sample of test questions, see ``claim_interval``) and
``<out>/compare_modes_dev_em.png`` (dev-EM curves).
**Interrupted runs.** A variant's run checkpoints after every iteration (``<runs>/<variant>_seed<seed>/checkpoints``)
and a run started again finds its ``last.ckpt`` and resumes there (to the same weights as an uninterrupted run,
``tests/test_fault_injection.py``), so a run longer than a session is not lost; its record's ``segments`` list each
part (steps, seconds, peak RSS, commit), its fit time is their sum (the work redone after the interruption is not
counted twice) and its peak memory their maximum. A checkpoint started with another setup or warm-start adapter is
refused, naming the file; the folder is deleted once the record is written. The config's own checkpoints and
``LossLandscape`` probes are left out of every run. Usage::

    python experiments/compare_modes.py                                   # configs/demo.yaml, seeds 0 1 2
    python experiments/compare_modes.py --config configs/smoke.yaml --max-steps 2 --seeds 0   # plumbing
    python experiments/compare_modes.py --modes frozen bridge --data.batch_size=4   # extra args: config overrides
    python experiments/compare_modes.py --max-steps 8 --table-only   # the report so far, from the records
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import lightning as L
import torch
import transformers
import yaml
from lightning.pytorch.callbacks import Checkpoint

from bridge_pl.bilevel import mode_arguments
from bridge_pl.cli import BridgeCLI
from bridge_pl.miss_analysis import retriever_hop_recall
from bridge_pl.module import BridgeModule
from bridge_pl.policy import resolve_dtype
from callbacks.checkpoint import ValidatedCheckpoint
from callbacks.landscape import LossLandscape
from callbacks.miss_report import MissReport
from callbacks.qa_eval import QAEval
from callbacks.warm_start import WarmStart

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "frozen": mode_arguments("frozen"),
    "policy_first": mode_arguments("policy_first"),
    "retriever_first": mode_arguments("retriever_first"),
    "bridge": mode_arguments("bridge"),
    "unmasked": [*mode_arguments("bridge"), "--model.rl.mask_observations=false"],
}
WARM = "warm"  # the per-seed warm start's run folder and worker name
# table column -> test metric name under test/<dataset>/
COLUMNS = {"EM": "em", "F1": "f1", "retrieval-miss share": "miss/retrieval_miss_rate", "recall@k": "miss/recall@k"}
HOP_RECALL = "hop recall@k"  # the query encoder on the world's own hop queries (retriever_hop_recall)
# test questions answered without a single search: a policy that stops searching (and often stops closing its
# answer tag) scores near 0 on 2-hop questions, which the EM column alone does not explain
NO_SEARCH = "no-search share"
TEST_OUTCOMES = "test_outcomes"  # a run record's test EM per question id
METRICS = [*COLUMNS, HOP_RECALL, NO_SEARCH]
SEGMENTS = "segments"  # a run record's parts, when it was resumed (Segments)
STARTED = "started.json"  # in a run's checkpoint folder: the setup and warm start the run began with
# the config's callbacks that no run keeps: its checkpoints (a run keeps its own, to resume) and its landscape probes
# (their time is not the mode's)
DROPPED = (Checkpoint, LossLandscape)


class DevCurve(L.Callback):
    """Records ``(global_step, val/<dataset>/em)`` after every validation (not the sanity check)."""

    def __init__(self, dataset: str) -> None:
        self.key = f"val/{dataset}/em"
        self.points: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # not on_validation_epoch_end: callbacks run that hook before the module logs its metrics
        if not trainer.sanity_checking and self.key in trainer.callback_metrics:
            self.points.append((trainer.global_step, float(trainer.callback_metrics[self.key])))

    def state_dict(self) -> dict:  # saved in the run's checkpoint: a resumed run keeps the points before it
        return {"points": self.points}

    def load_state_dict(self, state_dict: dict) -> None:
        self.points = [tuple(point) for point in state_dict["points"]]


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is in KiB


class Segments(L.Callback):
    """The parts of one run that was interrupted and resumed from its checkpoint, each as ``{from_step, to_step,
    seconds, peak_rss_mb, commit}``: ``seconds`` from this part's start (just before ``trainer.fit``) to its last
    checkpoint, or to the end for the last part. The earlier parts travel in the checkpoint."""

    def __init__(self) -> None:
        self.earlier: list[dict] = []
        self.start, self.from_step, self.commit = time.perf_counter(), 0, commit()

    def current(self, trainer: L.Trainer) -> dict:
        return {"from_step": self.from_step, "to_step": trainer.global_step,
                "seconds": time.perf_counter() - self.start,
                "peak_rss_mb": peak_rss_mb(), "commit": self.commit}

    def all(self, trainer: L.Trainer) -> list[dict]:
        return [*self.earlier, self.current(trainer)]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.from_step = trainer.global_step  # after the checkpoint's loops are restored

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[SEGMENTS] = self.all(trainer)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.earlier = checkpoint[SEGMENTS]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other arguments (--model.x=..., --data.x=...) override the config.")
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, help="training iterations per run (default: the config's)")
    parser.add_argument("--modes", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default="runs/compare_modes", help="folder of the table and plot")
    parser.add_argument("--runs", default="runs/compare_modes", help="folder of the per-run logs and results")
    parser.add_argument("--records", help="folder of the finished steps' records (default: <out>/records)")
    parser.add_argument("--table-only", action="store_true",
                        help="write the table and plot from the records only (the missing steps are listed as not run)")
    parser.add_argument("--worker", nargs=2, metavar=("STEP", "SEED"), help=argparse.SUPPRESS)  # internal
    args, overrides = parser.parse_known_args(argv)
    args.records = args.records or str(Path(args.out) / "records")
    return args, overrides


def run_dir(args: argparse.Namespace, name: str, seed: int) -> Path:
    return Path(args.runs) / f"{name}_seed{seed}"


def record_path(args: argparse.Namespace, name: str, seed: int) -> Path:
    return Path(args.records) / f"{name}_seed{seed}.json"


def setup(args: argparse.Namespace, overrides: list[str]) -> dict:
    """What makes two records comparable: the config (relative to the repository when inside it) and its content,
    the iterations and the config overrides."""
    return {"config": in_repository(args.config),
            "config_sha256": config_digest(args.config, replaced_keys(args.max_steps, overrides)),
            "max_steps": args.max_steps, "overrides": overrides}


def replaced_keys(max_steps: int | None, overrides: list[str]) -> set[str]:
    """The config's dotted keys this command replaces: ``trainer.max_steps`` when ``--max-steps`` is given, and
    each ``--a.b=value`` (or ``--a.b value``) override's key. The setup keeps the command's own values."""
    keys = {arg[2:].split("=", 1)[0] for arg in overrides if arg.startswith("--")}
    return keys | ({"trainer.max_steps"} if max_steps is not None else set())


def config_digest(path: str, replaced: Iterable[str] = ()) -> str:
    """The first 16 hex digits of the SHA-256 of what the runs use of the config: its parsed content (comments and
    layout do not count) without what every run replaces or drops (``seed_everything`` and
    ``trainer.default_root_dir``, set per run; the ``DROPPED`` callbacks; the ``replaced`` dotted keys, which the
    command line sets). An edited value that the runs use counts: records made before the edit are refused instead
    of mixed in. One that the command replaces does not: the demo's own iteration count can change while the
    comparison's ``--max-steps`` stays."""
    config = yaml.safe_load(Path(path).read_text())
    config.pop("seed_everything", None)
    trainer = config.get("trainer") or {}
    trainer.pop("default_root_dir", None)
    kept = [c for c in trainer.pop("callbacks", None) or [] if not dropped_by_runs(c)]
    if kept:  # none kept reads as none listed
        trainer["callbacks"] = kept
    for key in replaced:
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def dropped_by_runs(callback: dict | str) -> bool:
    """Whether a config's ``trainer.callbacks`` entry names a ``DROPPED`` class by its full import path (a name that
    does not import, or a short one, counts as kept)."""
    class_path = callback.get("class_path", "") if isinstance(callback, dict) else callback
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        cls = None
    return isinstance(cls, type) and issubclass(cls, DROPPED)


def in_repository(path: str) -> str:
    """``path`` relative to the repository when inside it (so tables and records read the same on every clone)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved)


def build_cli(args: argparse.Namespace, overrides: list[str], name: str, seed: int, extra: list[str]) -> BridgeCLI:
    """The config's CLI (not run) for one step of the comparison, seeded and writing under its run folder."""
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # our own flags are in sys.argv
    cli = BridgeCLI(args=["--config", args.config, f"--seed_everything={seed}", f"--data.seed={seed}",
                          f"--trainer.default_root_dir={run_dir(args, name, seed)}", *extra, *overrides], run=False)
    # the config's WarmStart runs once per seed, in the warm step
    dropped = DROPPED if name == WARM else (*DROPPED, WarmStart)
    cli.trainer.callbacks[:] = [c for c in cli.trainer.callbacks if not isinstance(c, dropped)]
    return cli


def predictions_writer(trainer: L.Trainer) -> QAEval:
    """The trainer's ``QAEval`` that writes predictions files, added when the config has none: the claims'
    per-question outcomes and the no-search share come from its test file."""
    qa_eval = next((c for c in trainer.callbacks if isinstance(c, QAEval) and c.write_predictions), None)
    if qa_eval is None:
        qa_eval = QAEval(num_trajectories=0)
        trainer.callbacks.append(qa_eval)
    return qa_eval


def predictions_summary(path: Path) -> dict:
    """From a ``QAEval`` predictions file: each question's EM by id (``TEST_OUTCOMES``) and the share of questions
    whose trajectory made no search (``NO_SEARCH``)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return {NO_SEARCH: float(statistics.mean(not row["searches"] for row in rows)),  # mean of bools can be int 0
            TEST_OUTCOMES: {row["id"]: float(row["em"]) for row in rows}}


def test_metrics(trainer: L.Trainer, module: BridgeModule, data, qa_eval: QAEval) -> dict:
    """The table's test columns for ``module``: the config's first test set, whole (``data.max_eval_examples`` caps
    the dev set only), then ``hop recall@k`` on it (k = ``model.retrieval.top_k``), and from ``qa_eval``'s
    predictions file the no-search share and each question's EM."""
    test = next(iter(data.test_sources))
    data.max_eval_examples = None
    metrics = {k: v for per_loader in trainer.test(module, data, verbose=False) for k, v in per_loader.items()}
    predictions = next(p for p in reversed(qa_eval.written) if p.name.startswith(f"test_{test}_step"))
    return {**{column: metrics.get(f"test/{test}/{name}", math.nan) for column, name in COLUMNS.items()},
            HOP_RECALL: retriever_hop_recall(module.retriever, data.load(data.test_sources[test]),
                                             module.retrieval_config.top_k),
            **predictions_summary(predictions)}


def warm_start(args: argparse.Namespace, overrides: list[str], seed: int) -> dict:
    """Worker: the config's ``WarmStart`` for one seed (no RL iteration), saved; then the dev EM it reaches and its
    test metrics (the untrained query encoder's, for the retriever columns)."""
    cli = build_cli(args, overrides, WARM, seed, ["--trainer.max_steps=0"])
    trainer, data = cli.trainer, cli.datamodule
    qa_eval = predictions_writer(trainer)
    adapter = warm_adapter(args, seed)
    warm = [c for c in trainer.callbacks if isinstance(c, WarmStart)]
    for callback in warm:  # different seeds, different demonstrations; the dev EM is measured below
        callback.seed, callback.evaluate, callback.save_to = seed, False, str(adapter)
    trainer.fit(cli.model, data)
    trainer.validate(cli.model, data, verbose=False)
    dev = next(iter(data.val_sources))
    dev_em = float(trainer.callback_metrics[f"val/{dev}/em"])
    return {"seed": seed, "adapter": str(adapter) if warm else None, "dev_em": dev_em,
            **test_metrics(trainer, cli.model, data, qa_eval)}


def train_and_test(args: argparse.Namespace, overrides: list[str], variant: str, seed: int) -> dict:
    """Worker: fit and test one (variant, seed) in this process, from the seed's warm start; its result record."""
    warm = json.loads(record_path(args, WARM, seed).read_text())
    extra = [*VARIANTS[variant]]
    if args.max_steps is not None:
        extra.append(f"--trainer.max_steps={args.max_steps}")
    if warm["adapter"] is not None:
        extra.append(f"--model.policy.init_args.adapter={warm_adapter(args, seed)}")
    cli = build_cli(args, overrides, variant, seed, extra)
    trainer, data = cli.trainer, cli.datamodule
    dev = next(iter(data.val_sources))
    curve = DevCurve(dev)
    trainer.callbacks.append(curve)
    if not any(isinstance(c, MissReport) for c in trainer.callbacks):
        trainer.callbacks.append(MissReport(log_train=False))
    qa_eval = predictions_writer(trainer)
    checkpoints = run_dir(args, variant, seed) / "checkpoints"
    started = {"setup": setup(args, overrides), "warm_adapter": adapter_digest(args, seed, warm)}
    resume = resumable_checkpoint(checkpoints, started)
    segments = Segments()
    # <checkpoints>/last.ckpt after every iteration, after its validation when one follows (the curve's point in it)
    trainer.callbacks += [segments, ValidatedCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_last=True,
                                                        save_top_k=0)]
    trainer.fit(cli.model, data, ckpt_path=resume)
    parts = segments.all(trainer)
    metrics = test_metrics(trainer, cli.model, data, qa_eval)
    return {
        "variant": variant, "seed": seed, "fit_s": sum(p["seconds"] for p in parts),
        "dev_curve": [(0, warm["dev_em"]), *curve.points],
        "peak_rss_mb": max(peak_rss_mb(), *(p["peak_rss_mb"] for p in parts)),  # this process's includes the test
        **({SEGMENTS: parts} if len(parts) > 1 else {}),
        **metrics,
    }


def adapter_digest(args: argparse.Namespace, seed: int, warm: dict) -> str | None:
    """The first 16 hex digits of the SHA-256 of the seed's warm-start adapter weights (None: no warm start)."""
    if warm["adapter"] is None:
        return None
    weights = warm_adapter(args, seed) / "adapter_model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest()[:16]


def resumable_checkpoint(checkpoints: Path, started: dict) -> Path | None:
    """``checkpoints/last.ckpt`` when an interrupted run left it and began as this one does (``started``: the
    setup and the warm-start adapter's digest, kept in ``STARTED``); None for a new run, whose ``started`` is
    written down. A checkpoint of another beginning is refused: resuming it would mix two runs."""
    last, written = checkpoints / "last.ckpt", checkpoints / STARTED
    if last.is_file():
        before = json.loads(written.read_text()) if written.is_file() else None
        if before != started:
            raise ValueError(f"compare_modes: {last} belongs to a run that began with {before}, not this step's "
                             f"{started}; delete {checkpoints} to start the step over")
        return last
    checkpoints.mkdir(parents=True, exist_ok=True)
    written.write_text(json.dumps(started))
    return None


def warm_adapter(args: argparse.Namespace, seed: int) -> Path:
    """The seed's warm-start adapter in ``<runs>`` (the warm step's record names the dev EM it must reproduce)."""
    return run_dir(args, WARM, seed) / "adapter"


def commit() -> str | None:
    """The repository's HEAD commit, with ``+changes`` when tracked files differ from it (None outside git)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return None
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "bridge_pl", "callbacks", "experiments"]).returncode
    return head.stdout.strip() + ("+changes" if dirty else "")


def machine() -> dict:
    """What a run's numbers depend on beyond the code and the setup: the CPU, the dtype that the policy's default
    ``auto`` resolves to here (bfloat16 only with AVX512-BF16/AMX, else float32), and the torch and transformers
    versions."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    return {"cpu": cpu, "auto_dtype": str(resolve_dtype("auto")).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__}


def run_step(args: argparse.Namespace, argv: list[str], name: str, seed: int) -> dict:
    """Run one step in a subprocess (it writes ``<runs>/<name>_seed<seed>/result.json``); that result."""
    print(f"compare_modes: {name}, seed {seed}", flush=True)
    # the worker trains with this checkout's code, the one commit() names: without ROOT first on its path, a run from
    # a second worktree would import bridge_pl and callbacks from wherever the package is installed (editable)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    subprocess.run([sys.executable, __file__, *argv, "--worker", name, str(seed)], check=True,
                   env={**os.environ, "PYTHONPATH": path})
    return json.loads((run_dir(args, name, seed) / "result.json").read_text())


def ensure_warm_adapter(args: argparse.Namespace, argv: list[str], seed: int) -> None:
    """Make the seed's warm start again when its record exists but its adapter is not in ``<runs>`` (a fresh
    clone); refuse to go on if it does not reproduce the record's dev EM."""
    recorded = json.loads(record_path(args, WARM, seed).read_text())
    if recorded["adapter"] is None or (warm_adapter(args, seed) / "adapter_config.json").is_file():
        return
    remade = run_step(args, argv, WARM, seed)
    if remade["dev_em"] != recorded["dev_em"]:
        here = machine()
        where = ("" if recorded.get("machine") == here else
                 f" (recorded on {recorded.get('machine', 'a machine not recorded')}; this is {here})")
        raise RuntimeError(
            f"compare_modes: the warm start of seed {seed} made again reached dev EM {remade['dev_em']}, but "
            f"{record_path(args, WARM, seed)} records {recorded['dev_em']}{where}: the variants would not share a "
            "start; delete that seed's records to redo the seed")


def finished(args: argparse.Namespace, argv: list[str], overrides: list[str], name: str, seed: int) -> list[dict]:
    """One step's record (in a list): read from ``<records>`` if there, else run first and recorded; with
    ``--table-only`` nothing runs, and a step without a record gives ``[]``."""
    path = record_path(args, name, seed)
    if path.exists():
        record = json.loads(path.read_text())
        if record.get("setup") != setup(args, overrides):
            raise ValueError(f"compare_modes: {path} was made with setup {record.get('setup')}, not this command's "
                             f"{setup(args, overrides)}; pass another --records folder or delete the record")
        return [record]
    if args.table_only:
        return []
    if name != WARM:
        ensure_warm_adapter(args, argv, seed)
    record = {**run_step(args, argv, name, seed), "commit": commit(), "setup": setup(args, overrides),
              "machine": machine()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    shutil.rmtree(run_dir(args, name, seed) / "checkpoints", ignore_errors=True)  # the record is the result
    return [record]


def finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def mean_std(values: list[float], digits: int) -> str:
    values = finite(values)
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def paired_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """``a − b`` over the seeds both have a finite value for: (mean, standard error of the mean, seeds).

    The SE is the sample std of the per-seed differences over √n (nan below two seeds; mean nan with none).
    """
    diffs = [a[s] - b[s] for s in sorted(a.keys() & b.keys()) if not math.isnan(a[s] - b[s])]
    if not diffs:
        return math.nan, math.nan, 0
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return statistics.mean(diffs), se, len(diffs)


def signed(mean: float, se: float, n: int) -> str:
    """``+0.107 ± 0.020``, or ``+0.107`` from one seed (no standard error)."""
    return f"{mean:+.3f}" if n < 2 else f"{mean:+.3f} ± {se:.3f}"


# two-sided 95 % quantiles of Student's t by degrees of freedom; between entries the lower df's (wider) is used
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}
Z95 = 1.960  # the limit for infinite degrees of freedom, used beyond the table


def t95(df: float) -> float:
    """Two-sided 95 % Student-t quantile for ``df`` (≥ 1) degrees of freedom, rounded down to a tabulated df."""
    return T95[max(k for k in T95 if k <= df)] if df < max(T95) else Z95


# seeds a verdict needs, the minimum: fewer cannot estimate how training's randomness spreads a result (two
# seeds that differ by the same questions give an SE over seeds of 0)
MIN_SEEDS = 3


def question_outcomes(run: dict) -> dict[str, float]:
    """Test EM per question id of the run record ``run`` (``{}`` for a record without them)."""
    return run.get(TEST_OUTCOMES, {})


def question_se(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> tuple[float, int]:
    """Standard error of the mean paired difference ``a − b`` from the sample of test questions, and that sample's
    size.

    ``a``, ``b``: per seed, the outcome per question id. Each question's difference is averaged over the seeds
    both have, then its sample std over the questions every such seed has is divided by √questions. Every seed
    tests the same questions, so this part of the error is shared by the seeds and the seed-level SE cannot see
    it. (nan, questions) with fewer than two questions.
    """
    seeds = sorted(s for s in a.keys() & b.keys() if a[s] and b[s])
    ids = sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds))) if seeds else []
    if len(ids) < 2:
        return math.nan, len(ids)
    per_question = [statistics.mean(a[s][q] - b[s][q] for s in seeds) for q in ids]
    return statistics.stdev(per_question) / math.sqrt(len(ids)), len(ids)


def claim_interval(mean: float, se_seeds: float, seeds: int, se_questions: float,
                   questions: int) -> tuple[float, float]:
    """95 % interval of a paired difference: mean ± t(df) · √(se_seeds² + se_questions²).

    Training noise (over ``seeds`` seeds) and the finite test set (``questions`` questions, the same in every seed)
    both blur a difference, so their variances add; this counts the question-by-seed noise twice, so the interval
    errs wide. df is Welch–Satterthwaite's for the sum: near seeds − 1 when the seeds' part dominates, near
    questions − 1 when the questions' part does.
    """
    if seeds < 2 or questions < 2 or math.isnan(se_seeds) or math.isnan(se_questions):
        return math.nan, math.nan
    seed_var, question_var = se_seeds**2, se_questions**2
    if seed_var + question_var == 0:
        return mean, mean
    df = (seed_var + question_var) ** 2 / (seed_var**2 / (seeds - 1) + question_var**2 / (questions - 1))
    half = t95(df) * math.sqrt(seed_var + question_var)
    return mean - half, mean + half


def verdict(interval: tuple[float, float], n: int) -> str:
    """The claim ``difference > 0``: reproduced / refuted when its 95 % interval lies above / below 0."""
    if n < MIN_SEEDS:
        return f"not tested (fewer than {MIN_SEEDS} seeds)"
    low, high = interval
    if math.isnan(low) or math.isnan(high):
        return "not tested (no per-question outcomes)"
    if low > 0:
        return "reproduced"
    return "refuted" if high < 0 else "within noise"


# the paper's claims on test EM: (claim, the mode claimed better, the mode claimed worse)
CLAIMS = [
    ("retriever_first > policy_first", "retriever_first", "policy_first"),
    ("bridge > frozen", "bridge", "frozen"),
    ("bridge > policy_first", "bridge", "policy_first"),
    ("bridge > retriever_first", "bridge", "retriever_first"),
    ("unmasked < masked (bridge)", "bridge", "unmasked"),
    # not the paper's: the check that the budget lets Search-R1 itself learn
    ("frozen > its warm start", "frozen", WARM),
]
BASELINE = "frozen"


def by_seed(runs: list[dict], key: str) -> dict[int, float]:
    """``key`` of each run by seed; a record made before ``key`` was measured is left out."""
    return {r["seed"]: float(r[key]) for r in runs if key in r}


def markdown(results: dict[str, list[dict]], warm: list[dict], args: argparse.Namespace, argv: list[str]) -> str:
    """The report: per-mode table (mean ± std), paired differences vs ``frozen`` (mean ± SE), the claims."""
    config = in_repository(args.config)
    done = {v: sorted(r["seed"] for r in runs) for v, runs in results.items()}
    missing = [f"{v} seed {s}" for v in results for s in args.seeds if s not in done[v]]
    lines = [
        "# Mode comparison on the world",
        "",
        f"`{shlex.join(['python', 'experiments/compare_modes.py', *argv])}`",
        "",
        f"Config `{config}`, seeds {' '.join(map(str, args.seeds))}"
        + (f"; **not yet run: {', '.join(missing)}**" if missing else "") + ". "
        "Test metrics on the config's first test set, whole; mean ± std over seeds (one number: one seed; n/a: "
        "undefined in every run, e.g. no failed trajectory). recall@k: gold passages among those shown to the "
        "policy for its own queries (`MissReport`); hop recall@k: the query encoder alone, on the world's own "
        "hop queries. Peak memory: each run's peak RSS (whole process) by the end of its test; time: `trainer.fit` "
        "wall time (RL iterations + validations; the shared warm start is not included). Dev-EM curve: mean dev "
        "EM at each validation, step 0 being the warm-started policy every mode of a seed starts from (the `warm "
        "start` row: its test metrics, untrained retriever).",
        "",
        f"Records in `{in_repository(args.records)}`, made at: "
        + counted([warm, *results.values()], lambda r: str(r.get("commit"))) + "; on: "
        + counted([warm, *results.values()], machine_name) + "."
        + resumed_runs(results),
        "",
        "| mode | seeds | " + " | ".join(f"test {c}" for c in METRICS)
        + " | dev-EM curve | peak RSS (MB) | fit time (s) |",
        "|---" * (len(METRICS) + 5) + "|",
    ]
    rows = [("warm start", warm), *results.items()]
    for variant, runs in rows:
        cells = [str(len(runs))] + [mean_std([r.get(c, math.nan) for r in runs], 3) for c in METRICS]
        curves = [dev_curve(r) for r in runs]
        steps = sorted({s for curve in curves for s, _ in curve})
        cells.append(" → ".join(f"{statistics.mean(em for c in curves for s2, em in c if s2 == s):.3f}"
                                for s in steps) or "-")
        for key, digits in (("peak_rss_mb", 0), ("fit_s", 0)):
            cells.append(mean_std([r[key] for r in runs], digits) if all(key in r for r in runs) and runs else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += per_seed_table(rows, args.seeds)
    base = results.get(BASELINE, [])
    lines += ["", f"Paired differences vs `{BASELINE}` (same seed), mean ± standard error over seeds:", "",
              "| mode | " + " | ".join(f"Δ test {c}" for c in METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
    for variant, runs in results.items():
        if variant == BASELINE:
            continue
        cells = []
        for c in METRICS:
            mean, se, n = paired_difference(by_seed(runs, c), by_seed(base, c))
            cells.append(signed(mean, se, n) + f" (n={n})" if n else "n/a")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += ["", "The paper's claims on test EM, and the budget check (`frozen` over the warm start it began from): "
              "reproduced / refuted when the 95 % interval of the paired difference lies above / below 0, else within "
              "noise. The interval is mean ± t · √(SE over seeds² + SE over "
              "questions²), t with Welch–Satterthwaite's degrees of freedom: every seed tests the same questions, so "
              "the test set's own sampling error is added to the seeds' (`claim_interval`).", "",
              "| claim | difference (mean ± SE over seeds) | SE over questions | 95 % interval | seeds | verdict |",
              "|---|---|---|---|---|---|"]
    modes = {**results, WARM: warm}
    for claim, better, worse in CLAIMS:
        if better in results and worse in modes:
            mean, se, n = paired_difference(by_seed(modes[better], "EM"), by_seed(modes[worse], "EM"))
            se_questions, questions = question_se(*({r["seed"]: question_outcomes(r) for r in modes[mode]}
                                                    for mode in (better, worse)))
            interval = claim_interval(mean, se, n, se_questions, questions)
            cells = [signed(mean, se, n) if n else "n/a", "n/a" if math.isnan(se_questions) else f"{se_questions:.3f}",
                     "n/a" if math.isnan(interval[0]) else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"]
            lines.append(f"| {claim} | " + " | ".join(cells) + f" | {n} | {verdict(interval, n)} |")
    return "\n".join(lines) + "\n"


def dev_curve(record: dict) -> list[tuple[int, float]]:
    """``(step, dev EM)`` per validation of a mode's record; a warm start's record has one point, its dev EM."""
    return record.get("dev_curve", [(0, record.get("dev_em", math.nan))])


def per_seed_table(rows: list[tuple[str, list[dict]]], seeds: list[int]) -> list[str]:
    """Each run on its own: ``test EM; dev EM at each validation`` per mode (row) and seed (column)."""
    lines = ["", "Per seed (test EM; dev EM at each validation):", "",
             "| mode | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    for variant, runs in rows:
        cells = []
        for seed in seeds:
            run = next((r for r in runs if r["seed"] == seed), None)
            if run is None:
                cells.append("not run")
                continue
            cells.append(f"{run['EM']:.3f}; " + " → ".join(f"{em:.3f}" for _, em in dev_curve(run)))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return lines


def counted(runs: list[list[dict]], describe) -> str:
    """``abc1234 (5 steps), def5678+changes (2 steps)``: ``describe(record)`` of the records (e.g. the commit they
    were made at), each with how many records give it, in first-seen order."""
    counts: dict[str, int] = {}
    for label in (describe(r) for group in runs for r in group):
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{c} ({n} step{'s' * (n > 1)})" for c, n in counts.items()) or "none yet"


def machine_name(record: dict) -> str:
    """``AMD EPYC, float32 policy, torch 2.13.0+cpu, transformers 5.25.0``; records made before machines were
    recorded say so."""
    if "machine" not in record:
        return "machine not recorded"
    m = record["machine"]
    return f"{m['cpu']}, {m['auto_dtype']} policy, torch {m['torch']}, transformers {m['transformers']}"


def resumed_runs(results: dict[str, list[dict]]) -> str:
    """The sentence naming the records with ``segments`` (runs resumed after an interruption); "" when none."""
    resumed = [f"{r['variant']} seed {r['seed']} ({len(r[SEGMENTS])} parts)"
               for runs in results.values() for r in runs if SEGMENTS in r]
    return (" Resumed after an interruption (fit time: the parts summed; peak RSS: their maximum; `segments` in the "
            f"record): {', '.join(resumed)}.") if resumed else ""


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Mean dev EM against the training step per variant, ± std over seeds as error bars.

    Variants are drawn slightly apart along x, so that identical curves stay visible.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    shift = 0.04
    for i, (variant, runs) in enumerate(results.items()):
        if not runs:
            continue
        by_step: dict[int, list[float]] = {}
        for run in runs:
            for step, em in run["dev_curve"]:
                by_step.setdefault(step, []).append(em)
        steps = sorted(by_step)
        means = [statistics.mean(by_step[s]) for s in steps]
        stds = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in steps]
        x = [s + (i - (len(results) - 1) / 2) * shift for s in steps]
        ax.errorbar(x, means, yerr=stds, marker="o", capsize=3,
                    label=f"{variant} ({len(runs)} seed{'s' * (len(runs) > 1)})")
    ax.set_xticks(sorted({s for runs in results.values() for r in runs for s, _ in r["dev_curve"]}))
    ax.set_xlabel("RL iteration (0 = after the warm start)")
    ax.set_ylabel("dev EM")
    ax.set_title("dev EM during training (mean ± std over seeds)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parse_args(argv)
    if args.worker:
        name, seed = args.worker[0], int(args.worker[1])
        result = warm_start(args, overrides, seed) if name == WARM else train_and_test(args, overrides, name, seed)
        (run_dir(args, name, seed) / "result.json").write_text(json.dumps(result, indent=1))
        return
    results: dict[str, list[dict]] = {variant: [] for variant in args.modes}
    warm: list[dict] = []
    for seed in args.seeds:  # seed-major: an interrupted comparison already has every variant for early seeds
        warm += finished(args, argv, overrides, WARM, seed)
        for variant in args.modes:
            results[variant] += finished(args, argv, overrides, variant, seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = [a for a in argv if a != "--table-only"]
    (out / "compare_modes.md").write_text(markdown(results, warm, args, command))
    plot(results, out / "compare_modes_dev_em.png")
    print((out / "compare_modes.md").read_text())
    print(f"plot: {out / 'compare_modes_dev_em.png'}")


if __name__ == "__main__":
    main()
