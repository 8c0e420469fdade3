"""Peak memory and step time of one training iteration per solver mode, as ratios to ``frozen``.

BRIDGE's claim is memory efficiency: a first-order penalty step (``bridge``) should cost about what
alternating updates (``retriever_first``) cost, and far less than the second-order reference
(``implicit``, Hessian-vector products through the retriever and a graph over the LM-credit sequences).

All modes see the same model and the same rollout batch: the batch is generated once (seeded), saved with
``torch.save`` together with the policy's trained weights, and each mode is measured in its own subprocess
(fresh allocator, fresh high-water mark) that loads both. One iteration = building the
:class:`~bridge_pl.problem.RLProblem` (reference log-probs, LM credit) + ``solver.step``, exactly what
``BridgeModule.training_step`` runs, minus logging. ``frozen`` gets the batch without its LM-credit
sequences, as the data module would build it for a fixed retriever.

Peak memory is measured above a baseline taken after setup (model, retriever index, batch, optimizers):

- CUDA: ``torch.cuda.max_memory_allocated`` − ``memory_allocated`` at the baseline;
- CPU: the process's peak RSS − RSS at the baseline, the peak being reset at the baseline through
  ``/proc/self/clear_refs`` (Linux), after returning freed heap to the OS (``malloc_trim``). Where the reset
  is not possible, the growth of ``ru_maxrss`` over its value at the baseline (a lower bound).

Default: SmolLM2-135M-Instruct (LoRA) + MiniLM-L6 over the world (``configs/demo.yaml``) with a small batch,
warm-started for a few supervised steps so that the policy issues searches. Usage::

    python benchmarks/bilevel_memory.py                   # SmolLM2 + MiniLM, a few minutes on 2 CPU cores
    python benchmarks/bilevel_memory.py --tiny            # tiny-llama + tiny-bert, steered to search
    python benchmarks/bilevel_memory.py --steps 3 --data.batch_size=4   # extra args override the config
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
import types
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from bridge_pl.bilevel import SOLVERS, Updates
from bridge_pl.cli import BridgeCLI
from bridge_pl.problem import RLProblem
from callbacks.warm_start import WarmStart

ROOT = Path(__file__).resolve().parents[1]
MODES = ("frozen", "retriever_first", "bridge", "implicit")
# A small SmolLM2 batch: 2 prompts x 2 samples, 4 candidates, LM credit for 2 search calls.
SMALL_BATCH = ("--data.batch_size=2", "--data.n_samples=2", "--model.candidates=4", "--model.top_k=2",
               "--model.credit_queries=2")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other arguments (--model.x=..., --data.x=...) override the config.")
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"), help="bridge-pl config to build from")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny-llama + tiny-bert (tests/configs/tiny.yaml), steered to search, no warm start")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(SOLVERS),
                        help="modes to measure; ratios are to frozen")
    parser.add_argument("--steps", type=int, default=1, help="iterations per mode (time: mean; memory: peak)")
    parser.add_argument("--warm-steps", type=int, default=6, help="supervised warm-start steps before the rollout")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-file", help="rollout batch file: reused if it exists, else written there")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure this mode, print JSON
    args, overrides = parser.parse_known_args(argv)
    if args.tiny:
        args.config, args.warm_steps = str(ROOT / "tests/configs/tiny.yaml"), 0
    elif args.config == parser.get_default("config"):
        overrides = [*SMALL_BATCH, *overrides]
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args, overrides


def build(args: argparse.Namespace, overrides: list[str], mode: str, root: str) -> BridgeCLI:
    """The configured (not running) CLI for ``mode``; the module's retriever index ready."""
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # our own flags are in sys.argv
    cli = BridgeCLI(args=["--config", args.config, f"--model.mode={mode}", "--trainer.logger=false",
                          f"--trainer.default_root_dir={root}", *overrides],
                    run=False)
    cli.model.setup("fit")
    return cli


