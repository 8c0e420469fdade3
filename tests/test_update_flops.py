"""iteration_bench's FLOP count of the policy update against torch's own count of what one forward + backward ran."""

import torch
from helpers import load_script
from torch.utils.flop_counter import FlopCounterMode

from bridge_pl.policy import Policy


def test_update_flops_match_what_a_forward_and_backward_run():
    bench = load_script("benchmarks", "iteration_bench")
    policy = Policy("tiny-llama", lora_r=4, dtype="float32")
    torch.manual_seed(0)
    rows, width, shared = 3, 40, 20
    ids = torch.randint(5, policy.hf_model.config.vocab_size, (rows, width))
    ids[:, :shared] = ids[0, :shared]  # a prefix every row has: the forward runs it once
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[:, 25:] = 1
    prefix = policy._shared_prefix_length(policy.hf_model, ids, attn, None)
    assert prefix == shared
    with FlopCounterMode(display=False) as counter:
        logp = policy(ids, attn, score_mask=mask)[0]
        (logp * mask).sum().backward()
    model = bench.model_shape(policy)
    assert len(model.projections) == 7 and all(r == 4 for _, _, r in model.projections)
    flops = bench.update_flops([bench.MicroBatch(rows, width, prefix, int(mask.sum()), int(attn.sum()))], model)
    # torch counts the products that ran: the LM head's recomputation too; not block 0's q, k, v input gradients
    # (nor LoRA A's there: block 0's input needs no gradient), nor the CPU's fused attention, which it does not see
    positions = prefix + rows * (width - prefix)
    block0 = sum(2 * positions * (k * n + k * r) for k, n, r in model.projections[:3])  # q, k, v
    expected = flops["total"] + flops["head_recompute"] - flops["attention"] - block0
    assert counter.get_total_flops() == expected, (flops, counter.get_flop_counts())
    unshared = bench.update_flops([bench.MicroBatch(rows, width, 0, int(mask.sum()), int(attn.sum()))], model)
    assert unshared["total"] > flops["total"]
