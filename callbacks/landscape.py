"""``LossLandscape``: periodic loss-landscape probes of the policy and the retriever (docs/method.md section 7).

What is probed, on a probe fixed once (at the first probe) and reused at every later one:

- ``policy``: the policy surrogate F (``BatchLosses.policy_loss``: clipped GRPO/PPO loss + KL) w.r.t. the
  policy's trainable parameters (LoRA adapters) on a fixed rollout batch, the training batch of the first
  probe step (kept on CPU, LM-credit sequences dropped). Advantages and π_old (the policy's log-probs when
  the probe was built) are those of that batch.
- ``retriever``: the retrieval loss G = mean_s KL(Q_s ‖ P_φ(·|s)) w.r.t. the query encoder φ on fixed
  queries, fixed candidates and a fixed teacher Q = softmax(ℓ/β). ``teacher="lm"`` (default): the loss the
  solver minimises: the batch's LM-credit searches (at most ``probe_queries``), their K′ candidates and
  ℓ = ℓ_θ(d) scored by the policy when the probe is built (docs/method.md section 2); a batch without
  credit searches falls back to ``answer``. ``teacher="answer"``: the first ``probe_queries`` distinct
  questions of the batch, top-K′ candidates by the retriever at probe-creation time (K′ =
  ``model.retrieval.candidates``), ℓ = 1 where a gold answer occurs in the passage as whole words
  (``bridge_pl.rewards.contains_answer``: SQuAD-normalised tokens), else 0.
  ``teacher="random"``: those queries and candidates with ℓ ~ N(0, 1) from the seeded generator.

For each target: a 1-D slice L(θ + αδ) with ``slice_points`` α in [−span, span], a ``grid_points`` ×
``grid_points`` grid L(θ + αδ + βη), and the sharpness (top Hessian eigenvalue, power iteration with
finite-difference HVPs). δ, η and the power-iteration start are redrawn from ``seed`` at every probe (same
draws, rescaled to the current weights), so probes are comparable over training. In ``bridge`` mode the
PL constant of G along the ψ inner loop is estimated: ``pl_steps`` plain gradient-descent steps (lr
``pl_lr``) on G(ψ) from the current ψ, recording (G, ‖∇G‖²) — plain GD rather than ψ's AdamW
because the PL inequality is a statement about gradient descent — then ψ is restored.

When: at the start of every training step whose ``global_step`` is a multiple of ``every_n_steps`` (so
step 0 shows the initial landscape; the probe sees the weights that step starts from) and, with
``at_fit_end``, once more at the end of fit on the final weights. Probing leaves every parameter
bit-identical, the modules' train/eval flags as they were, and the global RNGs untouched (losses are
evaluated in eval mode, random draws use a private generator), so a run with the callback trains exactly
as one without it.

Outputs (rank 0): scalars ``landscape/<target>/{loss,sharpness,slice_rise,grid_rise}`` and
``landscape/retriever/pl_mu`` to every logger; one image per target ``landscape/<target>`` (1-D curve +
2-D contour, matplotlib Agg canvas) to TensorBoard loggers; raw arrays in ``<log_dir>/landscape/step<k>.npz``.
``self.last`` holds the latest scalars.

Multi-process: every rank computes the probe over the same data (rank 0's probe batch and queries are
broadcast when the probe is created) and the same parameters, so all ranks get the same numbers as one
process would; only rank 0 writes. Computing on every rank rather than rank 0 alone is what sharded
parameters need (every rank takes part in each forward). DDP: parameters are full on every rank. FSDP2
(``strategy: fsdp2``): the probe moves each rank's shards of θ by the same full-size direction sharded like the
parameter, evaluates with the gathered weights dropped first (so the moved shards are used), takes gradients by a
backward pass, and restores the shards bit-exactly (``bridge_pl.loss_surface``). Both are tested over gloo against one
process. Tensor parallelism is not supported: the callback warns and does nothing.

The probe data lives in the callback only (not in checkpoints): a resumed run builds a new probe at its
first probe step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal, NamedTuple, get_args

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from bridge_pl import loss_surface
from bridge_pl.batch_losses import lower_level_loss
from bridge_pl.config import require_choice
from bridge_pl.distributed import is_sharded, reshard
from bridge_pl.eval_mode import eval_mode
from bridge_pl.files import atomic_write
from bridge_pl.rewards import contains_answer
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.seeding import derive_seed

Target = Literal["policy", "retriever"]
Teacher = Literal["lm", "answer", "random"]
TARGETS: tuple[Target, ...] = get_args(Target)


class PolicyProbe(NamedTuple):
    """F's fixed probe data: a rollout batch (CPU) and the log-probs its surrogate holds fixed."""

    rollout: RolloutBatch
    old_logprobs: torch.Tensor  # [B, T] π_old of the rollout on its loss tokens
    ref_logprobs: torch.Tensor | None  # [B, T] the KL reference's log-probs there (None: no KL term)


