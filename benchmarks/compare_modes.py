"""Train each solver mode on the world with the same seeds and budget; compare test metrics and dev-EM curves.

Variants: ``frozen`` (Search-R1), ``policy_first``, ``retriever_first``, ``bridge``, and ``unmasked``
(``bridge`` trained on retrieved tokens too, ``model.mask_observations=false``). Each (variant, seed) is one
``bridge-pl fit`` + ``test`` in its own subprocess; the subprocess records ``val/<dev>/em`` at every
validation, the test metrics (``test/<test>/em``, ``f1``; ``CreditReport``'s retrieval-miss share and
recall@k) and its own peak RSS and fit time, into ``<runs>/<variant>_seed<seed>/result.json``.

Outputs, mean ± std over seeds: ``<out>/compare_modes.md`` (table) and ``<out>/compare_modes_dev_em.png``
(dev-EM curves). Usage::

    python benchmarks/compare_modes.py                                   # configs/demo.yaml, seeds 0 1 2
    python benchmarks/compare_modes.py --config tests/configs/tiny.yaml --max-steps 2 --seeds 0   # plumbing
    python benchmarks/compare_modes.py --modes frozen bridge --data.batch_size=4   # extra args: config overrides
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L

from bridge_pl.cli import BridgeCLI
from callbacks.credit_report import CreditReport
from callbacks.warm_start import WarmStart

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "frozen": ["--model.mode=frozen"],
    "policy_first": ["--model.mode=policy_first"],
    "retriever_first": ["--model.mode=retriever_first"],
    "bridge": ["--model.mode=bridge"],
    "unmasked": ["--model.mode=bridge", "--model.mask_observations=false"],
}
# table column -> test metric name under test/<dataset>/
COLUMNS = {"EM": "em", "F1": "f1", "retrieval-miss share": "credit/retrieval_miss_rate", "recall@k": "credit/recall@k"}


class DevCurve(L.Callback):
    """Records ``(global_step, val/<dataset>/em)`` after every validation (not the sanity check)."""

    def __init__(self, dataset: str) -> None:
        self.key = f"val/{dataset}/em"
        self.points: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # not on_validation_epoch_end: callbacks run that hook before the module logs its metrics
        if not trainer.sanity_checking and self.key in trainer.callback_metrics:
            self.points.append((trainer.global_step, float(trainer.callback_metrics[self.key])))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other arguments (--model.x=..., --data.x=...) override the config.")
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, help="training iterations per run (default: the config's)")
    parser.add_argument("--modes", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"), help="folder of the table and plot")
    parser.add_argument("--runs", default="runs/compare_modes", help="folder of the per-run logs and results")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)  # internal
    return parser.parse_known_args(argv)


def run_dir(args: argparse.Namespace, variant: str, seed: int) -> Path:
    return Path(args.runs) / f"{variant}_seed{seed}"


def train_and_test(args: argparse.Namespace, overrides: list[str], variant: str, seed: int) -> dict:
    """Worker: fit and test one (variant, seed) in this process; returns its result record."""
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # our own flags are in sys.argv
    steps = [f"--trainer.max_steps={args.max_steps}"] if args.max_steps is not None else []
    cli = BridgeCLI(args=["--config", args.config, *VARIANTS[variant], f"--seed_everything={seed}",
                          f"--data.seed={seed}", f"--trainer.default_root_dir={run_dir(args, variant, seed)}",
                          "--trainer.enable_checkpointing=false", *steps, *overrides], run=False)
    trainer, data = cli.trainer, cli.datamodule
    dev, test = next(iter(data.val_sources)), next(iter(data.test_sources))
    curve = DevCurve(dev)
    trainer.callbacks.append(curve)
    if not any(isinstance(c, CreditReport) for c in trainer.callbacks):
        trainer.callbacks.append(CreditReport(log_train=False))
    for callback in trainer.callbacks:
        if isinstance(callback, WarmStart):  # different seeds, different demonstrations
            callback.seed = seed
    start = time.perf_counter()
    trainer.fit(cli.model, data)
    fit_s = time.perf_counter() - start
    metrics = {k: v for per_loader in trainer.test(cli.model, data, verbose=False) for k, v in per_loader.items()}
    return {
        "variant": variant, "seed": seed, "fit_s": fit_s, "dev_curve": curve.points,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # ru_maxrss is in KiB
        **{column: metrics.get(f"test/{test}/{name}", math.nan) for column, name in COLUMNS.items()},
    }


def mean_std(values: list[float], digits: int) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def markdown(results: dict[str, list[dict]], args: argparse.Namespace, argv: list[str]) -> str:
    seeds = " ".join(map(str, args.seeds))
    lines = [
        "# Mode comparison on the world",
        "",
        f"`{shlex.join(['python', 'benchmarks/compare_modes.py', *argv])}`",
        "",
        f"Config `{args.config}`, seeds {seeds}, test metrics on the config's first test set; mean ± std over seeds "
        "(n/a: undefined in every run, e.g. no failed trajectory). Peak memory: each run's peak RSS (whole process); "
        "time: `trainer.fit` wall time (training + validation).",
        "",
        "| mode | " + " | ".join(COLUMNS) + " | peak RSS (MB) | fit time (s) |",
        "|---" * (len(COLUMNS) + 3) + "|",
    ]
    for variant, runs in results.items():
        cells = [mean_std([r[c] for r in runs], 3) for c in COLUMNS]
        cells += [mean_std([r["peak_rss_mb"] for r in runs], 0), mean_std([r["fit_s"] for r in runs], 0)]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Mean dev EM against the training step per variant, shaded ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, runs in results.items():
        by_step: dict[int, list[float]] = {}
        for run in runs:
            for step, em in run["dev_curve"]:
                by_step.setdefault(step, []).append(em)
        steps = sorted(by_step)
        means = [statistics.mean(by_step[s]) for s in steps]
        stds = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in steps]
        ax.plot(steps, means, marker="o", label=variant)
        ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("dev EM")
    ax.set_title("dev EM during training (mean ± std over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parse_args(argv)
    if args.worker:
        variant, seed = args.worker[0], int(args.worker[1])
        result = train_and_test(args, overrides, variant, seed)
        (run_dir(args, variant, seed) / "result.json").write_text(json.dumps(result, indent=1))
        return
    results: dict[str, list[dict]] = {}
    for variant in args.modes:
        for seed in args.seeds:
            print(f"compare_modes: {variant}, seed {seed}", flush=True)
            subprocess.run([sys.executable, __file__, *argv, "--worker", variant, str(seed)], check=True)
            result = json.loads((run_dir(args, variant, seed) / "result.json").read_text())
            results.setdefault(variant, []).append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_modes.md").write_text(markdown(results, args, argv))
    plot(results, out / "compare_modes_dev_em.png")
    print((out / "compare_modes.md").read_text())
    print(f"plot: {out / 'compare_modes_dev_em.png'}")


if __name__ == "__main__":
    main()
