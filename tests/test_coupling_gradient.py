"""A gradient check of ``bridge``'s coupling term through the real path: the θ-gradient (LoRA) that
``BatchLosses.coupling_loss_parts(λ)`` backpropagates, against λ[G(φ) − G(ψ)] written from docs/method.md
(sections 2 and 4.1, step 5) and differentiated by autograd and by a central finite difference.

The library's path is the one training takes: a real rollout batch of the tiny policy (float32 LoRA, activation
checkpointing on), ℓ_θ from :meth:`Policy.branch_loglik`'s packed rows (a shared prefix, 4-D masks, the rows'
common prompt run once by ``SharedPrefixKV``, several token-budget groups), the detached weights of
:meth:`BatchLosses.coupling_search_weights`, both with the LM-credit graph kept from construction and with ℓ_θ
recomputed. The reference is a float64 copy of the same policy, without checkpointing, packing or bridge-pl's
attention, that scores each ``prefix + branch + target`` as its own sequence and computes, from the spec,

    ℓ(d) = mean log π_θ(target | prefix + branch_d),  Q_s = softmax(ℓ / β),  P_s = softmax(score / τ_r),
    G(·) = mean_s KL(Q_s ‖ P_s(·)),  f(θ) = λ [G(φ) − G(ψ)]   (Q not detached: θ's whole dependence).

Decision rule (fixed before measuring; a failure is a defect of the library, not a reason to loosen it):

(a) g_lib (float32, either path) against g_spec = ∇_θ f (float64 autograd): a defect if
    cos(g_lib, g_spec) < 0.999. Cosine is blind to scale (a wrong λ, β or 1/S′ factor keeps it at 1), so also
    a defect if ‖g_lib − g_spec‖ / ‖g_spec‖ > 1e-3: the library computes in float32, whose accumulated rounding
    over these shapes is of order 1e-6 to 1e-5 relative; 1e-3 leaves two orders of margin and is still far
    stricter than the 4.5 % perpendicular error a cosine of 0.999 allows.
(b) the central difference FD = [f(θ + εv) − f(θ − εv)] / 2ε along a fixed random unit direction v in LoRA space,
    in float64 with ε = 1e-4: its truncation error is O(ε²) ≈ 1e-8 of the derivative's scale and its rounding
    error ≈ 1e-16 |f| / ε ≈ 1e-12, so a defect if |g_spec·v − FD| > 1e-6 |FD| (the reference itself is wrong)
    or |g_lib·v − FD| > 1e-4 |FD| (float32 rounding of g_lib, as in (a), projected on v).

Transformers' Llama computes its RMSNorm in float32 whatever the model's dtype (and its eager attention's softmax),
which puts float32 rounding (≈1e-7 of f) into a float64 model's f and swamps the difference quotient at small ε. The
reference copy therefore gets a float64 RMSNorm (the same formula, :func:`rms_norm_float64`) and plain SDPA
attention, which computes in its inputs' dtype.
"""

from __future__ import annotations

import copy
import json
import types
from dataclasses import dataclass

import pytest
import torch
from helpers import flat_grad, searching, tiny_module
from torch import nn

from bridge_pl.attention import MIN_SHARED_PREFIX
from bridge_pl.batch_losses import BatchLosses
from bridge_pl.module import BridgeModule
from bridge_pl.policy import BranchedSequence, budget_groups
from bridge_pl.rollout.batch import RolloutBatch

LAM = 2.0  # λ, β and τ_r all differ from 1 (and S′ > 1), so a wrong factor of any of them shows
BETA = 0.5
COSINE_MIN = 0.999
REL_ERR_MAX = 1e-3
FD_EPS = 1e-4
FD_SPEC_TOL = 1e-6
FD_LIB_TOL = 1e-4
CREDIT_TOKENS = 1200  # micro_batch_tokens: LM credit's packed rows fall into several groups of 2-3 rows


@dataclass
class Coupled:
    """A module in ``bridge`` mode and a rollout batch with LM credit, θ and ψ set so that the coupling is not 0."""

    module: BridgeModule
    batch: RolloutBatch


@pytest.fixture(scope="module")
def coupled(tmp_path_factory) -> Coupled:
    """The tiny config in ``bridge`` mode (float32 LoRA policy, activation checkpointing, KL off so that no reference
    pass runs), one rollout of 2 questions x 4 samples steered to search twice, 6 credit searches of K′ = 4
    candidates; then LoRA B ~ N(0, 0.05²) and ψ = φ + N(0, 0.05²) noise."""
    tmp = tmp_path_factory.mktemp("coupling")
    qa = tmp / "qa.jsonl"
    qa.write_text("\n".join(json.dumps({"id": f"q{i}", "question": f"Which city is number {i}?",
                                        "golden_answers": ["Paris"]}) for i in range(2)))
    module, data = tiny_module(tmp, "--model.mode=bridge", f"--data.train={qa}", "--data.n_samples=4",
                               "--data.max_response_tokens=400", "--model.rl.kl_coef=0",
                               "--model.policy.init_args.gradient_checkpointing=true",
                               "--model.retrieval.credit_queries=6", f"--model.retrieval.teacher_temperature={BETA}",
                               f"--model.rl.micro_batch_tokens={CREDIT_TOKENS}")
    torch.manual_seed(0)
    with searching(module.policy):  # two searches per trajectory: later contexts hold an earlier observation
        batch = data.rollout(module, data.load(data.train_source), training=True, dataset="train")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.policy.model.named_parameters():
            if "lora_B" in name:  # a non-zero adapter, so that the gradient reaches A as well as B
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for p in module.psi.parameters():  # ψ away from φ: P_ψ ≠ P_φ, so the coupling weights are not 0
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return Coupled(module, batch)