class RetrieverProbe(NamedTuple):
    """G's fixed probe data: queries, their candidate rows ``[Q, K′]`` and teacher scores ℓ ``[Q, K′]``."""

    queries: list[str]
    rows: torch.Tensor
    teacher_scores: torch.Tensor


class Probe(NamedTuple):
    """The fixed probe data of each probed target (None for a target not probed: it costs a policy pass)."""

    policy: PolicyProbe | None
    retriever: RetrieverProbe | None


class LossLandscape(pl.Callback):
    """Filter-normalised slices, 2-D grids, sharpness and a PL estimate, logged to TensorBoard and .npz.

    Args:
        every_n_steps: probe when ``global_step % every_n_steps == 0`` (at the start of that step).
        targets: any of ``policy`` (LoRA/θ on F) and ``retriever`` (φ on G).
        slice_points: α values of the 1-D slice (odd includes α = 0).
        grid_points: points per axis of the 2-D grid.
        span: coordinates range over [−span, span] (units of filter-normalised directions).
        power_iters: power-iteration steps for the sharpness; fd_eps: finite-difference step.
        pl_steps, pl_lr: gradient-descent steps and step size of the ψ trace (0 steps: no PL estimate).
        probe_queries: fixed queries of the G probe.
        teacher: ``lm`` | ``answer`` | ``random``, the fixed teacher scores ℓ of the G probe (module docstring).
        zero_row_norm: direction norm for all-zero weight rows (LoRA B at init); 0 leaves them unprobed.
        seed: seeds the directions, the power-iteration start and the random teacher.
        at_fit_end: probe once more on the final weights.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        targets: list[Target] | tuple[Target, ...] = TARGETS,
        slice_points: int = 11,
        grid_points: int = 5,
        span: float = 1.0,
        power_iters: int = 10,
        fd_eps: float = 1e-3,
        pl_steps: int = 10,
        pl_lr: float = 0.1,
        probe_queries: int = 8,
        teacher: Teacher = "lm",
        zero_row_norm: float = 0.0,
        seed: int = 0,
        at_fit_end: bool = True,
    ) -> None:
        for name, value, low in [("every_n_steps", every_n_steps, 1), ("slice_points", slice_points, 2),
                                 ("grid_points", grid_points, 2), ("power_iters", power_iters, 1),
                                 ("pl_steps", pl_steps, 0), ("probe_queries", probe_queries, 1)]:
            if value < low:
                raise ValueError(f"LossLandscape option '{name}' must be >= {low}, got {value}")
        for name, value in [("span", span), ("fd_eps", fd_eps), ("pl_lr", pl_lr)]:
            if value <= 0:
                raise ValueError(f"LossLandscape option '{name}' must be > 0, got {value}")
        if zero_row_norm < 0:
            raise ValueError(f"LossLandscape option 'zero_row_norm' must be >= 0, got {zero_row_norm}")
        if not targets:
            raise ValueError(f"LossLandscape option 'targets' must name at least one of {list(TARGETS)}")
        for target in targets:
            require_choice("LossLandscape option 'targets'", target, Target)
        require_choice("LossLandscape option 'teacher'", teacher, Teacher)
        self.every_n_steps, self.targets = every_n_steps, tuple(targets)
        self.slice_points, self.grid_points, self.span = slice_points, grid_points, span
        self.power_iters, self.fd_eps, self.pl_steps, self.pl_lr = power_iters, fd_eps, pl_steps, pl_lr
        self.probe_queries, self.teacher, self.zero_row_norm = probe_queries, teacher, zero_row_norm
        self.seed, self.at_fit_end = seed, at_fit_end
        self.probe: Probe | None = None
        self.last: dict[str, float] = {}
        self.probed_steps: list[int] = []

    # ---- hooks --------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: RolloutBatch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step in self.probed_steps or not self._supported(trainer):
            return
        if self.probe is None:
            self.probe = trainer.strategy.broadcast(self._build_probe(pl_module, batch), src=0)
        self.run(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_fit_end and self.probe is not None and trainer.global_step not in self.probed_steps:
            self.run(trainer, pl_module)

    def _supported(self, trainer: pl.Trainer) -> bool:
        mesh = getattr(trainer.strategy, "_device_mesh", None)
        if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            rank_zero_warn("LossLandscape does not support tensor parallelism; no probes run.")
            return False
        return True

    # ---- the probe data -----------------------------------------------------------------------
    def _build_probe(self, pl_module: pl.LightningModule, batch: RolloutBatch) -> Probe:
        """Fixed probe data from this rank's current training batch (rank 0's is then broadcast), for the targets
        probed only: F's needs a policy pass over the whole batch, G's with ``teacher="lm"`` one over its credit
        searches."""
        return Probe(self._f_probe(pl_module, batch) if "policy" in self.targets else None,
                     self._g_probe(pl_module, batch) if "retriever" in self.targets else None)

    def _f_probe(self, pl_module: pl.LightningModule, batch: RolloutBatch) -> PolicyProbe:
        """F's probe: the batch without its credit sequences, π_old and the reference's log-probs on it."""
        rollout = self._build_rollout(batch)
        with torch.no_grad():
            problem = pl_module.problem(move_data_to_device(rollout, pl_module.device), keep_credit_graph=False)
            old_logprobs = problem.old_logprobs().cpu()
        # the reference stays fixed while the probe moves θ: keep its log-probs (= π_old when it is the policy)
        ref_logprobs = None
        if pl_module.rl_config.kl_coef:
            ref_logprobs = old_logprobs if problem.ref_logprobs is None else problem.ref_logprobs.cpu()
        return PolicyProbe(rollout, old_logprobs, ref_logprobs)

    def _g_probe(self, pl_module: pl.LightningModule, batch: RolloutBatch) -> RetrieverProbe:
        """G's probe: queries, candidate rows ``[Q, K′]`` and teacher scores ℓ ``[Q, K′]``; see ``teacher``."""
        if self.teacher == "lm" and batch.credit_searches.numel():
            searches = batch.credit_searches[: self.probe_queries]
            queries = [batch.search_queries[i] for i in searches.tolist()]
            with torch.no_grad():
                teacher = pl_module.policy.branch_loglik(batch.credit_sequences[: len(queries)]).float().cpu()
            return RetrieverProbe(queries, batch.search_candidates[searches].cpu(), teacher)
        if self.teacher == "lm":
            rank_zero_info("LossLandscape: the probe batch has no LM-credit searches; G uses teacher='answer'.")
        questions = list(dict.fromkeys(batch.questions))[: self.probe_queries]
        golds = {q: g for q, g in zip(batch.questions, batch.golds)}
        retriever = pl_module.retriever
        _, rows = retriever.search(questions, pl_module.retrieval_config.candidates)
        if self.teacher == "random":
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "random_teacher"))
            teacher = torch.randn(rows.shape, generator=generator)
        else:
            teacher = torch.tensor(
                [[float(r >= 0 and contains_answer(retriever.passage(r).contents, golds[q])) for r in row]
                 for q, row in zip(questions, rows.tolist())]
            )
        return RetrieverProbe(questions, rows, teacher)

    @staticmethod
    def _build_rollout(batch: RolloutBatch) -> RolloutBatch:
        """The batch on CPU, without LM-credit sequences (F needs none; BatchLosses would score them)."""
        no_credit = torch.zeros(0, dtype=torch.long)
        return replace(move_data_to_device(batch, "cpu"), credit_searches=no_credit, credit_sequences=[])

    # ---- probing ------------------------------------------------------------------------------
    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, dict[str, np.ndarray]]:
        """Probe every target now; log and save on rank 0. Returns ``{target: arrays}``."""
        assert self.probe is not None
        step = trainer.global_step
        results: dict[str, dict[str, np.ndarray]] = {}
        sharded = is_sharded(pl_module.policy.model)
        if sharded:  # FSDP2: the parameters are then the sharded DTensors (gathered units expose full copies)
            reshard(pl_module.policy.model)
        with eval_mode(pl_module):
            for target in self.targets:
                spec = self._target(pl_module, target)
                if spec is not None:  # a seed per target name: draws do not depend on which targets are on
                    results[target] = self._probe_target(*spec, seed=derive_seed(self.seed, "directions", target))
            psi = getattr(pl_module, "psi", None)
            if "retriever" in results and psi is not None and self.pl_steps > 0:
                params = [p for p in psi.parameters() if p.requires_grad]
                g_psi = self._g_loss(pl_module, psi)
                losses, grad_sq = loss_surface.descent_trace(g_psi, params, self.pl_lr, self.pl_steps)
                results["retriever"].update(
                    pl_losses=np.array(losses), pl_grad_sq=np.array(grad_sq),
                    pl_mu=np.array(loss_surface.pl_estimate(losses, grad_sq)),
                )
        if sharded:  # the gathered copies hold the last probed point, not θ
            reshard(pl_module.policy.model)
        self.probed_steps.append(step)
        self.last = _scalars(results)
        # every rank asks: trainer.log_dir is a collective (a broadcast from rank 0)
        out = Path(trainer.log_dir or trainer.default_root_dir) / "landscape"
        if trainer.is_global_zero:
            self._write(trainer, out, step, results)
        return results

    def _target(
        self, pl_module: pl.LightningModule, target: str
    ) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]] | None:
        """(loss closure, parameters) of ``target``, or None (said once) when it has nothing to probe."""
        if target == "policy":
            probe = self.probe.policy
            rollout = move_data_to_device(probe.rollout, pl_module.device)
            problem = pl_module.problem(rollout, keep_credit_graph=False,
                                        old_logprobs=probe.old_logprobs.to(pl_module.device),
                                        ref_logprobs=move_data_to_device(probe.ref_logprobs, pl_module.device))
            if not is_sharded(pl_module.policy.model):
                return problem.policy_loss, pl_module.policy.trainable_parameters()

            def policy_loss() -> torch.Tensor:  # FSDP2: drop gathered weights so the probe's moved shards are used
                reshard(pl_module.policy.model)
                return problem.policy_loss()

            return policy_loss, pl_module.policy.trainable_parameters()
        encoder = pl_module.retriever.query_encoder
        params = [p for p in encoder.parameters() if p.requires_grad] if encoder is not None else []
        if not params:
            if not self.probed_steps:
                rank_zero_info("LossLandscape: the retriever has no trainable query encoder; not probing it.")
            return None
        return self._g_loss(pl_module, None), params

    def _g_loss(
        self, pl_module: pl.LightningModule, encoder: torch.nn.Module | None
    ) -> Callable[[], torch.Tensor]:
        """G(encoder) = mean_s KL(Q_s ‖ P(·|s)) on the fixed probe (``encoder=None``: φ)."""
        probe, retrieval = self.probe.retriever, pl_module.retrieval_config
        valid = probe.rows >= 0

        def loss() -> torch.Tensor:
            scores = pl_module.retriever.score(probe.queries, probe.rows.clamp(min=0), query_encoder=encoder)
            teacher, mask = probe.teacher_scores.to(scores.device), valid.to(scores.device)
            return lower_level_loss(scores.float() / retrieval.temperature, teacher, mask, retrieval)

        return loss

    def _probe_target(
        self, loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor], seed: int
    ) -> dict[str, np.ndarray]:
        generator = torch.Generator().manual_seed(seed)
        delta = loss_surface.filter_normalized_direction(params, generator, self.zero_row_norm)
        eta = loss_surface.filter_normalized_direction(params, generator, self.zero_row_norm)
        alphas = torch.linspace(-self.span, self.span, self.slice_points, dtype=torch.float64)
        grid = torch.linspace(-self.span, self.span, self.grid_points, dtype=torch.float64)
        with torch.no_grad():
            center = float(loss_fn())
        sharpness, history = loss_surface.top_hessian_eigenvalue(
            loss_fn, params, generator, iters=self.power_iters, eps=self.fd_eps
        )
        return {
            "loss": np.array(center),
            "alphas": alphas.numpy(),
            "slice": loss_surface.slice_1d(loss_fn, params, delta, alphas).numpy(),
            "grid_coords": grid.numpy(),
            "grid": loss_surface.grid_2d(loss_fn, params, (delta, eta), grid, grid).numpy(),
            "sharpness": np.array(sharpness),
            "power_history": np.array(history),
        }

    # ---- outputs ------------------------------------------------------------------------------
    def _write(
        self, trainer: pl.Trainer, out: Path, step: int, results: dict[str, dict[str, np.ndarray]]
    ) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(self.last, step=step)
            if isinstance(logger, TensorBoardLogger):
                for target, arrays in results.items():
                    logger.experiment.add_image(f"landscape/{target}", _render(target, arrays, step), step,
                                                dataformats="HWC")
        out.mkdir(parents=True, exist_ok=True)
        flat = {f"{target}_{name}": v for target, arrays in results.items() for name, v in arrays.items()}
        atomic_write(out / f"step{step}.npz", lambda f: np.savez(f, step=np.array(step), **flat))


