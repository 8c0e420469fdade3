"""One string names a corpus or a QA set (as used in YAML configs).

Corpora: ``"world"`` / ``"world:SEED"`` (generated), ``"wikipedia"`` (packaged), ``"medrag:PATH"`` (MedRAG chunk
file or folder), or a corpus file.
QA sets: ``"world/SPLIT"`` / ``"world:SEED/SPLIT"`` (SPLIT in train, dev, test; ``world-mc`` for the world with
half its questions multiple choice), ``"fanoutqa/sub"``, ``"fanoutqa/top"``, ``"mirage:PATH#SUBSET"`` (one MIRAGE
subset; ``"mirage:PATH"`` as an evaluation set names all five), or a QA file (jsonl / json / parquet).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from bridge_pl.data.medical import (
    MEDRAG_PREFIX,
    MIRAGE_PREFIX,
    check_choice_examples,
    load_mirage,
    read_medrag,
)
from bridge_pl.data.packaged import FANOUTQA_LEVELS, fanoutqa_questions, wikipedia_corpus
from bridge_pl.data.qa import Passage, QAExample, read_corpus, read_qa
from bridge_pl.data.world import MC_SHARE, World, build_world

_WORLD = re.compile(r"world(?::(?P<seed>-?\d+))?")
_WORLD_QA = re.compile(r"world(?P<mc>-mc)?(?::(?P<seed>-?\d+))?/(?P<split>train|dev|test)")
CORPUS_FORMS = ('"world"', '"world:SEED"', '"wikipedia"', '"medrag:PATH"', "a corpus .jsonl/.json/.parquet file path")
QA_FORMS = ('"world/SPLIT"', '"world:SEED/SPLIT"', '"world-mc/SPLIT"', "(SPLIT: train, dev, test)",
            *(f'"fanoutqa/{level}"' for level in FANOUTQA_LEVELS), '"mirage:PATH#SUBSET"',
            "a QA .jsonl/.json/.parquet file path")


@lru_cache(maxsize=8)
def world(seed: int = 0, mc_share: float = 0.0) -> World:
    """The default-sized world for ``seed``, built once per process (corpus and QA share it); ``mc_share`` of its
    questions rendered as multiple choice (the corpus does not depend on it)."""
    return build_world(seed, mc_share=mc_share)


def _file(spec: str, forms: tuple[str, ...], what: str) -> Path:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"unknown {what} '{spec}': not a named source and not an existing file; "
                         f"expected one of: {', '.join(forms)}")
    return path


def load_corpus(spec: str) -> list[Passage]:
    """The corpus named by ``spec`` (see the module docstring); a new list each call."""
    if m := _WORLD.fullmatch(spec):
        return list(world(int(m["seed"] or 0)).corpus)
    if spec == "wikipedia":
        return wikipedia_corpus()
    if spec.startswith(MEDRAG_PREFIX):
        return read_medrag(spec.removeprefix(MEDRAG_PREFIX))
    return read_corpus(_file(spec, CORPUS_FORMS, "corpus"))


def load_qa(spec: str) -> list[QAExample]:
    """The QA set named by ``spec`` (see the module docstring); a new list each call."""
    if m := _WORLD_QA.fullmatch(spec):
        return list(getattr(world(int(m["seed"] or 0), MC_SHARE if m["mc"] else 0.0), m["split"]))
    if spec.startswith("fanoutqa/") and spec.removeprefix("fanoutqa/") in FANOUTQA_LEVELS:
        return fanoutqa_questions(spec.removeprefix("fanoutqa/"))
    if spec.startswith(MIRAGE_PREFIX):
        return load_mirage(spec)
    return check_choice_examples(spec, read_qa(_file(spec, QA_FORMS, "QA set")))
