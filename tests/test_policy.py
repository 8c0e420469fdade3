"""Policy: chunked masked log-probs, the adapter-off reference, peft-format adapters, PPO value head."""

import warnings

import pytest
import torch
from helpers import fit_tiny
from peft import PeftModel

from bridge_pl.batch_losses import minibatch_row_groups
from bridge_pl.models import load_causal_lm
from bridge_pl.policy import (
    BranchedSequence,
    Policy,
    budget_groups,
    enable_activation_checkpointing,
    length_sorted_groups,
)
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.rollout.engine import SearchCall, SearchOutcome, Trajectory


@torch.no_grad()
def reference_logprobs(policy: Policy, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probs under the KL reference, as the RL losses score it (``BatchLosses``'s reference pass)."""
    with policy.reference_mode() as model:
        return policy(ids, attn, model=model)[0]

def test_chunked_logprobs_equal_full_softmax():
    policy = Policy("tiny-llama", dtype="float32", lora_r=4, logprob_chunk=3)
    ids = torch.randint(0, 1000, (2, 10))
    attn = torch.ones(2, 10, dtype=torch.long)
    attn[1, :3] = 0  # left padding
    logp, entropy, _ = policy(ids, attn, entropy=True)
    logits = policy.model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    log_softmax = logits.log_softmax(-1)[:, :-1]
    full = log_softmax.gather(-1, ids[:, 1:, None]).squeeze(-1)
    full_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    real = attn[:, 1:].bool()  # padding is not scored
    assert torch.allclose(logp[:, 1:][real], full[real], atol=1e-5)
    assert torch.allclose(entropy[:, 1:][real], full_entropy[real], atol=1e-5)
    assert torch.all(logp[:, 0] == 0) and torch.all(entropy[:, 1:][real] > 0) and torch.all(logp[:, 1:][~real] == 0)
    assert torch.allclose(policy.logprobs(ids, attn, micro_batch=1), logp.detach(), atol=1e-5)


def test_reference_is_the_adapter_disabled():
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = torch.randint(0, 1000, (1, 8))
    attn = torch.ones_like(ids)
    base = load_causal_lm("tiny-llama")
    base_logp = base(ids).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(reference_logprobs(policy, ids, attn)[:, 1:], base_logp, atol=1e-5)
    assert not torch.allclose(policy(ids, attn)[0][:, 1:], base_logp, atol=1e-3)
    # only adapters train, and only adapters are checkpointed
    assert all("lora_" in k for k in policy.trained_state_dict())


def test_adapter_saves_in_peft_format(tmp_path):
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    policy.save_adapter(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_causal_lm("tiny-llama"), tmp_path / "adapter")
    ids = torch.randint(0, 1000, (1, 6))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, policy.model(ids).logits, atol=1e-5)


def test_rollout_batch_masks_token_by_token():
    outcome = SearchOutcome(candidate_rows=[5, 2, 7], passage_rows=[7, 5], logprob=-1.5, passages=[])
    traj = Trajectory(
        prompt_index=0, prompt_ids=[10, 11, 12], response_ids=[20, 21, 30, 31, 32, 22],
        action_mask=[1, 1, 0, 0, 0, 1], response_text="", searches=[SearchCall("q", 1, outcome, 2)],
        turns=2, valid_actions=2, invalid_actions=0, finished=True,
    )
    short = Trajectory(
        prompt_index=1, prompt_ids=[10], response_ids=[40], action_mask=[1], response_text="", searches=[],
        turns=1, valid_actions=1, invalid_actions=0, finished=True,
    )
    batch = RolloutBatch.from_trajectories(
        [traj, short], pad_token_id=0, answers=["a", None], rewards=[1.0, 0.0], golds=[["a"], ["b"]],
        questions=["q1", "q2"], example_ids=["1", "2"], metadata=[{}, {}], policy_version=3, retriever_version=4,
    )
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32, 22], [10, 40, 0, 0, 0, 0, 0, 0, 0]]
    assert batch.action_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 9, [1, 1] + [0] * 7]
    assert batch.search_candidates.tolist() == [[5, 2, 7]] and batch.search_order.tolist() == [[2, 0]]
    assert batch.shown_rows(0) == [7, 5] and batch.num_searches.tolist() == [1, 0]
    assert batch.group_ids.tolist() == [0, 1] and batch.search_logprob.tolist() == [-1.5]


