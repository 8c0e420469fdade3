"""``BridgeModule``: the LightningModule that holds the policy, the retriever and the solver.

Manual optimization: one ``training_step`` is one training iteration (one rollout batch and all its
updates), so ``trainer.max_steps`` counts iterations, not inner optimizer steps. The solver chosen by
``mode`` decides the order of the updates; this module never branches on the mode.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from bridge_pl import rl
from bridge_pl.batch_losses import BatchLosses, head_values
from bridge_pl.bilevel import ParamUpdate, Updates, make_solver
from bridge_pl.config import RetrievalSampling, RLConfig, SolverConfig, minibatch_problem
from bridge_pl.distributed import (
    FSDP1_REFUSAL,
    ShardedGradients,
    average_replicated_grads,
    gather_per_rank,
    is_fsdp1,
    is_sharded,
    reshard,
    shard_root,
    this_ranks,
)
from bridge_pl.metrics import QAMetrics, StepLogKeys, set_means, valid_action_rate
from bridge_pl.policy import Policy
from bridge_pl.records import Passage
from bridge_pl.retrieval.base import Retriever
from bridge_pl.retrieval.credit import gumbel_topk, plackett_luce_logprob, topk_order
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.rollout.engine import SearchOutcome

Mode = Literal["frozen", "policy_first", "retriever_first", "bridge", "implicit"]  # the solvers of bilevel.SOLVERS


class NonFiniteTrainingError(RuntimeError):
    """Too many iterations in a row had a non-finite loss or gradient (``model.solver.max_nonfinite_skips``)."""


def half_precision_trainables(module: nn.Module) -> dict[str, int]:
    """Trained (``requires_grad``) parameter elements stored in bfloat16 or float16, counted per top-level child."""
    counts: dict[str, int] = {}
    for name, param in module.named_parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
            part = name.split(".", 1)[0]
            counts[part] = counts.get(part, 0) + param.numel()
    return counts


class BridgeModule(L.LightningModule):
    """Policy π_θ + retriever (query encoder φ, reference copy ψ) trained by the solver of ``mode``.

    Args:
        policy: the causal-LM policy (LoRA by default).
        retriever: any :class:`~bridge_pl.retrieval.base.Retriever`, e.g. ``DenseRetriever``; plugged by
            ``class_path`` in YAML.
        mode: the solver: ``frozen`` (Search-R1: policy RL, retriever fixed), ``policy_first`` / ``retriever_first``
            (alternating), ``bridge`` (first-order penalty bilevel) or ``implicit`` (second-order reference).
        rl: the RL losses (:class:`~bridge_pl.config.RLConfig`).
        solver: inner steps, λ schedule and step rules (:class:`~bridge_pl.config.SolverConfig`).
        retrieval: candidates, shown passages, temperatures and LM credit
            (:class:`~bridge_pl.config.RetrievalSampling`).
        policy_optimizer: the policy's optimizer (default AdamW, lr ``POLICY_LR``).
        retriever_optimizer: builds φ's optimizer and, in ``bridge``, ψ's (default AdamW, lr ``RETRIEVER_LR``;
            SGD, lr ``BRIDGE_RETRIEVER_SGD_LR``, in ``bridge``, which refuses anything but SGD).
        critic_optimizer: the PPO value head's optimizer (default AdamW, lr ``CRITIC_LR``).
        policy_scheduler: LR scheduler of the policy's optimizer, stepped once per iteration (null: none).
        retriever_scheduler: LR scheduler of each retriever optimizer, stepped once per iteration (null: none).
    """

    def __init__(
        self,
        policy: Policy,
        retriever: Retriever,
        mode: Mode = "bridge",
        rl: RLConfig = RLConfig(),
        solver: SolverConfig = SolverConfig(),
        retrieval: RetrievalSampling = RetrievalSampling(),
        policy_optimizer: OptimizerCallable | None = None,
        retriever_optimizer: OptimizerCallable | None = None,
        critic_optimizer: OptimizerCallable | None = None,
        policy_scheduler: LRSchedulerCallable | None = None,
        retriever_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        # The groups as plain dicts: checkpoints load with weights_only=True, which refuses arbitrary classes.
        self.save_hyperparameters({"mode": mode, "rl": asdict(rl), "solver": asdict(solver),
                                   "retrieval": asdict(retrieval)})
        self.factories = {
            "policy": policy_optimizer, "retriever": retriever_optimizer, "critic": critic_optimizer,
            "policy_scheduler": policy_scheduler, "retriever_scheduler": retriever_scheduler,
        }
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold what trains, not the frozen base weights
        self._nonfinite_streak = 0  # iterations in a row that skipped an update for a non-finite value
        self._no_signal_streak = 0  # iterations in a row in which θ took no step (no reward signal)
        self.policy = policy
        self.retriever = retriever
        self.rl_config, self.solver_config, self.retrieval_config = rl, solver, retrieval
        self.solver = make_solver(mode, solver)
        if self.solver.trains_retriever and not retriever.trainable:
            raise ValueError(
                f"model.mode='{mode}' trains the retriever, but {type(retriever).__name__} is not trainable; "
                "use mode: frozen with a fixed retriever"
            )
        if not self.solver.trains_retriever and retriever.query_encoder is not None:
            retriever.query_encoder.requires_grad_(False)
        self.psi = copy.deepcopy(retriever.query_encoder) if self.solver.needs_psi else None
        # G depends on a separately trained passage tower too: ψ, G's minimiser, has its own copy of it
        # (a tied tower is the query tower, which ψ already copies)
        separate = getattr(retriever, "passage_encoder", None)
        separate = separate if separate is not retriever.query_encoder else None
        self.psi_passage = copy.deepcopy(separate) if self.solver.needs_psi and separate is not None else None
        self.value_head = nn.Linear(policy.hidden_size, 1) if rl.algorithm == "ppo" else None
        if rl.kl_coef > 0:
            policy.enable_reference_copy()
        self.register_buffer("policy_version", torch.zeros((), dtype=torch.long))
        self.metrics = nn.ModuleDict()  # "<stage>/<dataset>" -> QAMetrics, created on first use
        self.last_eval_batches: dict[str, list[RolloutBatch]] = {}
        self._train_log_keys = StepLogKeys()

    # ---- setup ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self._trainer is not None and is_fsdp1(self.trainer.strategy):
            raise ValueError(FSDP1_REFUSAL)
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if stage == "fit" and (problem := minibatch_problem(self.rl_config.minibatches,
                                                            getattr(datamodule, "n_samples", None))):
            raise ValueError(problem)
        self.retriever.prepare()

    def configure_model(self) -> None:
        """Under ``strategy: fsdp2``: shard the policy (and a PPO value head) with FSDP2 over the data-parallel
        mesh. The retriever towers stay replicated; their gradients are averaged across ranks before each step
        (``bridge_pl.distributed``). Nothing to do under other strategies."""
        mesh = self.device_mesh
        if mesh is None or is_sharded(self.policy.model):
            return
        data_parallel = mesh["data_parallel"] if mesh.mesh_dim_names else mesh
        self.policy.shard(data_parallel)
        if self.value_head is not None:
            shard_root(self.value_head, data_parallel)

    def on_fit_start(self) -> None:
        half = half_precision_trainables(self)
        if half:
            counts = ", ".join(f"{n:,} in {part}" for part, n in half.items())
            rank_zero_warn(
                f"bridge-pl: trained weights are stored in half precision ({counts}; trainer.precision="
                f"{self.trainer.precision}), with no float32 master copy: optimizer steps smaller than the weights' "
                "resolution (about 2^-8 of a weight in bfloat16) are rounded away, so at RL learning rates most of "
                "them never move. Keep trained weights float32 (model.policy.init_args.dtype=float32, or LoRA) and "
                "get bf16 compute from trainer.precision=bf16-mixed."
            )

    def configure_optimizers(self):
        """One optimizer per trained part, by name (``optimizer_names``): ``policy``; ``phi`` (the query encoder,
        plus a separately trained passage tower) and ``psi`` (``bridge``: ψ and its copy of such a passage tower)
        when the retriever trains; ``critic`` (PPO). Schedulers: ``policy_scheduler`` on the policy's,
        ``retriever_scheduler`` on φ's and ψ's."""
        make = self.factories

        def build(factory, params, default: type[torch.optim.Optimizer], lr: float) -> torch.optim.Optimizer:
            return factory(params) if factory is not None else default(params, lr=lr)

        named = {"policy": build(make["policy"], self.policy.trainable_parameters(), torch.optim.AdamW, POLICY_LR)}
        if self.solver.trains_retriever:
            passage_tower = getattr(self.retriever, "passage_encoder", None)
            phi_towers = [self.retriever.query_encoder]
            if passage_tower is not None and passage_tower is not self.retriever.query_encoder:
                phi_towers.append(passage_tower)
            sgd_only = self.solver.lower_level_needs_sgd
            default = (torch.optim.SGD, BRIDGE_RETRIEVER_SGD_LR) if sgd_only else (torch.optim.AdamW, RETRIEVER_LR)
            psi_towers = [t for t in (self.psi, self.psi_passage) if t is not None]
            for name, towers in [("phi", phi_towers)] + ([("psi", psi_towers)] if psi_towers else []):
                params = [p for tower in towers for p in tower.parameters() if p.requires_grad]
                named[name] = build(make["retriever"], params, *default)
                if sgd_only:
                    _require_sgd(named[name], self.solver.name)
        if self.value_head is not None:
            named["critic"] = build(make["critic"], list(self.value_head.parameters()), torch.optim.AdamW, CRITIC_LR)
        scheduler_of = {"policy": make["policy_scheduler"], "phi": make["retriever_scheduler"],
                        "psi": make["retriever_scheduler"]}
        schedulers = [scheduler_of[name](opt) for name, opt in named.items() if scheduler_of.get(name) is not None]
        self.optimizer_names = list(named)
        return list(named.values()), schedulers

    def _updates(self) -> Updates:
        opts = self.optimizers()
        # Raw optimizers: a LightningOptimizer step would count as a trainer step, and one training step
        # here is one whole iteration (see _count_iteration).
        return self.updates_from([o.optimizer for o in (opts if isinstance(opts, list | tuple) else [opts])])

    def updates_from(self, optimizers: Sequence[torch.optim.Optimizer], backward=None) -> Updates:
        """The solver's updates (policy, φ, ψ; the critic steps with the policy) from the optimizers
        :meth:`configure_optimizers` returned, matched by its ``optimizer_names``.

        ``backward`` defaults to Lightning's ``manual_backward`` (needs a trainer).
        """
        solver = self.solver_config
        backward = backward or self.manual_backward
        named = dict(zip(self.optimizer_names, optimizers, strict=True))
        policy_opt = named["policy"]
        if "critic" in named:  # the critic head trains in the same backward as the policy
            policy_opt = _JointOptimizer([policy_opt, named["critic"]])
        clip = solver.grad_clip_retriever
        # FSDP2 reduces the policy's sharded gradients; the replicated retriever towers need it done
        sharded = is_sharded(self.policy.model)
        sync = average_replicated_grads if sharded else None
        return Updates(
            policy=ParamUpdate(policy_opt, backward, solver.grad_clip_policy, name="policy",
                               on_step=self._reshard_policy if sharded else None,
                               sharded=ShardedGradients(self._sharded_roots(), self._zero_pass) if sharded else None),
            phi=ParamUpdate(named["phi"], backward, clip, self.retriever.bump_version, name="phi", sync_grads=sync)
            if "phi" in named else None,
            psi=ParamUpdate(named["psi"], backward, clip, name="psi", sync_grads=sync) if "psi" in named else None,
        )

    def _reshard_policy(self) -> None:
        """Under FSDP2, drop the gathered copies of the sharded roots. After a policy step they hold θ before the step
        (the optimizer steps the shards, and the roots do not reshard after forward or backward), so a later forward
        of the same iteration (the next mini-batch or epoch, a refreshed LM teacher) gathers the new θ; at the end
        of an iteration this frees the gathered weights until the next rollout gathers them."""
        for root in self._sharded_roots():
            reshard(root)

    def _sharded_roots(self) -> list[nn.Module]:
        """The FSDP2 roots of ``configure_model``: the policy, and the value head under PPO."""
        return [self.policy.model] + ([self.value_head] if self.value_head is not None else [])

    def _zero_pass(self) -> torch.Tensor:
        """A zero loss through every sharded unit (the policy on two tokens, and the value head): its backward
        reduces the policy gradients accumulated over a rank's own micro-batches (``ShardedGradients``)."""
        ids = torch.full((1, 2), self.policy.tokenizer.eos_token_id or 0, dtype=torch.long, device=self.device)
        logp, _, hidden = self.policy(ids, torch.ones_like(ids))
        loss = logp.sum() * 0.0
        if self.value_head is not None:
            loss = loss + head_values(self.value_head, hidden.detach()).sum() * 0.0
        return loss

    # ---- retrieval during rollouts ---------------------------------------------------------------
    @torch.no_grad()
    def retrieve(
        self, queries: list[str], stochastic: bool, generator: torch.Generator | None = None
    ) -> list[SearchOutcome]:
        """Search K′ candidates per query, then sample k of them (Plackett-Luce) or take the top k."""
        if not queries:
            return []
        sampling = self.retrieval_config
        scores, rows = self.retriever.search(queries, sampling.candidates)
        valid = rows >= 0
        k = sampling.top_k
        if int(valid.sum(-1).min()) < k:
            raise ValueError(
                f"{type(self.retriever).__name__} returned fewer than model.retrieval.top_k={k} candidates for a "
                "query; the corpus is smaller than top_k"
            )
        logits = scores.float() / sampling.temperature
        if stochastic:
            order = gumbel_topk(logits, k, generator=generator, valid=valid)
            logprob = plackett_luce_logprob(logits, order, valid=valid)
        else:
            order = topk_order(logits, k, valid=valid)
            logprob = torch.zeros(len(queries), dtype=torch.float32)
        outcomes = []
        for q in range(len(queries)):
            cand = rows[q][valid[q]].tolist()
            shown = rows[q, order[q]].tolist()
            outcomes.append(
                SearchOutcome(
                    candidate_rows=cand, passage_rows=shown, logprob=float(logprob[q]),
                    passages=[self.retriever.passage(r) for r in shown],
                )
            )
        return outcomes

    @property
    def keeps_credit_graph(self) -> bool:
        """Whether :meth:`problem` keeps the LM-credit forward's graph for the coupling backward (its docstring)."""
        return self.solver.uses_coupling and self.policy.gradient_checkpointing

    def problem(self, batch: RolloutBatch, **overrides) -> BatchLosses:
        """The losses of ``batch`` with this module's parts and settings (``overrides``: BatchLosses's keyword
        arguments, e.g. ``old_logprobs`` for a probe).

        The LM-credit forward's graph is kept for the coupling backward when the solver couples and the policy
        checkpoints its activations: the kept graph then holds each layer's input only. Without checkpointing it
        would hold every layer's activations for all the batch's credit tokens through the whole update, so the
        coupling recomputes ℓ_θ one token-budget group at a time instead (one more forward over the credit tokens).
        """
        overrides.setdefault("keep_credit_graph", self.keeps_credit_graph)
        return BatchLosses(self.policy, self.retriever, self.psi, self.value_head, batch, self.rl_config,
                           self.retrieval_config, psi_passage=self.psi_passage, **overrides)

    # ---- what the rollout DataModule asks for (bridge_pl.rollout.agent.RolloutAgent) -----------------
    def passage(self, row: int) -> Passage:
        return self.retriever.passage(row)

    def versions(self) -> tuple[int, int]:
        return int(self.policy_version), self.retriever.version

    def credit_queries(self) -> int:
        return self.retrieval_config.credit_queries if self.solver.trains_retriever else 0

    # ---- training -------------------------------------------------------------------------------
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        if batch.policy_version != int(self.policy_version) or batch.retriever_version != self.retriever.version:
            raise RuntimeError(
                f"off-policy batch: generated by policy v{batch.policy_version}/retriever v{batch.retriever_version}, "
                f"module is at v{int(self.policy_version)}/v{self.retriever.version}"
            )
        start = time.perf_counter()
        problem = self.problem(batch)
        updates = self._updates()
        logs = self.solver.step(problem, updates)
        logs["nonfinite/skipped"] = self._guard_nonfinite(updates.nonfinite())
        self.policy_version += 1
        self._count_iteration()
        if is_sharded(self.policy.model):  # free the gathered weights until the next rollout gathers them again
            self._reshard_policy()
            if self.policy.reference is not None:  # full fine-tuning's KL reference
                reshard(self.policy.reference)
        for scheduler in self._schedulers():
            scheduler.step()
        logs.update(problem.stats)
        logs.update(
            {
                "train/reward": float(batch.rewards.mean()),
                "train/groups_with_signal": float(rl.groups_with_signal(batch.rewards, batch.group_ids)),
                "train/searches": float(batch.num_searches.float().mean()),
                "train/turns": float(batch.turns.float().mean()),
                # a policy drifting out of the action format (unclosed or stray tags) shows here during training
                "train/valid_action_rate": float(
                    valid_action_rate(batch.valid_actions, batch.valid_actions + batch.invalid_actions)
                ),
                "train/response_tokens": float(batch.action_mask.sum(-1).mean()),
                "retriever/version": float(self.retriever.version),
                "update/seconds": time.perf_counter() - start,  # everything after the rollout (rollout/seconds)
            }
        )
        logs.update({f"rollout/{name}": value for name, value in batch.sampling.items()})
        self._watch_no_signal(logs)
        self.log_dict(self._train_log_keys.fill(logs), batch_size=batch.batch_size)
        self._log_at_iterations_done(batch_size=batch.batch_size)
        self.log("reward", logs["train/reward"], prog_bar=True, logger=False, batch_size=batch.batch_size)

    def _log_at_iterations_done(self, **kwargs) -> None:
        """Put this hook's logged values at TensorBoard step = RL iterations done (``policy_version``).

        Lightning's own x-axis counts the batches before the current one: iteration 1's metrics, and a validation
        run after iteration 2, would land at steps 0 and 1, while the warm start's dev EM (``WarmStart``) and the
        landscape probes are written at the iterations done, 0 before the first. A logged ``step`` value replaces
        Lightning's step for every value it sends to the loggers with it (a training batch's, or an evaluation
        epoch's, callbacks' included). ``policy_version`` equals ``trainer.global_step`` in ``fit`` and is saved in
        checkpoints, so ``validate``/``test`` from a checkpoint log at its iteration too (their global step is 0),
        as ``QAEval`` names its predictions files."""
        self.log("step", float(self.policy_version), **kwargs)

    def _guard_nonfinite(self, bad: dict[str, list[str]]) -> float:
        """Report updates skipped for a non-finite loss or gradient; stop after ``max_nonfinite_skips`` in a row.

        Returns 1.0 if this iteration skipped one (the ``nonfinite/skipped`` metric), else 0.0.
        """
        if not bad:
            self._nonfinite_streak = 0
            return 0.0
        self._nonfinite_streak += 1
        what = ", ".join(f"{name} ({' and '.join(sorted(set(kinds)))})" for name, kinds in bad.items())
        message = (f"step {self.trainer.global_step if self._trainer else 0}: non-finite {what}; "
                   "those updates were skipped (weights, optimizer state and λ unchanged)")
        if self._nonfinite_streak >= self.solver_config.max_nonfinite_skips:
            raise NonFiniteTrainingError(
                f"{message}. That is {self._nonfinite_streak} iterations in a row (model.solver.max_nonfinite_skips="
                f"{self.solver_config.max_nonfinite_skips}): stopping. Lower the learning rates, check the rewards and "
                "the data, or resume from the last checkpoint."
            )
        rank_zero_warn(message)
        return 1.0

    def _watch_no_signal(self, logs: dict[str, float]) -> None:
        """Warn once when θ has taken no step for ``warn_no_signal_after`` iterations in a row.

        GRPO's advantages are zero in a group whose rewards are all equal, so such a streak means the rollouts
        give θ nothing to learn from: at reward 0 the policy has usually lost the action format (a collapse it
        cannot leave by itself, since every later group is 0 too), at reward 1 the questions are too easy.
        """
        self._no_signal_streak = self._no_signal_streak + 1 if logs.get("policy/skipped") == 1.0 else 0
        if self._no_signal_streak != self.solver_config.warn_no_signal_after:
            return
        rank_zero_warn(
            f"iteration {int(self.policy_version)}: θ has taken no step for {self._no_signal_streak} iterations in a "
            f"row, since no group of trajectories had differing rewards (train/reward {logs['train/reward']:.3f}, "
            f"train/valid_action_rate {logs['train/valid_action_rate']:.2f}). At reward 0 the policy has likely "
            "lost the action format and will not recover (resume from an earlier checkpoint with a lower "
            "learning rate, or check the loss mask); at reward 1 the questions are too easy. "
            f"(model.solver.warn_no_signal_after={self.solver_config.warn_no_signal_after})"
        )

    def _count_iteration(self) -> None:
        """Advance ``trainer.global_step`` by exactly one per iteration, however many inner steps ran."""
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    def _schedulers(self) -> list:
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return []
        return list(schedulers) if isinstance(schedulers, list | tuple) else [schedulers]

    # ---- evaluation -----------------------------------------------------------------------------
    def _eval_step(self, batch: RolloutBatch, stage: str) -> None:
        key = f"{stage}/{batch.dataset}"
        if key not in self.metrics:
            self.metrics[key] = QAMetrics().to(self.device)
        self.metrics[key].update_from_rollouts(batch)
        self.last_eval_batches.setdefault(key, []).append(batch)

    def _eval_epoch_end(self, stage: str) -> None:
        per_dataset = {}
        for key, metric in self.metrics.items():
            if not key.startswith(stage + "/"):
                continue
            values = {name: float(v) for name, v in metric.compute().items()}
            per_dataset[key] = values
            self.log_dict({f"{key}/{name}": v for name, v in values.items()}, sync_dist=False)
            metric.reset()
        # the unweighted means over datasets (val/em, val/f1, ...) and over MIRAGE subsets (val/mirage/accuracy, ...)
        for name, mean in set_means(per_dataset, stage).items():
            self.log(name, mean, prog_bar=name == f"{stage}/em")
        self._log_at_iterations_done()  # also for what callbacks log at this epoch's end

    def on_validation_epoch_start(self) -> None:
        self.last_eval_batches = {k: v for k, v in self.last_eval_batches.items() if not k.startswith("val/")}

    def validation_step(self, batch: RolloutBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_start(self) -> None:
        self.last_eval_batches = {k: v for k, v in self.last_eval_batches.items() if not k.startswith("test/")}

    def test_step(self, batch: RolloutBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def predict_step(self, batch: RolloutBatch, batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        return [
            {"id": i, "question": q, "response": r, "prediction": a, "golden_answers": g}
            for i, q, r, a, g in zip(batch.example_ids, batch.questions, batch.responses, batch.answers, batch.golds)
        ]

    # ---- checkpoints ----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep what trains (adapters, query encoders, value head, versions), drop frozen base weights."""
        trained = {n for n, p in self.named_parameters() if p.requires_grad}
        buffers = {"policy_version", "retriever._update_count", "policy._extra_state"}  # + the KL reference
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trained | buffers}
        checkpoint["bridge"] = {
            "solver": self.solver.state_dict(),
            "rng": gather_per_rank(_rng_state()),  # each rank's own streams (rank 0 writes the file)
        }
        index_tower = getattr(self.retriever, "index_tower_state", lambda: None)()
        if index_tower is not None:  # a trained passage tower: the weights behind the (maybe stale) index
            checkpoint["bridge"]["index_tower"] = index_tower

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("bridge", {})
        self.solver.load_state_dict(state.get("solver", {}) or self.solver.state_dict())
        if "rng" in state:
            _set_rng_state(this_ranks(state["rng"]))
        if "index_tower" in state:
            self.retriever.restore_index(state["index_tower"])


# Default learning rates when the YAML names no optimizer.
POLICY_LR = 1e-5  # AdamW on the policy's trainable parameters
RETRIEVER_LR = 1e-5  # AdamW on φ in the alternating and implicit modes
BRIDGE_RETRIEVER_SGD_LR = 0.05  # SGD on φ and ψ in ``bridge`` (φ's step is then scaled by 1/(1+λ))
CRITIC_LR = 1e-4  # AdamW on the PPO value head


def _require_sgd(optimizer: torch.optim.Optimizer, mode: str) -> None:
    """``bridge``'s step rule for φ and ψ is an SGD rule; refuse adaptive optimizers (docs/method.md 4.3)."""
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(
            f"model.retriever_optimizer: mode '{mode}' needs torch.optim.SGD for the query encoder φ and its copy ψ, "
            f"got {type(optimizer).__name__}. The penalty method's 1/(1+λ) step rule holds for SGD steps; an "
            "adaptive optimizer normalises the gradient's scale away, loses track of the lower-level solution as λ "
            "grows, and the coupling term multiplies that error by λ (the toy problem of docs/method.md section 8 "
            "diverges under Adam). Use e.g. {class_path: torch.optim.SGD, init_args: {lr: 0.05}}."
        )


class _JointOptimizer:
    """Steps several optimizers as one (the PPO critic head trains in the policy's backward)."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def _rng_state() -> dict:
    """Python, NumPy and torch RNG states as tensors/ints (loadable with ``weights_only=True``)."""
    version, py_state, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": torch.tensor(py_state, dtype=torch.long),
        "python_version": version,
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict) -> None:
    random.setstate((state["python_version"], tuple(state["python"].tolist()), None))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
