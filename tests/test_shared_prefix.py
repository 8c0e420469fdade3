"""Training forwards compute a prefix shared by every row once (``SharedPrefixKV``): same log-probs and gradients
as each row on its own, with and without activation checkpointing, for right-padded rows and for LM credit's packed
rows (4-D masks), and fewer tokens through the layers."""

import pytest
import torch
from helpers import flat_grad

from bridge_pl.policy import BranchedSequence, Policy, _full_attention_only


def _policy(checkpointing: bool) -> Policy:
    torch.manual_seed(0)
    policy = Policy("tiny-llama", dtype="float32", lora_r=4, gradient_checkpointing=checkpointing)
    with torch.no_grad():  # a non-zero adapter, so that its gradient reaches A as well as B
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


def _right_padded(prefix: list[int], rests: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [prefix + rest for rest in rests]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
    return ids, attn


def _layer_tokens(policy: Policy) -> tuple[list[int], object]:
    """Tokens (rows x positions) each forward sends through the first decoder layer."""
    seen: list[int] = []
    layer = policy.hf_model.model.layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0] * args[0].shape[1]))
    return seen, handle


def _loss_and_grads(policy: Policy, ids: torch.Tensor, attn: torch.Tensor, score: torch.Tensor):
    logp = policy(ids, attn, score_mask=score)[0]
    return logp.detach(), flat_grad((logp * score).sum(), policy.trainable_parameters())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_shared_prefix_gives_each_rows_own_logprobs_and_gradient(checkpointing):
    policy = _policy(checkpointing)
    policy.model.train()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(5, 1000, (20,), generator=g).tolist()
    rests = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (7, 12, 3)]
    ids, attn = _right_padded(prefix, rests, policy.tokenizer.pad_token_id)
    score = attn.clone()
    score[:, :10] = 0  # scored tokens in the prefix's second half and after it
    seen, handle = _layer_tokens(policy)
    logp, grads = _loss_and_grads(policy, ids, attn, score)
    shared_tokens = seen[0] + seen[1]
    seen.clear()
    alone = [_loss_and_grads(policy, ids[r : r + 1], attn[r : r + 1], score[r : r + 1]) for r in range(3)]
    handle.remove()
    assert shared_tokens == 20 + 3 * (ids.shape[1] - 20)  # the prefix once, then each row's remainder
    # a single row has nothing to share: each runs in full (again in the backward's recompute, where the installed
    # transformers checkpoints above the layer's hooks)
    assert set(seen) == {ids.shape[1]} and len(seen) in (3, 6)
    assert torch.allclose(logp, torch.cat([lp for lp, _ in alone]), atol=1e-5)
    assert torch.allclose(grads, sum(gr for _, gr in alone), atol=1e-5, rtol=1e-4)


def test_rows_that_differ_early_or_are_left_padded_are_run_as_they_are():
    policy = _policy(False)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 1000, (2, 40), generator=g)
    ids[1, :35] = ids[0, :35]
    attn = torch.ones_like(ids)
    attn[:, :10] = 0  # left padding: 25 common real tokens follow it, but the row's first tokens are not real
    seen, handle = _layer_tokens(policy)
    with torch.no_grad():
        policy(ids, attn)
        ids[1, :35] = ids[0, :35] + 1  # no common prefix
        policy(ids, torch.ones_like(ids))
    handle.remove()
    assert seen == [80, 80]


def test_lm_credit_rows_share_their_prompt_and_score_as_each_sequence_alone():
    policy = _policy(True)
    policy.model.train()
    g = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 1000, (n,), generator=g).tolist()

    prompt = tokens(20)  # every sequence's context starts with it, then its own trajectory up to the search
    sequences = [BranchedSequence(prompt + tokens(n), [tokens(4), tokens(6), tokens(3)], tokens(2)) for n in (5, 9, 2)]
    params = policy.trainable_parameters()

    def scores_and_grads(seqs):
        scores = policy.branch_loglik(seqs)
        return scores.detach(), flat_grad(scores.sum(), params)

    seen, handle = _layer_tokens(policy)
    scores, grads = scores_and_grads(sequences)
    packed = max(seq.length for seq in sequences)
    shared_tokens = seen[:2]
    alone = [scores_and_grads([seq]) for seq in sequences]
    handle.remove()
    assert shared_tokens == [20, 3 * (packed - 20)]  # the prompt once, then each packed row's remainder
    assert torch.allclose(scores, torch.cat([s for s, _ in alone]), atol=1e-5)
    assert torch.allclose(grads, sum(gr for _, gr in alone), atol=1e-5, rtol=1e-4)


def test_reentrant_checkpointing_runs_every_row_in_full():
    """Reentrant checkpointing (what peft's k-bit preparation used to set, with the inputs made to require grad) runs a
    layer's forward without grad, so recorded prefix keys would carry none: the forward warns and runs the batch as
    it is, with each row's own gradient."""
    policy = _policy(True)
    policy.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    policy.hf_model.enable_input_require_grads()
    policy.model.train()
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(5, 1000, (20,), generator=g).tolist()
    ids, attn = _right_padded(prefix, [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (4, 6)],
                              policy.tokenizer.pad_token_id)
    params = policy.trainable_parameters()

    def grads(rows: slice) -> torch.Tensor:  # reentrant checkpointing supports .backward(), not autograd.grad
        for p in params:
            p.grad = None
        (policy(ids[rows], attn[rows], score_mask=attn[rows])[0] * attn[rows]).sum().backward()
        return torch.cat([p.grad.flatten() for p in params])

    with pytest.warns(UserWarning, match="shared prefix"):
        together = grads(slice(0, 2))
    assert torch.allclose(together, grads(slice(0, 1)) + grads(slice(1, 2)), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("name", "kwargs", "shares"), [
    ("LlamaConfig", {}, True),
    ("Qwen2Config", {}, True),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, False),
    ("MistralConfig", {"sliding_window": 4096}, False),
])
def test_only_full_attention_models_share_a_prefix(name, kwargs, shares):
    """A sliding window would have to cut the prefix per query; such models run every row in full."""
    import transformers

    assert _full_attention_only(getattr(transformers, name)(**kwargs)) is shares
