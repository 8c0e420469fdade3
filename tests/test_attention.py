"""The policy's attention: ``sdpa_prefix``, which equals transformers' SDPA attention."""

import torch

from bridge_pl.attention import NAME
from bridge_pl.models import load_causal_lm
from bridge_pl.policy import Policy


def test_the_policy_decodes_with_its_attention_and_greedy_tokens_match_sdpa():
    policy = Policy("tiny-llama", dtype="float32")
    assert policy.hf_model.config._attn_implementation == NAME
    plain = load_causal_lm("tiny-llama").eval()
    assert plain.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 0, 5, 9, 13], [3, 8, 2, 7, 11]])
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=attn, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours = policy.hf_model.eval().generate(ids, **kwargs)
        theirs = plain.generate(ids, **kwargs)
    assert torch.equal(ours, theirs)