def steering(policy, tiny: bool):
    """tests/helpers.py ``searching`` (imported by path) for the random tiny policy, else nothing."""
    if not tiny:
        return nullcontext()
    spec = importlib.util.spec_from_file_location("bridge_test_helpers", ROOT / "tests/helpers.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers.searching(policy)


def generate(args: argparse.Namespace, overrides: list[str], path: Path, root: str) -> None:
    """Warm-start the policy, roll out one training batch (with LM credit), save it with the policy weights."""
    cli = build(args, overrides, "bridge", root)  # a retriever-training mode, so the batch has LM credit
    module, data = cli.model, cli.datamodule
    if args.warm_steps:
        trainer = types.SimpleNamespace(ckpt_path=None, global_step=0, global_rank=0, is_global_zero=True,
                                        logger=None, datamodule=data)
        WarmStart(steps=args.warm_steps, batch_size=data.batch_size, evaluate=False).on_fit_start(trainer, module)
    examples = data.load(data.train_source)[: data.batch_size]
    with steering(module.policy, args.tiny):
        batch = data.rollout(module, examples, training=True, dataset="train")
    if batch.credit_searches.numel() == 0:
        raise SystemExit("bilevel_memory: the rollout batch has no search calls; raise --warm-steps")
    torch.save({"batch": batch, "policy": module.policy.trained_state_dict()}, path)
    print(f"batch: {batch.batch_size} trajectories x {batch.input_ids.shape[1]} tokens, "
          f"{batch.search_traj.numel()} searches, {len(batch.credit_sequences)} LM-credit sequences -> {path}")


class PeakMemory:
    """Peak memory (MB) above a baseline: CUDA allocator stats, else the process's peak RSS (module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
            return
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS
            self.baseline = _status_kb("VmRSS") * 1024
        except OSError:
            self.baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak_mb(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.baseline) / 2**20
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.baseline) / 2**20


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def updates_for(module) -> Updates:
    """The solver's optimizers, as the module builds them, with a plain backward (no trainer)."""
    optimizers, _ = module.configure_optimizers()
    return module.updates_from(optimizers, backward=torch.Tensor.backward)


def measure(args: argparse.Namespace, overrides: list[str], root: str) -> dict[str, float]:
    """Worker: ``args.steps`` iterations of ``args.worker`` on the saved batch; peak MB and mean seconds."""
    device = torch.device(args.device)
    module = build(args, overrides, args.worker, root).model.to(device)
    saved = torch.load(args.batch_file, weights_only=False)  # our own file: a RolloutBatch dataclass
    unexpected = module.policy.model.load_state_dict(saved["policy"], strict=False).unexpected_keys
    if unexpected:
        raise SystemExit(f"bilevel_memory: {args.batch_file} holds weights this policy lacks: {unexpected[:3]}")
    batch = move_data_to_device(saved["batch"], device)
    if not module.solver.trains_retriever:  # the data module builds no LM credit for a fixed retriever
        batch.credit_searches, batch.credit_sequences = batch.credit_searches[:0], []
    updates = updates_for(module)
    module.train()
    memory = PeakMemory(device)
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        problem = RLProblem(module.policy, module.retriever, module.psi, None, batch, module.rl_config)
        module.solver.step(problem, updates)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"peak_mb": memory.peak_mb(), "step_s": sum(seconds) / len(seconds)}


def table(results: dict[str, dict[str, float]]) -> str:
    base = results.get("frozen")
    lines = [f"{'mode':<16} {'peak MB':>9} {'ratio':>6} {'step s':>8} {'ratio':>6}"]
    for mode, r in results.items():
        mem = f"{r['peak_mb'] / base['peak_mb']:.2f}" if base and base["peak_mb"] > 0 else "-"
        time_ = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
        lines.append(f"{mode:<16} {r['peak_mb']:>9.1f} {mem:>6} {r['step_s']:>8.2f} {time_:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bilevel_memory_") as root:
        if args.worker:
            print(json.dumps(measure(args, overrides, root)))
            return
        batch_file = Path(args.batch_file or Path(root) / "batch.pt")
        if not batch_file.exists():
            generate(args, overrides, batch_file, root)
        results = {}
        for mode in args.modes:  # the worker parses the same arguments (the last --batch-file wins)
            cmd = [sys.executable, __file__, *argv, "--worker", mode, "--batch-file", str(batch_file)]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
            print(f"{mode}: {results[mode]}", flush=True)
    print(f"\n{args.device}, {args.steps} iteration(s) per mode, peak memory above the post-setup baseline\n")
    print(table(results))


if __name__ == "__main__":
    main()
