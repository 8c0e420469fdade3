"""``Policy.generation_model``: generation with LoRA merged into the base weights, which come back bit for bit."""

import pytest
import torch
from helpers import tiny_module
from peft import LoraConfig, get_peft_model

from bridge_pl.models import load_causal_lm
from bridge_pl.policy import Policy


def random_adapter(policy: Policy) -> None:
    """Non-zero LoRA B matrices, so that the adapters change what the model computes."""
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))


def count_lora_calls(policy: Policy) -> tuple[list[int], list]:
    """A counter of LoRA A-matrix forwards (peft's side path) and the hook handles."""
    calls = [0]
    handles = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
               for name, m in policy.model.named_modules() if name.endswith("lora_A.default")]
    return calls, handles


def lora_layers(policy: Policy) -> list[torch.nn.Module]:
    return [m for m in policy.model.modules() if hasattr(m, "lora_A")]


def base_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.model.named_parameters() if "base_layer" in n}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_it_computes_the_adapted_policy_without_the_lora_path_and_restores_the_base_bit_for_bit():
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    random_adapter(policy)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    adapted = logits(policy.model, ids)
    with policy.model.disable_adapter():
        base = logits(policy.model, ids)
    before = {n: p.detach().clone() for n, p in base_weights(policy).items()}
    identity = {n: id(p) for n, p in base_weights(policy).items()}
    calls, handles = count_lora_calls(policy)
    with policy.generation_model() as model:
        merged = logits(model, ids)
    lora_calls_inside = calls[0]
    after = logits(policy.model, ids)
    for handle in handles:
        handle.remove()

    assert lora_calls_inside == 0 and calls[0] > 0  # no side path while merged; back to the adapters after
    assert torch.allclose(merged, adapted, atol=1e-4) and not torch.allclose(merged, base, atol=1e-2)
    assert all(torch.equal(p, before[n]) for n, p in base_weights(policy).items())
    assert {n: id(p) for n, p in base_weights(policy).items()} == identity  # the same parameters (optimizers)
    assert torch.equal(after, adapted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generation_weights_are_the_weights_generation_model_computes_with(dtype):
    """What an inference engine loads (HF names, LoRA merged) equals the merged model's own state, bit for bit."""
    policy = Policy("tiny-llama", dtype=dtype, lora_r=4)
    random_adapter(policy)
    exported = dict(policy.generation_weights())
    with policy.generation_model():
        expected = {name.replace(".base_layer.", "."): p.detach().clone()
                    for name, p in policy.hf_model.named_parameters() if ".lora_" not in name}
    plain = dict(load_causal_lm("tiny-llama").named_parameters())
    assert exported.keys() == expected.keys() == plain.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


def test_generation_weights_refuse_adapters_that_do_not_merge(tmp_path):
    adapted = get_peft_model(load_causal_lm("tiny-llama"), LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    adapted.save_pretrained(tmp_path / "adapter")
    policy = Policy("tiny-llama", dtype="float32", adapter=str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="data.engine=hf"):
        dict(policy.generation_weights())
    tied = Policy("tiny-llama", dtype="float32", lora=False)  # full fine-tuning trains the tied embeddings
    with pytest.raises(ValueError, match="tied to its LM head"):
        dict(tied.generation_weights())


def test_a_bfloat16_base_gets_the_float32_sum_rounded_once_even_under_autocast():
    policy = Policy("tiny-llama", dtype="bfloat16", lora_r=4)
    random_adapter(policy)
    layer = next(m for n, m in policy.model.named_modules() if n.endswith("q_proj"))
    weight = layer.get_base_layer().weight
    expected = (weight.float() + layer.get_delta_weight("default")).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the rollouts' precision context under bf16-mixed
        with policy.generation_model():
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, expected)


def test_an_error_inside_restores_the_base_weights():
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    random_adapter(policy)
    before = {n: p.detach().clone() for n, p in base_weights(policy).items()}
    with pytest.raises(RuntimeError, match="inside"), policy.generation_model():
        raise RuntimeError("inside")
    assert all(torch.equal(p, before[n]) for n, p in base_weights(policy).items())
    assert all(not m.disable_adapters for n, m in policy.model.named_modules() if n.endswith("q_proj"))


def test_an_error_while_merging_restores_the_layers_already_merged(monkeypatch):
    policy = Policy("tiny-llama", dtype="float32", lora_r=4)
    random_adapter(policy)
    before = {n: p.detach().clone() for n, p in base_weights(policy).items()}
    fifth = [m for n, m in policy.model.named_modules() if n.endswith("_proj") and hasattr(m, "lora_A")][4]

    def fail(adapter):
        raise RuntimeError("no delta")

    monkeypatch.setattr(fifth, "get_delta_weight", fail)
    with pytest.raises(RuntimeError, match="no delta"), policy.generation_model():
        pass
    assert all(torch.equal(p, before[n]) for n, p in base_weights(policy).items())


@pytest.mark.parametrize("extra", [{"use_dora": True}, {"lora_bias": True}], ids=["dora", "lora-bias"])
def test_adapters_a_merge_would_misrepresent_generate_through_peft(tmp_path, extra):
    """DoRA rescales the merged weight and a LoRA bias is not in the delta: such adapters are not merged."""
    adapted = get_peft_model(load_causal_lm("tiny-llama"), LoraConfig(r=4, target_modules="all-linear", **extra))
    adapted.save_pretrained(tmp_path / "adapter")
    policy = Policy("tiny-llama", dtype="float32", adapter=str(tmp_path / "adapter"))
    with policy.generation_model() as model:
        assert model is policy.model and not any(m.disable_adapters for m in lora_layers(policy))


@pytest.mark.parametrize("kwargs", [{"merged_generation": False}, {"lora": False}], ids=["opted-out", "full-ft"])
def test_without_merging_it_yields_the_model_as_it_is(kwargs):
    policy = Policy("tiny-llama", dtype="float32", lora_r=4, **kwargs)
    calls, handles = count_lora_calls(policy)
    with policy.generation_model() as model:
        assert model is policy.model
        logits(model, torch.randint(0, 1000, (1, 5)))
    assert calls[0] == (7 * policy.hf_model.config.num_hidden_layers if policy.lora else 0)  # every adapted linear
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("merged", [True, False])
def test_the_data_modules_rollouts_generate_merged(tmp_path, merged):
    module, data = tiny_module(tmp_path, f"--model.policy.init_args.merged_generation={merged}")
    random_adapter(module.policy)
    before = {n: p.detach().clone() for n, p in base_weights(module.policy).items()}
    calls, handles = count_lora_calls(module.policy)
    examples = data.load(data.val_sources["world_dev"], 2)
    data.rollout(module, examples, training=False, dataset="world_dev")
    for handle in handles:
        handle.remove()
    assert (calls[0] == 0) == merged
    assert all(torch.equal(p, before[n]) for n, p in base_weights(module.policy).items())
