"""The losses of one rollout batch: the :class:`~bridge_pl.bilevel.BilevelProblem` the solvers step on.

Upper level F: the clipped RL surrogate on policy-generated tokens (θ) and the policy-gradient credit
for the retrieved lists (φ). Lower level G: KL(Q_θ ‖ P_φ), the LM-supervised retrieval loss, on the
search calls chosen for LM credit (docs/method.md sections 2-4).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from bridge_pl import rl
from bridge_pl.config import RetrievalSampling, RLConfig
from bridge_pl.distributed import any_across_ranks
from bridge_pl.eval_mode import eval_mode
from bridge_pl.miss_analysis import check_gold_passages
from bridge_pl.policy import Policy, budget_groups, length_sorted_groups
from bridge_pl.retrieval.base import Retriever
from bridge_pl.retrieval.credit import (
    coupling_weights,
    gold_candidate_mask,
    lm_supervised_kl,
    plackett_luce_logprob,
)
from bridge_pl.rollout.batch import RolloutBatch


def lower_level_loss(
    logits: torch.Tensor,
    teacher_scores: torch.Tensor,
    valid: torch.Tensor,
    retrieval: RetrievalSampling,
    detach_teacher: bool = True,
) -> torch.Tensor:
    """The lower-level loss G = mean over searches s of KL(Q_θ,s ‖ P_φ,s), in nats (docs/method.md section 3).

    Args:
        logits: ``[S, K′]`` retriever logits over each search's candidates, already divided by τ_r
            (``retrieval.temperature``), so P_φ,s = softmax(logits).
        teacher_scores: ``[S, K′]`` teacher scores ℓ (the LM's log-likelihood of the gold answer given each
            candidate, in nats); Q_θ,s = softmax(ℓ / β) with β = ``retrieval.teacher_temperature``.
        valid: ``[S, K′]`` bool, False on padded candidate slots.
        detach_teacher: no gradient into the teacher (True except in the ``implicit`` mode's cross term).
    """
    kl = lm_supervised_kl(logits, teacher_scores, 1.0, retrieval.teacher_temperature, valid=valid,
                          detach_teacher=detach_teacher)
    return kl.mean()


def head_values(value_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """PPO's value head on the policy's last hidden states: ``[..., H] -> [...]`` float32 values.

    The head runs in its own dtype (float32, or bfloat16 when a ``bf16-true`` trainer converted the module), so
    ``hidden`` is cast to it; the values come back float32 for the advantage and loss math.
    """
    return value_head(hidden.to(value_head.weight.dtype)).float().squeeze(-1)


def minibatch_row_groups(lengths: Sequence[int], minibatches: int, token_budget: int) -> list[list[list[int]]]:
    """The rows of a batch as mini-batches of micro-batches: ``[mini-batch][micro-batch] -> row indices``.

    The rows, in batch order, are cut into ``minibatches`` contiguous parts whose sizes differ by at most one (the
    first ones larger; GRPO's groups are contiguous, so with rows a multiple of the group size per part each
    group stays in one part); each part is split into micro-batches of at most ``token_budget`` padded tokens,
    shortest rows first (:func:`~bridge_pl.policy.length_sorted_groups`). ``lengths`` ``[B]``: each row's tokens.
    Raises ValueError when there are fewer rows than mini-batches.
    """
    if len(lengths) < minibatches:
        raise ValueError(f"model.rl.minibatches ({minibatches}) is more than the batch's {len(lengths)} rows")
    size, extra = divmod(len(lengths), minibatches)
    out, start = [], 0
    for k in range(minibatches):
        rows = list(range(start, start + size + (k < extra)))
        start += len(rows)
        out.append([[rows[i] for i in group]
                    for group in length_sorted_groups([lengths[r] for r in rows], token_budget)])
    return out


class BatchLosses:
    """Losses of one batch. Quantities that do not change during the iteration are computed once here.

    What is computed once (docs/method.md, "What one iteration computes"): advantages; the reference
    log-probs (skipped when the reference is the current policy or ``kl_coef == 0``); the LM-credit scores
    ℓ_θ (with their graph kept when ``keep_credit_graph``, so the coupling backward reuses that forward); the
    log-probs of the shown passage lists under φ at the start of the iteration. π_old's log-probs are the
    first policy forward of each micro-batch, detached, kept for later epochs; those of mini-batches 2..M
    (``model.rl.minibatches``) are taken here, before any step.

    Args:
        policy: π_θ.
        retriever: the retriever (its ``query_encoder`` is φ).
        psi: ψ, the reference copy of the query encoder (``bridge`` mode), else None.
        psi_passage: ψ's copy of a separately trained passage tower (``passage_tower: trainable``), which scores
            the passages of G(ψ); None: G(ψ) uses the retriever's own passage side (frozen, or tied to ψ).
        value_head: the PPO critic head, else None.
        batch: the rollout batch (on the module's device).
        config: loss settings.
        retrieval: retrieval sampling and credit settings (τ_r of P_φ, β of the LM teacher).
        keep_credit_graph: compute ℓ_θ with grad and keep its graph for :meth:`coupling_loss_parts`.
        old_logprobs: ``[B, T]`` π_old on the loss tokens, when it is not the current policy (e.g. a landscape
            probe evaluating F away from the weights that generated the batch); default: the first forward.
        ref_logprobs: ``[B, T]`` reference log-probs on the loss tokens, precomputed (same use); default: a
            reference pass, skipped when the reference is the current policy.
    """

    def __init__(
        self,
        policy: Policy,
        retriever: Retriever,
        psi: nn.Module | None,
        value_head: nn.Module | None,
        batch: RolloutBatch,
        config: RLConfig,
        retrieval: RetrievalSampling,
        keep_credit_graph: bool = False,
        old_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        psi_passage: nn.Module | None = None,
    ) -> None:
        self.policy, self.retriever, self.psi, self.value_head = policy, retriever, psi, value_head
        self.psi_passage = psi_passage
        self.batch, self.cfg, self.retrieval = batch, config, retrieval
        self.stats: dict[str, float] = {}
        # The loss mask: policy tokens only, unless the ablation also trains on observations.
        self.mask = batch.action_mask if config.mask_observations else self._all_response_tokens()
        # Mini-batches (one optimizer step each), each split into micro-batches of rows of similar length (each is
        # padded to its longest row; in batch order, the demo's update computed 21-23 % padding on two batches
        # measured, 3-12 % sorted)
        lengths = batch.attention_mask.sum(-1).tolist()
        device = batch.input_ids.device
        self._row_groups: list[torch.Tensor] = []  # micro-batch index -> its rows [b]
        self._minibatches: list[list[int]] = []  # mini-batch index -> its micro-batch indices
        for groups in minibatch_row_groups(lengths, config.minibatches, config.micro_batch_tokens):
            self._minibatches.append(list(range(len(self._row_groups), len(self._row_groups) + len(groups))))
            self._row_groups += [torch.tensor(rows, device=device) for rows in groups]
        self._old_logprobs: dict[int, torch.Tensor] = {}  # micro-batch index -> π_old log-probs [b, T_b]
        if old_logprobs is not None:
            self._old_logprobs = {i: old_logprobs[self._cols(rows)] for i, rows in enumerate(self._row_groups)}
        with torch.no_grad():
            self.ref_logprobs = ref_logprobs if ref_logprobs is not None else self._reference_logprobs()
            self.seq_advantages, self.advantages, self.old_values, self.returns = self._advantages()
            searched = batch.search_traj.numel() > 0
            self._shown_logprob_old = self._shown_logprob() if searched and self.phi_parameters() else None
            self._signal_minibatches = self._minibatches_with_signal()
            # the rows the steps train on: the policy/ stats are their aggregate, whichever parts stepped
            self._stepped_rows = (torch.cat([self._minibatch_rows(k) for k in self._signal_minibatches])
                                  if self._signal_minibatches else None)
            # θ will have moved by the time a later mini-batch steps: its π_old is the sampling policy's, now
            self._fill_old_logprobs([i for k in self._signal_minibatches[1:] for i in self._minibatches[k]])
        self.lm_scores: torch.Tensor | None = None
        self._coupling_logits: tuple[torch.Tensor, torch.Tensor] | None = None  # [S', K'] φ's, ψ's, no grad
        self._credit_graph: torch.Tensor | None = None
        if batch.credit_searches.numel():
            if keep_credit_graph:
                self._credit_graph = self._lm_scores()
                self.lm_scores = self._credit_graph.detach()
            else:
                with torch.no_grad():
                    self.lm_scores = self._lm_scores()

    # ---- precomputation -------------------------------------------------------------------------
    def _all_response_tokens(self) -> torch.Tensor:
        """``[B, T]``: every non-pad token after the prompt (policy tokens and observations)."""
        first = self.batch.action_mask.argmax(-1, keepdim=True)
        positions = torch.arange(self.batch.input_ids.shape[1], device=first.device)
        after_prompt = (positions >= first) & self.batch.action_mask.any(-1, keepdim=True)
        return (after_prompt & self.batch.attention_mask.bool()).float()

    def _cols(self, rows: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """The cells of the rows ``rows`` (indices ``[b]``), the trailing padding they all share trimmed."""
        return rows, slice(0, int(self.batch.attention_mask[rows].sum(-1).max()))

    def _forward_rows(self, cols: tuple[torch.Tensor, slice], score_mask: torch.Tensor | None = None, **kwargs):
        """:meth:`Policy.forward` on the batch cells ``cols``, scoring the loss tokens unless ``score_mask``.

        Log-probs are those of the sampling policy: logits divided by the batch's sampling temperature.
        """
        batch = self.batch
        mask = self.mask[cols] if score_mask is None else score_mask
        return self.policy(batch.input_ids[cols], batch.attention_mask[cols], score_mask=mask,
                           temperature=batch.temperature, **kwargs)

    def _reference_logprobs(self) -> torch.Tensor | None:
        """``[B, T]`` reference log-probs on the loss tokens; None when the KL term is off or would be 0."""
        if self.cfg.kl_coef == 0 or self.policy.reference_is_current():
            return None
        out = torch.zeros_like(self.mask)
        with self.policy.reference_mode() as model:
            for rows in self._row_groups:
                cols = self._cols(rows)
                out[cols] = self._forward_rows(cols, model=model)[0]
        return out

    @torch.no_grad()
    def _fill_old_logprobs(self, micro_batches: list[int]) -> None:
        """π_old of the micro-batches ``micro_batches`` not yet seen: a no-grad forward of the current policy."""
        for i in micro_batches:
            if i not in self._old_logprobs:
                self._old_logprobs[i] = self._forward_rows(self._cols(self._row_groups[i]))[0]

    @torch.no_grad()
    def old_logprobs(self) -> torch.Tensor:
        """``[B, T]`` π_old on the loss tokens (0 elsewhere); micro-batches not yet seen get a no-grad forward."""
        self._fill_old_logprobs(list(range(len(self._row_groups))))
        out = torch.zeros_like(self.mask)
        for i, rows in enumerate(self._row_groups):
            out[self._cols(rows)] = self._old_logprobs[i]
        return out

    def _advantages(self):
        batch, cfg = self.batch, self.cfg
        if cfg.algorithm == "grpo":
            seq = rl.grpo_advantages(batch.rewards, batch.group_ids, scale_by_std=cfg.scale_by_std)
            return seq, rl.broadcast_to_tokens(seq, self.mask), None, None
        values = torch.zeros_like(self.mask)
        for rows in self._row_groups:
            cols = self._cols(rows)
            hidden = self._forward_rows(cols, score_mask=torch.zeros_like(self.mask[cols]))[2]  # no LM head
            values[cols] = head_values(self.value_head, hidden)
        token_rewards = torch.zeros_like(self.mask)
        last = (self.mask * torch.arange(self.mask.shape[1], device=self.mask.device)).argmax(-1)
        token_rewards[torch.arange(len(last)), last] = batch.rewards
        adv, returns = rl.gae(token_rewards, values, self.mask, cfg.gamma, cfg.gae_lambda)
        adv = rl.masked_whiten(adv, self.mask)
        seq = rl.masked_mean(adv, self.mask, dim=-1)
        return seq, adv, values, returns

    def _lm_scores(self) -> torch.Tensor:
        """ℓ_θ(d) ``[S', K']``: mean log-prob of the gold answer tokens with only candidate d retrieved."""
        return self.policy.branch_loglik(self.batch.credit_sequences, self.cfg.micro_batch_tokens)

    def _shown_logprob(self) -> torch.Tensor:
        """``[S]`` log P_φ(shown list) of every search under the current φ (eval mode, no grad)."""
        batch = self.batch
        every = torch.arange(batch.search_traj.numel(), device=batch.search_traj.device)
        with eval_mode(self.retriever), torch.no_grad():
            logits = self._scores(every, None)
        return plackett_luce_logprob(logits, batch.search_order, valid=batch.search_valid)

    def retriever_ratios(self) -> torch.Tensor:
        """``[B]`` r_i = P_φ(D_i) / P_φ_old(D_i) over trajectory i's shown lists, clipped to [1 − ε_low, 1 + ε_high].

        The off-policy weight of trajectory i in the θ surrogate after φ has stepped (docs/method.md section 4);
        exactly 1 before any φ step, and 1 when the retriever does not train.
        """
        batch, cfg = self.batch, self.cfg
        ratios = torch.ones(batch.batch_size, dtype=torch.float32, device=self.mask.device)
        if self._shown_logprob_old is None:
            return ratios
        log_ratio = torch.zeros(batch.batch_size, dtype=torch.float32, device=self.mask.device).index_add_(
            0, batch.search_traj, self._shown_logprob() - self._shown_logprob_old
        )
        ratios = log_ratio.clamp(max=rl.MAX_LOG_RATIO).exp()
        clipped = ratios.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        self.stats["retriever/ratio_mean"] = float(ratios.mean())
        self.stats["retriever/ratio_clip_fraction"] = float((clipped != ratios).float().mean())
        return clipped

    def _part_weight(self, rows: torch.Tensor, within: torch.Tensor | None = None) -> torch.Tensor:
        """Share of the aggregate over the rows ``within`` (default: the whole batch) that the rows ``rows`` carry,
        so that parts sum to the whole."""
        amount = self.mask.sum(-1) if self.cfg.loss_agg == "token-mean" else (self.mask.sum(-1) > 0).float()
        total = amount.sum() if within is None else amount[within].sum()
        return amount[rows].sum() / total.clamp(min=1)

    def _minibatch_rows(self, minibatch: int) -> torch.Tensor:
        return torch.cat([self._row_groups[i] for i in self._minibatches[minibatch]])

    def _minibatches_with_signal(self) -> list[int]:
        """The mini-batches whose trajectories carry a reward signal for θ on some rank (GRPO: a non-zero
        advantage; PPO: always), so that all ranks step the same ones."""
        return [k for k in range(len(self._minibatches)) if any_across_ranks(
            self.value_head is not None or bool((self.seq_advantages[self._minibatch_rows(k)] != 0).any()))]

    # ---- the BilevelProblem protocol ------------------------------------------------------------
    def policy_parameters(self) -> list[torch.Tensor]:
        return self.policy.trainable_parameters()

    def phi_parameters(self) -> list[torch.Tensor]:
        encoder = self.retriever.query_encoder
        return [p for p in encoder.parameters() if p.requires_grad] if encoder is not None else []

    def psi_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.psi.parameters() if p.requires_grad] if self.psi is not None else []

    def signal_minibatches(self) -> list[int]:
        """The mini-batches (``model.rl.minibatches``) with a non-zero advantage (GRPO: some group's rewards
        differ) on any rank, in order: the policy steps on these, the same ones on every rank."""
        return self._signal_minibatches

    def policy_loss(self) -> torch.Tensor:
        return sum(self.policy_loss_parts())

    def policy_loss_parts(self, minibatch: int | None = None) -> Iterator[torch.Tensor]:
        """The policy loss over token-budget micro-batches of rows, each weighted by its share of the aggregate:
        that of the whole batch, or of mini-batch ``minibatch`` (the loss of that mini-batch's step).

        The ``policy/`` stats are reset by the whole batch or the first mini-batch with signal, and each part adds
        its share of the whole batch, or of the rows of the mini-batches with signal, so that over one pass they
        add up as the aggregate over the rows the steps trained on.
        """
        if minibatch is None or minibatch in self._signal_minibatches[:1]:
            for key in [k for k in self.stats if k.startswith(("policy/", "critic/", "rollout/"))]:
                del self.stats[key]
        micro_batches = range(len(self._row_groups)) if minibatch is None else self._minibatches[minibatch]
        within = None if minibatch is None else self._minibatch_rows(minibatch)
        stats_within = None if minibatch is None else self._stepped_rows
        advantages = self.policy_advantages()
        for i in micro_batches:
            rows = self._row_groups[i]
            weight = self._part_weight(rows, within)
            if weight > 0:
                stats_weight = float(self._part_weight(rows, stats_within))
                yield weight * self._policy_loss_rows(i, advantages[self._cols(rows)], stats_weight)

    def policy_advantages(self) -> torch.Tensor:
        """``[B, T]`` advantages of the θ surrogate at the current φ (docs/method.md section 4.2).

        Each trajectory carries its retriever ratio r_i. GRPO: r_i (R_i − b_g) / σ_g around the r-weighted group
        baseline b_g, so each group's advantages still sum to 0 (:func:`rl.grpo_advantages`); PPO: the per-token
        advantages times r_i. Before any φ step (or with a frozen retriever) r = 1 and these are the batch's
        advantages.
        """
        if self._shown_logprob_old is None:
            return self.advantages
        ratios = self.retriever_ratios()
        if self.cfg.algorithm == "grpo":
            batch = self.batch
            seq = rl.grpo_advantages(batch.rewards, batch.group_ids, scale_by_std=self.cfg.scale_by_std, weights=ratios)
            return rl.broadcast_to_tokens(seq, self.mask)
        return self.advantages * ratios[:, None]

    def _policy_loss_rows(self, group: int, adv: torch.Tensor, weight: float) -> torch.Tensor:
        """F on the trajectories of micro-batch ``group`` with their token advantages ``adv`` ``[b, T_b]``; adds
        ``weight`` × its stats to ``stats``."""
        cfg = self.cfg
        cols = self._cols(self._row_groups[group])
        mask = self.mask[cols]
        logp, entropy, hidden = self._forward_rows(cols, entropy=True, entropy_grad=bool(cfg.entropy_coef))
        old = self._old_logprobs.setdefault(group, logp.detach())  # π_old: this first forward, detached
        clip = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip)
        values = {}
        weights = None
        if self.batch.sampler_logprobs is not None and self.mask is self.batch.action_mask:
            mismatch = rl.truncated_is_weights(old, self.batch.sampler_logprobs[cols], mask, cfg.tis_cap)
            values["rollout/sampler_logprob_gap"] = mismatch.mean_abs_gap
            if cfg.tis_cap is not None:
                weights = mismatch.weights
                values["rollout/tis_truncated_share"] = mismatch.truncated_share
        loss = rl.policy_loss(logp, old, adv, mask, agg=cfg.loss_agg, token_weights=weights, **clip)
        stats = rl.policy_loss_stats(logp, old, adv, mask, **clip)
        values |= {
            "policy/clip_fraction": stats.clip_fraction,
            "policy/approx_kl": stats.approx_kl,
            "policy/entropy": float(rl.masked_mean(entropy.detach(), mask)),
        }
        if cfg.kl_coef and self.ref_logprobs is None:  # the reference is the current policy: KL and its grad are 0
            values["policy/kl_ref"] = 0.0
        elif self.ref_logprobs is not None:
            kl = rl.agg_loss(rl.kl_penalty(logp, self.ref_logprobs[cols], cfg.kl_kind), mask, cfg.loss_agg)
            values["policy/kl_ref"] = float(kl.detach())
            loss = loss + cfg.kl_coef * kl
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * rl.agg_loss(entropy, mask, cfg.loss_agg)
        if self.value_head is not None:
            pred = head_values(self.value_head, hidden.detach())
            vloss = rl.value_loss(pred, self.old_values[cols], self.returns[cols], mask, clip=cfg.value_clip,
                                  agg=cfg.loss_agg)
            values["critic/value_loss"] = float(vloss.detach())
            loss = loss + cfg.value_coef * vloss
        for key, value in values.items():
            self.stats[key] = self.stats.get(key, 0.0) + weight * float(value)
        return loss

    def _scores(self, searches: torch.Tensor, encoder: nn.Module | None) -> torch.Tensor:
        """Retriever scores / τ of the candidates of ``searches``: ``[S'] -> [S', K']`` (padding slots arbitrary).

        ``encoder``: φ (None) or ψ; ψ scores with its own copy of a trained passage tower when it has one.
        """
        batch = self.batch
        queries = [batch.search_queries[i] for i in searches.tolist()]
        rows = batch.search_candidates[searches]
        towers = {"query_encoder": encoder}
        if encoder is not None and encoder is self.psi and self.psi_passage is not None:
            towers["passage_encoder"] = self.psi_passage
        scores = self.retriever.score(queries, rows.clamp(min=0), **towers).float()
        return scores / self.retrieval.temperature

    def retriever_upper_loss(self) -> torch.Tensor:
        """−mean_i A_i Σ_j log P_φ(D_ij): REINFORCE credit of trajectory i's advantage to its retrieved lists."""
        batch = self.batch
        S = batch.search_traj.numel()
        if S == 0:
            return self._zero_phi()
        every = torch.arange(S, device=batch.search_traj.device)
        logits = self._scores(every, None)
        logp = plackett_luce_logprob(logits, batch.search_order, valid=batch.search_valid)
        credit = self.seq_advantages[batch.search_traj].detach()
        return -(credit * logp).sum() / batch.batch_size

    def lower_loss(self, encoder: str, detach_teacher: bool = True) -> torch.Tensor:
        if self.lm_scores is None:
            return self._zero_phi()
        batch = self.batch
        module = self.psi if encoder == "psi" else None
        logits = self._scores(batch.credit_searches, module)
        lm = self.lm_scores if detach_teacher else self._lm_scores()
        valid = batch.search_valid[batch.credit_searches]
        return lower_level_loss(logits, lm, valid, self.retrieval, detach_teacher=detach_teacher)

    @torch.no_grad()
    def refresh_teacher(self) -> None:
        if self.lm_scores is not None:
            self._credit_graph = None  # built by the old θ
            self.lm_scores = self._lm_scores()

    @torch.no_grad()
    def coupling_search_weights(self, lam: float) -> torch.Tensor | None:
        """``[S', K']`` the coupling's weight on ℓ_θ(d) of each credit search's candidates, w_s(d) / S', with the
        batch's teacher Q(θ) (the θ that sampled it).

        Detached; 0 on padding slots; None when there is no coupling (no LM credit, λ = 0 or no ψ). Row s times
        that search's ℓ_θ, summed, is search s's share of the coupling loss (the mean over s of G is taken here).
        Records ``bridge/lower_gap``, G(φ) − G(ψ) with this teacher (also at λ = 0), and ``bridge/gold_weight_mean``,
        the mean w_s(d) over the candidates that are gold passages of their question (absent when none is known).
        """
        if self.lm_scores is None or self.psi is None:
            return None
        searches = self.batch.credit_searches
        valid = self.batch.search_valid[searches]
        self._coupling_logits = (self._scores(searches, None), self._scores(searches, self.psi))
        phi, psi = self._coupling_logits
        beta = self.retrieval.teacher_temperature
        gap = (lm_supervised_kl(phi, self.lm_scores, 1.0, beta, valid=valid)
               - lm_supervised_kl(psi, self.lm_scores, 1.0, beta, valid=valid))
        self.stats["bridge/lower_gap"] = float(gap.mean())
        if lam == 0:
            return None
        weights = coupling_weights(self.lm_scores, phi, psi, 1.0, beta, lam, valid=valid)
        gold = self._gold_candidates() & valid
        if gold.any():
            self.stats["bridge/gold_weight_mean"] = float(weights[gold].mean())
        return (weights / searches.numel()).masked_fill(~valid, 0.0)

    def _gold_candidates(self) -> torch.Tensor:
        """``[S', K']`` bool: candidate d of credit search s is a gold passage of s's question
        (``metadata["gold_passages"]``, any hop); all False for a question without gold labels."""
        batch = self.batch
        searches = batch.credit_searches.tolist()
        rows = batch.search_candidates[batch.credit_searches].tolist()
        ids = [[self.retriever.passage(r).id if r >= 0 else None for r in row] for row in rows]
        gold = []
        for s in searches:
            traj = int(batch.search_traj[s])
            hops = check_gold_passages(batch.metadata[traj].get("gold_passages"), f"trajectory {traj}")
            gold.append({i for hop in hops for i in hop} if hops else None)
        return gold_candidate_mask(ids, gold).to(batch.search_valid.device)

    @torch.no_grad()
    def _group_weights(self, group: list[int], lm_scores: torch.Tensor, lam: float) -> torch.Tensor:
        """``[len(group), K']`` w_s(d) / S' of the credit searches ``group`` with the teacher of ``lm_scores``
        ``[len(group), K']`` (ℓ_θ at the current θ) and the retriever scores :meth:`coupling_search_weights` took."""
        searches = self.batch.credit_searches
        valid = self.batch.search_valid[searches][group]
        phi, psi = (logits[group] for logits in self._coupling_logits)
        weights = coupling_weights(lm_scores, phi, psi, 1.0, self.retrieval.teacher_temperature, lam, valid=valid)
        return (weights / searches.numel()).masked_fill(~valid, 0.0)

    def coupling_loss_parts(self, lam: float) -> Iterator[torch.Tensor]:
        """Σ_{s,d} w_s(d) ℓ_θ(d): one weighted backward through the LM-credit forward, at the current θ.

        Uses the graph kept from construction when there is one (consumed here; it was built by the θ that sampled
        the batch, the θ of the first pass's first step). Otherwise ℓ_θ is recomputed with grad, one token-budget
        group of searches at a time, and each group's weights are computed from those scores: in a later pass
        (``policy_epochs`` > 1) θ has moved, and the gradient of G(θ, ·) at that θ needs its teacher Q(θ) too.
        """
        weights = self.coupling_search_weights(lam)
        if weights is None:
            return
        batch = self.batch
        self.stats["bridge/coupling_weight_abs"] = float(weights.abs().sum())
        if self._credit_graph is not None:
            graph, self._credit_graph = self._credit_graph, None
            yield (weights * graph).sum()
            return
        sequences = batch.credit_sequences
        for group in budget_groups([seq.length for seq in sequences], self.cfg.micro_batch_tokens):
            if weights[group].abs().sum() > 0:  # 0 exactly where P_φ = P_ψ, whatever the teacher
                scores = self.policy.branch_loglik([sequences[i] for i in group], self.cfg.micro_batch_tokens)
                yield (self._group_weights(group, scores.detach(), lam) * scores).sum()

    def _zero_phi(self) -> torch.Tensor:
        """A zero that still belongs to φ's graph (so optimizers see zero grads, not missing ones)."""
        params = self.phi_parameters()
        return sum(p.sum() * 0.0 for p in params) if params else torch.zeros((), dtype=torch.float32)
