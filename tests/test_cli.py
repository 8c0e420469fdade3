"""The ``bridge-pl`` command: help, config printing, the world writer, and a retriever plugged by YAML."""

import filecmp
import os
from dataclasses import fields
from typing import get_args

import pytest
import torch
from helpers import CONFIGS, TINY, fit_tiny

from bridge_pl.cli import main
from bridge_pl.config import GROUPS, Algorithm, KLKind, LossAgg
from bridge_pl.module import Mode
from bridge_pl.retrieval.dense import PassageTower, Pooling
from bridge_pl.retrieval.index import IndexKind


def test_fit_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # help text is wrapped to the terminal width
    assert "--model.policy_optimizer" in out and "--model.retriever_optimizer" in out
    # every settings group, each field with its documentation, and the allowed values of each closed choice
    for cls in GROUPS.values():
        for field in fields(cls):
            assert f"--model.{cls.PREFIX.split('.')[1]}.{field.name}" in out
    assert "iteration (K_φ; every mode that trains the retriever)" in out  # a field's description
    for flag, choices in [("--model.mode", Mode), ("--model.rl.algorithm", Algorithm), ("--model.rl.kl_kind", KLKind),
                          ("--model.rl.loss_agg", LossAgg)]:
        assert f"{flag} {{{','.join(get_args(choices))}}}" in out
    with pytest.raises(SystemExit):
        main(["fit", "--model.retriever.help", "bridge_pl.retrieval.dense.DenseRetriever"])
    out = capsys.readouterr().out
    for option, choices in [("pooling", Pooling), ("passage_tower", PassageTower), ("index", IndexKind)]:
        assert f"--model.retriever.{option} {{{','.join(get_args(choices))}}}" in out


def test_print_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, "--print_config"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "bridge_pl.retrieval.dense.DenseRetriever" in out and "mode: bridge" in out


def test_world_command_is_deterministic(tmp_path, capsys):
    main(["world", "--out", str(tmp_path / "a")])
    main(["world", "--out", str(tmp_path / "b")])
    main(["world", "--out", str(tmp_path / "c"), "--seed", "1"])
    names = ["corpus.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl"]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)
    assert match == names and not mismatch and not errors
    assert not filecmp.cmp(tmp_path / "a" / "corpus.jsonl", tmp_path / "c" / "corpus.jsonl", shallow=False)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_world_files_honour_the_umask(tmp_path, capsys, umask):
    previous = os.umask(umask)
    try:
        main(["world", "--out", str(tmp_path)])
    finally:
        os.umask(previous)
    modes = {path.name: path.stat().st_mode & 0o777 for path in tmp_path.iterdir()}
    assert modes == dict.fromkeys(["corpus.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl"], 0o666 & ~umask)


def test_retriever_plugged_in_by_class_path(tmp_path):
    cli = fit_tiny(tmp_path, configs=(TINY, str(CONFIGS / "plugin.yaml")))
    retriever = cli.model.retriever
    assert type(retriever).__name__ == "HashedBagRetriever"
    assert retriever.version == 2  # one φ step per iteration in bridge mode
    initial = type(retriever)(corpus="world", dim=16).tower.bag.weight
    assert not torch.equal(initial, retriever.tower.bag.weight.cpu())


def test_config_saved_without_clobber_error_on_rerun(tmp_path):
    for _ in range(2):
        main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
              "--trainer.max_steps=1"])
    assert list(tmp_path.rglob("config.yaml"))


def test_every_closed_choice_the_cli_offers_is_implemented():
    """Each value a ``Literal`` lets through the parser runs in the code behind it (and one outside is refused)."""
    from typing import get_args

    import torch

    from bridge_pl import rl
    from bridge_pl.bilevel import SOLVERS, make_solver
    from bridge_pl.config import KLKind, LossAgg
    from bridge_pl.module import Mode

    assert {make_solver(mode).name for mode in get_args(Mode)} == set(SOLVERS)
    logp, ref, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)
    for kind in get_args(KLKind):
        assert torch.isfinite(rl.kl_penalty(logp, ref, kind)).all()
    for agg in get_args(LossAgg):
        assert torch.isfinite(rl.agg_loss(logp, mask, agg))
    with pytest.raises(ValueError, match="k4"):
        rl.kl_penalty(logp, ref, "k4")