def _scalars(results: dict[str, dict[str, np.ndarray]]) -> dict[str, float]:
    """``landscape/<target>/...``: centre loss, sharpness, highest rise above the centre on slice and grid."""
    out = {}
    for target, a in results.items():
        out[f"landscape/{target}/loss"] = float(a["loss"])
        out[f"landscape/{target}/sharpness"] = float(a["sharpness"])
        out[f"landscape/{target}/slice_rise"] = float(a["slice"].max() - a["loss"])
        out[f"landscape/{target}/grid_rise"] = float(a["grid"].max() - a["loss"])
        if "pl_mu" in a:
            out[f"landscape/{target}/pl_mu"] = float(a["pl_mu"])
    return out


def _render(target: str, a: dict[str, np.ndarray], step: int) -> np.ndarray:
    """``[H, W, 3]`` uint8: the 1-D slice, the 2-D contour and (when present) the ψ descent trace."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = 3 if "pl_losses" in a else 2
    fig = Figure(figsize=(4 * panels, 3.4), dpi=80)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, panels, 1)
    ax.plot(a["alphas"], a["slice"], marker="o")
    ax.set(xlabel="α", ylabel="loss", title=f"{target}: L(θ+αδ), step {step}")
    ax = fig.add_subplot(1, panels, 2)
    coords = a["grid_coords"]
    contour = ax.contourf(coords, coords, a["grid"].T, levels=15)  # rows of grid are α (x), columns β (y)
    fig.colorbar(contour, ax=ax)
    ax.set(xlabel="α", ylabel="β", title=f"L(θ+αδ+βη), λmax≈{float(a['sharpness']):.3g}")
    if panels == 3:
        ax = fig.add_subplot(1, panels, 3)
        ax.plot(a["pl_losses"], marker=".")
        ax.set(xlabel="GD step on ψ", ylabel="G", title=f"ψ trace, μ̂≈{float(a['pl_mu']):.3g}")
    fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()