def test_rebased_reference_is_the_policy_at_that_moment_and_travels_in_the_state_dict():
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    ids = torch.randint(0, 1000, (2, 8))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # "warm-started"
    warm = policy.logprobs(ids, attn)
    policy.rebase_reference()
    assert torch.allclose(reference_logprobs(policy, ids, attn), warm, atol=1e-6)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)  # RL moves the policy; the reference stays
    trained = {k: v.clone() for k, v in policy.trained_state_dict().items()}
    assert torch.allclose(reference_logprobs(policy, ids, attn), warm, atol=1e-6)
    assert not torch.allclose(policy.logprobs(ids, attn), warm, atol=1e-3)
    assert all(torch.equal(v, policy.trained_state_dict()[k]) for k, v in trained.items())  # swapped back
    fresh = Policy("tiny-llama", dtype="float32", lora_r=4)
    fresh.load_state_dict(policy.state_dict())
    assert torch.allclose(reference_logprobs(fresh, ids, attn), warm, atol=1e-6)


def test_policy_loaded_from_an_adapter_is_its_own_reference(tmp_path):
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    policy.save_adapter(tmp_path / "adapter")
    loaded = Policy("tiny-llama", dtype="float32", adapter=str(tmp_path / "adapter"))
    ids = torch.randint(0, 1000, (2, 8))
    attn = torch.ones_like(ids)
    assert torch.allclose(reference_logprobs(loaded, ids, attn), policy.logprobs(ids, attn), atol=1e-5)


def test_branch_loglik_equals_scoring_each_branch_alone():
    torch.manual_seed(0)
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    prefix, target = [5, 6, 7, 8], [40, 41, 42]
    seqs = [
        BranchedSequence(prefix, [[11, 12], [13], [14, 15, 16]], target),
        BranchedSequence([9, 10], [[17], [18, 19], [20]], [43]),
    ]
    packed = policy.branch_loglik(seqs, token_budget=8)  # a budget below one row: one row per group
    assert packed.shape == (2, 3)
    for n, seq in enumerate(seqs):
        for k, branch in enumerate(seq.branches):
            ids = torch.tensor([seq.prefix + branch + seq.target])
            logp = policy(ids, torch.ones_like(ids))[0][0, -len(seq.target):]
            assert torch.allclose(packed[n, k], logp.mean(), atol=1e-5)
    # gradients flow into the adapter through the packed row
    packed.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())


def test_head_runs_only_on_scored_positions():
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    ids = torch.randint(0, 1000, (2, 9))
    attn = torch.ones_like(ids)
    score = torch.zeros(2, 9, dtype=torch.bool)
    score[0, 4:7] = True
    score[1, 8] = True
    full, _, _ = policy(ids, attn)
    part, entropy, _ = policy(ids, attn, score_mask=score, entropy=True)
    assert torch.allclose(part[score], full[score], atol=1e-6)
    assert torch.all(part[~score] == 0) and torch.all(entropy[score] > 0) and torch.all(entropy[~score] == 0)


def test_auto_dtype_is_bfloat16_only_for_a_frozen_lora_base(monkeypatch):
    """On bf16 hardware ``auto`` loads a LoRA base in bfloat16 (it is frozen), but keeps the weights of a full
    fine-tuning float32: an AdamW step at RL learning rates is below a bfloat16 weight's resolution."""
    import bridge_pl.policy as policy_module

    monkeypatch.setattr(policy_module, "bf16_supported", lambda: True)
    lora = Policy("tiny-llama", lora_r=4, dtype="auto")
    full = Policy("tiny-llama", lora=False, dtype="auto")
    assert lora.weight_dtype == torch.bfloat16 and {p.dtype for p in lora.trainable_parameters()} == {torch.float32}
    assert full.weight_dtype == torch.float32 and {p.dtype for p in full.trainable_parameters()} == {torch.float32}


def test_bf16_update_agrees_with_fp32():
    """The default dtype on bf16 hardware: one policy-gradient step's LoRA gradient in bf16 base weights points the
    same way as fp32's (cosine > 0.99) with a norm within 5%; log-probs agree within 0.05 nats."""
    ids = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    advantages = torch.tensor([1.0, -0.5, 0.3])[:, None]
    grads, logps = {}, {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        policy = Policy("tiny-llama", lora_r=4, dtype=dtype)
        with torch.no_grad():  # a non-zero adapter, the same in both
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())  # LoRA stays fp32
        logp = policy(ids, attn)[0]
        (-(logp * advantages).mean()).backward()
        grads[dtype] = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
        logps[dtype] = logp.detach()
    cosine = torch.nn.functional.cosine_similarity(grads["float32"], grads["bfloat16"], dim=0)
    assert cosine > 0.99
    assert abs(grads["bfloat16"].norm() / grads["float32"].norm() - 1) < 0.05
    assert (logps["float32"] - logps["bfloat16"]).abs().max() < 0.05