# ---- the spec's scalar, on an unpacked float64 copy ---------------------------------------------------------------
def rms_norm_float64(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm ``w · x / sqrt(mean(x²) + eps)`` over the last dim, in ``hidden``'s own dtype: ``[..., H]``."""
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def float64_reference(policy_model: nn.Module) -> nn.Module:
    """A float64 copy of the policy's peft model, in eval mode (no activation checkpointing), with SDPA attention
    and a float64 RMSNorm: the same function as the policy, computed in float64 throughout."""
    ref = copy.deepcopy(policy_model).double().eval()
    ref.get_base_model().set_attn_implementation("sdpa")
    for module in ref.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(rms_norm_float64, module)
    return ref


def unpacked_lm_credit(model: nn.Module, sequences: list[BranchedSequence]) -> torch.Tensor:
    """ℓ(d) ``[S′, K′]``: mean log-prob of ``target`` after ``prefix + branch_d``, one plain forward per sequence."""
    rows = []
    for seq in sequences:
        scores = []
        for branch in seq.branches:
            ids = torch.tensor([seq.prefix + branch + seq.target])
            n = len(seq.target)
            logits = model(input_ids=ids, logits_to_keep=n + 1).logits[0, :-1]  # [n, V]: the target's predictions
            scores.append(torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).mean())
        rows.append(torch.stack(scores))
    return torch.stack(rows)


