"""``GrowingLayer``: the same keys and values as transformers' ``DynamicLayer``, written in place between regrowths."""

import pytest
import torch
from test_engine import FaissSearch, env, ids, model, tok  # noqa: F401 - the engine test's fixtures
from transformers.cache_utils import DynamicCache, DynamicLayer

from bridge_pl.rollout import RolloutEngine
from bridge_pl.rollout import engine as engine_module
from bridge_pl.rollout.cache import GrowingLayer, growing_cache


def states(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random keys or values ``[batch, 2 heads, length, 4]``."""
    return torch.randn(batch, 2, length, 4, generator=torch.Generator().manual_seed(seed))


def test_every_update_and_batch_edit_gives_what_the_dynamic_layer_gives():
    plain, growing = DynamicLayer(), GrowingLayer(room=3)
    edits = [("update", 5), ("update", 1), ("update", 1), ("repeat", 2), ("update", 1), ("update", 4),
             ("select", [0, 2, 3]), ("update", 1), ("crop", -2), ("update", 1), ("update", 1)]
    for step, (edit, arg) in enumerate(edits):
        if edit == "update":
            batch = plain.keys.shape[0] if plain.is_initialized and plain.keys.numel() else 2
            new_k, new_v = states(batch, arg, 2 * step), states(batch, arg, 2 * step + 1)
            expected, got = plain.update(new_k, new_v), growing.update(new_k, new_v)
            assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
        elif edit == "repeat":
            plain.batch_repeat_interleave(arg), growing.batch_repeat_interleave(arg)
        elif edit == "select":
            plain.batch_select_indices(torch.tensor(arg)), growing.batch_select_indices(torch.tensor(arg))
        else:
            plain.crop(arg), growing.crop(arg)
        assert torch.equal(plain.keys, growing.keys) and torch.equal(plain.values, growing.values), (step, edit)
        assert plain.get_seq_length() == growing.get_seq_length()


def test_single_token_appends_write_into_the_same_buffer_until_its_room_is_used():
    layer = GrowingLayer(room=4)
    layer.update(states(2, 3, 0), states(2, 3, 1))  # a buffer of 3 + 4 positions
    buffers = {layer.keys.untyped_storage().data_ptr()}
    for step in range(8):
        layer.update(states(2, 1, 2 + step), states(2, 1, 20 + step))
        buffers.add(layer.keys.untyped_storage().data_ptr())
    assert layer.get_seq_length() == 11
    assert len(buffers) == 2  # 4 appends fit the first buffer; the 5th made one of 8 + 4, which held the rest


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_rollouts_are_bit_identical_to_transformers_cache(model, tok, env, monkeypatch, greedy):  # noqa: F811
    """Whole multi-turn rollouts (shared-prefix prefill, decode steps, pruning, compaction, observations fed to the
    cache): every LM-head output equals the one computed with transformers' own ``DynamicCache``."""
    engine = RolloutEngine(env, max_turns=2, max_new_tokens_per_turn=12, max_response_tokens=400, temperature=1.0)
    lead = "You are a careful agent. Read the question below, think, search when needed, then answer. "
    prompts = [ids(tok, lead + q) for q in ("Who wrote Hamlet?", "capital of France?", "alpha")]

    def run() -> tuple[list[torch.Tensor], list[list[int]]]:
        logits = []
        head = model.get_output_embeddings().register_forward_hook(lambda m, a, out: logits.append(out.clone()))
        try:
            trajs = engine.generate(model, tok, prompts, FaissSearch(), n_samples=2, greedy=greedy,
                                    generator=torch.Generator().manual_seed(3))
        finally:
            head.remove()
        return logits, [t.response_ids for t in trajs]

    made = []
    monkeypatch.setattr(engine_module, "growing_cache", lambda config: made.append(growing_cache(config)) or made[-1])
    growing_logits, growing_ids = run()
    assert made and all(type(layer) is GrowingLayer for cache in made for layer in cache.layers)
    monkeypatch.setattr(engine_module, "growing_cache", lambda config: DynamicCache(config=config))
    plain_logits, plain_ids = run()
    assert growing_ids == plain_ids and len(growing_logits) == len(plain_logits) > 20
    assert all(torch.equal(g, p) for g, p in zip(growing_logits, plain_logits, strict=True))


def test_the_engine_builds_growing_layers_for_a_llama(model):  # noqa: F811
    assert {type(layer) for layer in growing_cache(model.config).layers} == {GrowingLayer}
