"""How much of ``bridge``'s θ step is the coupling term (docs/method.md section 11).

At every iteration, after the ψ and φ steps and before the θ step, the two parts of the θ gradient are taken
separately on that iteration's rollout batch: g_F = ∇θ F (the RL surrogate, with the retriever ratios) and
g_C = ∇θ λ(G(θ, φ) − G(θ, ψ)) (the coupling term); then the usual θ step runs on F + coupling, as in a run without
the probe (the probe's forwards are extra work, not a change of the update; LoRA dropout, if any, draws anew).
Per iteration it prints ‖g_C‖ / ‖g_F‖, cos(g_C, g_F), cos(g_F + g_C, g_F) and the share of coordinates where the
sign of the whole gradient differs from the sign of g_F (AdamW's first steps are close to sign steps, so there the
θ step goes against the RL gradient). The config's ``WarmStart`` runs first (no evaluation); no validation, no
checkpoints, no landscape probes. Usage::

    python benchmarks/coupling_probe.py --seeds 0 1 2          # configs/demo.yaml, its 4 iterations per seed
    python benchmarks/coupling_probe.py --config tests/configs/tiny.yaml --seeds 0 --max-steps 2   # plumbing
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Checkpoint

from bridge_pl.bilevel import BilevelProblem, BridgeSolver, Updates
from bridge_pl.cli import BridgeCLI
from bridge_pl.problem import RLProblem
from callbacks.landscape import LossLandscape
from callbacks.warm_start import WarmStart

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("coupling_to_rl", "cos_coupling_rl", "cos_step_rl", "sign_flips", "coupling_noise_share",
           "coupling_mean_to_rl")


def split_stats(rl_grad: torch.Tensor, coupling_grad: torch.Tensor) -> dict[str, float]:
    """How the coupling gradient changes the RL gradient. Both ``[P]``, flattened over the θ parameters.

    Returns ``coupling_to_rl`` ‖g_C‖ / ‖g_F‖, ``cos_coupling_rl`` cos(g_C, g_F), ``cos_step_rl`` cos(g_F + g_C, g_F)
    and ``sign_flips``, the share of coordinates with g_F ≠ 0 where sign(g_F + g_C) ≠ sign(g_F).
    """
    total = rl_grad + coupling_grad
    rl_norm = rl_grad.norm()

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))

    moving = rl_grad != 0
    return {
        "coupling_to_rl": float(coupling_grad.norm() / rl_norm.clamp(min=1e-30)),
        "cos_coupling_rl": cos(coupling_grad, rl_grad),
        "cos_step_rl": cos(total, rl_grad),
        "sign_flips": float((total.sign() != rl_grad.sign())[moving].float().mean()) if moving.any() else 0.0,
    }


def search_noise_stats(search_grads: torch.Tensor, rl_grad: torch.Tensor) -> dict[str, float]:
    """How much of the coupling gradient is sampling noise of the credit searches.

    Args:
        search_grads: ``[n, P]`` each credit search's share g_s of the coupling gradient (they sum to g_C; a
            search without weight gives a zero row and still counts in n).
        rl_grad: ``[P]`` g_F.

    With h_s = n g_s, one search's estimate of the coupling, g_C is their mean and V = Σ_s ‖h_s − g_C‖² / (n − 1)
    estimates their variance (trace), so V / n is the part of E‖g_C‖² that the draw of n searches adds. Returns
    ``coupling_noise_share`` (V / n) / ‖g_C‖² (near 1 or above: g_C is mostly noise at this n; 0 with no coupling
    or a single search, where V cannot be estimated) and ``coupling_mean_to_rl`` √max(0, ‖g_C‖² − V / n) / ‖g_F‖,
    the estimated norm of the noise-free coupling relative to g_F. Searches of one trajectory share its prompt, so
    they are not independent draws; V is a rough estimate.
    """
    n = search_grads.shape[0]
    coupling = search_grads.sum(0)
    total = float(coupling.square().sum())
    noise = float((n * search_grads - coupling).square().sum()) / (n - 1) / n if n > 1 else 0.0
    return {"coupling_noise_share": noise / total if total > 0 else 0.0,
            "coupling_mean_to_rl": math.sqrt(max(0.0, total - noise)) / max(float(rl_grad.norm()), 1e-30)}


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """∇ loss w.r.t. ``params``, flattened ``[P]``; zeros where the loss does not reach a parameter."""
    if not loss.requires_grad:
        return torch.cat([torch.zeros(p.numel()) for p in params])
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).detach().float().reshape(-1).cpu()
                      for p, g in zip(params, grads, strict=True)])


class ProbedBridgeSolver(BridgeSolver):
    """``bridge`` with :func:`split_stats` recorded after every iteration's inner (ψ, φ) steps, in ``records``."""

    def __init__(self, solver: BridgeSolver) -> None:
        self.__dict__.update(vars(solver))  # the configured solver's settings and λ schedule
        self.records: list[dict[str, float]] = []

    def inner_steps(self, problem: BilevelProblem, updates: Updates) -> dict[str, float]:
        logs = super().inner_steps(problem, updates)
        params = problem.policy_parameters()
        lam = self.lam.value
        rl_grad = flat_grad(problem.policy_loss(), params)
        coupling_grad = flat_grad(problem.coupling_loss(lam), params)
        search_grads = torch.stack(list(per_search_coupling_grads(problem, lam, params)))
        # the per-search shares must add up to g_C (recorded as a check, not shown in the table)
        sum_error = float((search_grads.sum(0) - coupling_grad).norm() / coupling_grad.norm().clamp(min=1e-30))
        self.records.append({"lambda": lam, **split_stats(rl_grad, coupling_grad),
                             **search_noise_stats(search_grads, rl_grad), "search_sum_error": sum_error})
        return logs


