"""The policy's attention: ``sdpa_prefix`` by default, and ``sdpa_decode``'s opt-in matmul path for one-token queries,
which equals transformers' SDPA attention."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bridge_pl.attention import DECODE_NAME, NAME, decode_attention
from bridge_pl.models import load_causal_lm
from bridge_pl.policy import Policy


class _GroupedHeads(torch.nn.Module):
    num_key_value_groups = 3  # 6 query heads over 2 key/value heads, as transformers' attention modules say
    is_causal = True


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_a_decode_step_matches_sdpa_with_grouped_heads_and_padding(mask_kind):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(4, 6, 1, 16, generator=g)
    key, value = torch.randn(2, 4, 2, 9, 16, generator=g)
    keep = torch.ones(4, 1, 1, 9, dtype=torch.bool)
    keep[0, ..., :3] = False  # a left-padded row
    keep[2, ..., 5] = False  # a hole in the middle (a dropped column between prompt and observation)
    mask = {"none": None, "bool": keep,
            "additive": torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)}[mask_kind]
    ours, _ = decode_attention(_GroupedHeads(), query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(_GroupedHeads(), query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (4, 1, 6, 16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_longer_queries_go_to_sdpa_unchanged():
    g = torch.Generator().manual_seed(1)
    query, key, value = torch.randn(3, 2, 6, 5, 8, generator=g)
    ours, _ = decode_attention(torch.nn.Module(), query, key, value, None, is_causal=True)
    theirs, _ = sdpa_attention_forward(torch.nn.Module(), query, key, value, None, is_causal=True)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("decode_matmul", "implementation"), [(False, NAME), (True, DECODE_NAME)])
def test_the_policy_decodes_with_its_attention_and_greedy_tokens_match_sdpa(decode_matmul, implementation):
    """The matmul decode path is opt-in; either way greedy decoding gives SDPA's tokens."""
    policy = Policy("tiny-llama", dtype="float32", decode_matmul=decode_matmul)
    assert policy.hf_model.config._attn_implementation == implementation
    plain = load_causal_lm("tiny-llama").eval()
    assert plain.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 0, 5, 9, 13], [3, 8, 2, 7, 11]])
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=attn, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours = policy.hf_model.eval().generate(ids, **kwargs)
        theirs = plain.generate(ids, **kwargs)
    assert torch.equal(ours, theirs)