def lower_level(lm_scores: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """G = mean_s KL(Q_s ‖ P_s), Q = softmax(ℓ/β), P = softmax(logits): ``[S′, K′] x2 -> []`` (invalid slots out)."""
    log_q = torch.log_softmax(lm_scores.masked_fill(~valid, -torch.inf) / beta, -1)
    log_p = torch.log_softmax(logits.masked_fill(~valid, -torch.inf), -1)
    return torch.where(valid, log_q.exp() * (log_q - log_p), 0.0).sum(-1).mean()


@dataclass
class Spec:
    """f(θ) = λ[G(φ) − G(ψ)] on the float64 reference: its LoRA parameters and a way to evaluate it."""

    model: nn.Module
    params: list[nn.Parameter]
    sequences: list[BranchedSequence]
    phi_logits: torch.Tensor  # [S′, K′] score_φ / τ_r, float64
    psi_logits: torch.Tensor  # [S′, K′] score_ψ / τ_r, float64
    valid: torch.Tensor  # [S′, K′]

    def value(self) -> torch.Tensor:
        ell = unpacked_lm_credit(self.model, self.sequences)
        return LAM * (lower_level(ell, self.phi_logits, self.valid, BETA)
                      - lower_level(ell, self.psi_logits, self.valid, BETA))

    @torch.no_grad()
    def along(self, direction: torch.Tensor, eps: float) -> float:
        """f(θ + eps · direction), θ restored after; ``direction`` ``[N]`` flat over :attr:`params`."""
        saved = [p.clone() for p in self.params]
        offset = 0
        for p in self.params:
            p.add_(eps * direction[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        try:
            return float(self.value())
        finally:
            for p, s in zip(self.params, saved, strict=True):
                p.copy_(s)


@pytest.fixture(scope="module")
def spec(coupled: Coupled) -> tuple[Spec, torch.Tensor]:
    """The reference and g_spec = ∇_θ f ``[N]`` float64 (autograd through the unpacked forwards)."""
    module, batch = coupled.module, coupled.batch
    tau = module.retrieval_config.temperature
    searches = batch.credit_searches
    queries = [batch.search_queries[s] for s in searches.tolist()]
    rows = batch.search_candidates[searches]
    with torch.no_grad():
        phi = module.retriever.score(queries, rows.clamp(min=0)).double() / tau
        psi = module.retriever.score(queries, rows.clamp(min=0), query_encoder=module.psi).double() / tau
    names = [n for n, p in module.policy.model.named_parameters() if p.requires_grad]
    ref = float64_reference(module.policy.model)
    params = [p for n, p in ref.named_parameters() if p.requires_grad]
    assert [n for n, p in ref.named_parameters() if p.requires_grad] == names
    reference = Spec(ref, params, batch.credit_sequences, phi, psi, rows >= 0)
    return reference, flat_grad(reference.value(), params)


@dataclass
class LibraryGradient:
    """What one backward of ``coupling_loss_parts(λ)`` gave, and what the first decoder layer saw meanwhile."""

    grad: torch.Tensor  # [N] float32, over Policy.trainable_parameters()
    with_grad: list[tuple[int, int]]  # (rows, positions) of each grad-enabled input to the layer, in the forwards
    checkpointed: list[tuple[int, int]]  # the same, of the inputs that went through activation checkpointing


def library_gradient(coupled: Coupled, keep_credit_graph: bool) -> LibraryGradient:
    """∇_θ Σ coupling_loss_parts(λ), as the solver's θ step backpropagates it (construction of the batch's losses,
    then the parts, then one backward)."""
    module = coupled.module
    policy = module.policy
    layer = policy.hf_model.model.layers[0]
    with_grad: list[tuple[int, int]] = []
    checkpointed: list[tuple[int, int]] = []
    run = layer._gradient_checkpointing_func  # transformers routes a checkpointed layer's forward through it

    def counted(function, hidden, *args, **kwargs):
        if torch.is_grad_enabled():  # transformers routes no-grad forwards of a training model through it too
            checkpointed.append(tuple(hidden.shape[:2]))
        return run(function, hidden, *args, **kwargs)

    def seen(_, args):
        if torch.is_grad_enabled() and recording:
            with_grad.append(tuple(args[0].shape[:2]))

    recording = True
    layer._gradient_checkpointing_func = counted
    handle = layer.register_forward_pre_hook(seen)
    try:
        problem = BatchLosses(policy, module.retriever, module.psi, None, coupled.batch, module.rl_config,
                              module.retrieval_config, keep_credit_graph=keep_credit_graph)
        loss = sum(problem.coupling_loss_parts(LAM))
        recording = False  # the backward's replays of checkpointed layers are not forwards
        grad = flat_grad(loss, policy.trainable_parameters())
    finally:
        handle.remove()
        layer._gradient_checkpointing_func = run
    return LibraryGradient(grad, with_grad, checkpointed)


@pytest.fixture(scope="module")
def library(coupled: Coupled) -> dict[bool, LibraryGradient]:
    """The library's gradient with the credit graph kept (True) and with ℓ_θ recomputed (False)."""
    return {keep: library_gradient(coupled, keep) for keep in (True, False)}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def test_the_batch_takes_the_packed_checkpointed_path(coupled: Coupled):
    """What the check runs through: checkpointing on in training mode, several token-budget groups of packed rows,
    and a search whose context holds an earlier observation."""
    policy, batch = coupled.module.policy, coupled.batch
    assert policy.model.training and policy.hf_model.is_gradient_checkpointing
    groups = budget_groups([seq.length for seq in batch.credit_sequences], CREDIT_TOKENS)
    assert len(groups) > 1 and any(len(group) > 1 for group in groups)
    traj = batch.search_traj[batch.credit_searches]
    later = [int((batch.search_traj[:s] == t).sum()) for s, t in zip(batch.credit_searches.tolist(), traj.tolist())]
    assert any(later), "want a credit search after an earlier one of its trajectory"


@pytest.mark.parametrize("keep_credit_graph", [True, False], ids=["kept_graph", "recomputed"])
def test_coupling_gradient_is_the_spec_gradient(spec, library, keep_credit_graph: bool):
    """Rule (a): cos(g_lib, g_spec) >= 0.999 and ‖g_lib − g_spec‖ <= 1e-3 ‖g_spec‖."""
    g_spec = spec[1]
    result = library[keep_credit_graph]
    g_lib = result.grad
    # every forward with grad went through activation checkpointing; in a group of packed rows, the rows' common
    # prompt ran once, as one row, before the group's remainders (SharedPrefixKV)
    assert result.with_grad and result.checkpointed == result.with_grad
    shared = [i for i, (rows, length) in enumerate(result.with_grad) if rows == 1 and length >= MIN_SHARED_PREFIX]
    assert any(i + 1 < len(result.with_grad) and result.with_grad[i + 1][0] > 1 for i in shared), result.with_grad
    cosine = _cosine(g_lib, g_spec)
    rel_err = float((g_lib.double() - g_spec).norm() / g_spec.norm())
    assert float(g_spec.norm()) > 0
    assert cosine >= COSINE_MIN, f"cos {cosine}"
    assert rel_err <= REL_ERR_MAX, f"relative error {rel_err} (cos {cosine})"


def test_gradients_agree_with_a_central_difference(spec, library):
    """Rule (b): along a random unit direction v, |g·v − FD| <= 1e-6 |FD| for g_spec, <= 1e-4 |FD| for g_lib."""
    reference, g_spec = spec
    v = torch.randn(g_spec.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    v /= v.norm()
    fd = (reference.along(v, FD_EPS) - reference.along(v, -FD_EPS)) / (2 * FD_EPS)
    assert abs(fd) > 0
    spec_err = abs(float(g_spec @ v) - fd) / abs(fd)
    assert spec_err <= FD_SPEC_TOL, f"spec {float(g_spec @ v)} vs FD {fd}"
    for keep in (True, False):
        g_lib = library[keep].grad.double()
        lib_err = abs(float(g_lib @ v) - fd) / abs(fd)
        assert lib_err <= FD_LIB_TOL, f"keep_credit_graph={keep}: {float(g_lib @ v)} vs FD {fd}"