def test_reference_is_current_only_while_it_computes_what_the_policy_does():
    """The reference pass is skipped exactly when it would reproduce the policy's own log-probs."""
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    assert policy.reference_is_current()  # fresh adapter: every LoRA B is zero, adapter on == adapter off
    lora_b = next(p for name, p in policy.model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.add_(0.01)
    assert not policy.reference_is_current()
    policy.rebase_reference()  # e.g. after a warm start
    assert policy.reference_is_current()
    with torch.no_grad():
        lora_b.add_(0.01)  # an RL step
    assert not policy.reference_is_current()


def test_qlora_trains_a_lora_policy_end_to_end_on_cpu(tmp_path):
    """4-bit NF4 base weights (bitsandbytes on CPU) under trained LoRA adapters: a whole bridge fit."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes >= 0.45 (in the dev extra) runs NF4 on CPU")
    from bitsandbytes.nn import Linear4bit

    cli = fit_tiny(tmp_path, "--model.policy.init_args.load_in_4bit=true", "--trainer.limit_val_batches=0",
                   "--data.reward=plugins.DistinctWordsReward")
    policy = cli.model.policy
    quantized = [m for m in policy.hf_model.modules() if isinstance(m, Linear4bit)]
    assert quantized and all(m.weight.dtype == torch.uint8 for m in quantized)  # packed 4-bit storage
    assert cli.trainer.global_step == 2
    trained = policy.trained_state_dict()
    assert trained and all(torch.isfinite(v).all() for v in trained.values())
    assert any("lora_B" in name and value.abs().sum() > 0 for name, value in trained.items())  # θ stepped


@pytest.mark.parametrize("start", ["fresh", "adapter"])
def test_a_built_policy_trains_with_activation_checkpointing(tmp_path, start):
    """from_pretrained hands back eval-mode models and transformers checkpoints only in training mode: a policy
    that stayed in eval mode (no WarmStart to switch it) trained with every activation kept."""
    adapter = None
    if start == "adapter":
        Policy("tiny-llama", dtype="float32", lora_r=4).save_adapter(tmp_path / "adapter")
        adapter = str(tmp_path / "adapter")
    policy = Policy("tiny-llama", dtype="float32", gradient_checkpointing=True, adapter=adapter)
    assert all(m.training for m in policy.modules())
    layers = [m for m in policy.modules() if type(m).__name__.endswith("DecoderLayer")]
    checkpointed = []
    for layer in layers:  # transformers routes a checkpointed layer's forward through this function
        run = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, run=run, **k: checkpointed.append(1) or run(*a, **k)
    ids = torch.randint(0, 1000, (2, 8))
    policy(ids, torch.ones_like(ids))[0].sum().backward()
    assert len(checkpointed) == len(layers) > 0


def test_activation_checkpointing_is_enabled_without_a_deprecation_warning():
    model = load_causal_lm("tiny-llama", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enable_activation_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_length_sorted_groups_put_rows_of_similar_length_together():
    lengths = [400, 100, 390, 110, 380, 120]
    in_batch_order = budget_groups(lengths, 800)
    assert in_batch_order == [[0, 1], [2, 3], [4, 5]]  # each long row padded beside a short one
    groups = length_sorted_groups(lengths, 800)
    assert groups == [[1, 3, 5], [4, 2], [0]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))

    def cells(gs):  # rows x padded length, summed: what the forwards compute
        return sum(len(g) * max(lengths[i] for i in g) for g in gs)

    assert (cells(in_batch_order), cells(groups)) == (2340, 1540)


def test_minibatch_row_groups_cut_the_batch_in_order_then_sort_each_part():
    lengths = [400, 100, 390, 110, 380, 120, 50]
    assert minibatch_row_groups(lengths, 1, 800) == [length_sorted_groups(lengths, 800)]
    # 7 rows in 2 parts: rows 0-3 and 4-6; each part's micro-batches group its own rows by length
    assert minibatch_row_groups(lengths, 2, 800) == [[[1, 3], [2, 0]], [[6, 5], [4]]]
    assert minibatch_row_groups(lengths, 7, 800) == [[[r]] for r in range(7)]
    with pytest.raises(ValueError, match=r"model.rl.minibatches \(8\) is more than the batch's 7 rows"):
        minibatch_row_groups(lengths, 8, 800)


def test_qlora_checkpoints_without_reentrant_forwards():
    """peft's k-bit preparation would switch checkpointing to torch's reentrant default, whose forward runs without
    grad (a shared prefix would then train nothing through it); the policy keeps it non-reentrant."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes >= 0.45 (in the dev extra) runs NF4 on CPU")
    policy = Policy("tiny-llama", load_in_4bit=True, gradient_checkpointing=True)
    layers = [m for m in policy.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert layers and all(m.gradient_checkpointing for m in layers)
    assert all(m._gradient_checkpointing_func.keywords.get("use_reentrant") is False for m in layers)