def per_search_coupling_grads(problem: RLProblem, lam: float, params: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``[P]`` per credit search: its share of the coupling gradient (one backward per search; they sum to g_C)."""
    weights = problem.coupling_search_weights(lam)
    if weights is None:
        return
    sequences = problem.batch.credit_sequences
    for s, row in enumerate(weights):
        scores = problem.policy.branch_loglik([sequences[s]], problem.cfg.micro_batch_tokens)[0]
        yield flat_grad((row * scores).sum(), params)


def probed_cli(config: str, seed: int, max_steps: int, runs: Path, overrides: list[str]) -> BridgeCLI:
    """The CLI (not run) for ``max_steps`` bridge iterations of ``config`` at ``seed``, after its warm start, with
    the solver replaced by :class:`ProbedBridgeSolver`."""
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # our own flags are in sys.argv
    cli = BridgeCLI(args=["--config", config, f"--seed_everything={seed}", f"--data.seed={seed}",
                          "--model.mode=bridge", f"--trainer.max_steps={max_steps}", "--trainer.limit_val_batches=0",
                          f"--trainer.default_root_dir={runs / f'seed{seed}'}", *overrides], run=False)
    callbacks = cli.trainer.callbacks
    callbacks[:] = [c for c in callbacks if not isinstance(c, Checkpoint | LossLandscape)]
    for callback in callbacks:
        if isinstance(callback, WarmStart):  # as benchmarks/compare_modes.py: same demonstrations per seed
            callback.seed, callback.evaluate = seed, False
    cli.model.solver = ProbedBridgeSolver(cli.model.solver)
    return cli


def probe(cli: BridgeCLI) -> list[dict[str, float]]:
    """Fit; the per-iteration records."""
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.model.solver.records


def markdown(records: dict[int, list[dict[str, float]]], command: list[str]) -> str:
    lines = [f"`python benchmarks/coupling_probe.py {' '.join(command)}`", "",
             "| seed | iteration | λ | ‖g_C‖ / ‖g_F‖ | cos(g_C, g_F) | cos(g_F + g_C, g_F) | sign flips "
             "| noise share of ‖g_C‖² | noise-free ‖g_C‖ / ‖g_F‖ |",
             "|---|---|---|---|---|---|---|---|---|"]
    for seed, rows in records.items():
        for i, row in enumerate(rows, start=1):
            lines.append(f"| {seed} | {i} | {row['lambda']:.1f} | "
                         + " | ".join(f"{row[c]:.2f}" for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=4, help="bridge iterations per seed (the demo's 4)")
    parser.add_argument("--runs", default="runs/coupling_probe", help="run folders (TensorBoard logs)")
    parser.add_argument("--out", default=None, help="also write the table and the records here (.md, .json)")
    args, overrides = parser.parse_known_args(argv)
    records = {seed: probe(probed_cli(args.config, seed, args.max_steps, Path(args.runs), overrides))
               for seed in args.seeds}
    table = markdown(records, argv)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(table)
        out.with_suffix(".json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
