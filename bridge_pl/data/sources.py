"""One string names a corpus or a QA set (as used in YAML configs).

Corpora: ``"world"`` / ``"world:SEED"`` (generated), ``"wikipedia"`` (packaged), or a corpus file.
QA sets: ``"world/SPLIT"`` / ``"world:SEED/SPLIT"`` (SPLIT in train, dev, test), ``"fanoutqa/sub"``,
``"fanoutqa/top"``, or a QA file (jsonl / json / parquet).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from bridge_pl.data.packaged import FANOUTQA_LEVELS, fanoutqa_questions, wikipedia_corpus
from bridge_pl.data.qa import Passage, QAExample, read_corpus, read_qa
from bridge_pl.data.world import World, build_world

_WORLD = re.compile(r"world(?::(?P<seed>-?\d+))?")
_WORLD_QA = re.compile(r"world(?::(?P<seed>-?\d+))?/(?P<split>train|dev|test)")
CORPUS_FORMS = ('"world"', '"world:SEED"', '"wikipedia"', "a corpus .jsonl/.json/.parquet file path")
QA_FORMS = ('"world/SPLIT"', '"world:SEED/SPLIT"', "(SPLIT: train, dev, test)",
            *(f'"fanoutqa/{level}"' for level in FANOUTQA_LEVELS), "a QA .jsonl/.json/.parquet file path")


@lru_cache(maxsize=8)
def world(seed: int = 0) -> World:
    """The default-sized world for ``seed``, built once per process (corpus and QA share it)."""
    return build_world(seed)


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
    return read_corpus(_file(spec, CORPUS_FORMS, "corpus"))


def load_qa(spec: str) -> list[QAExample]:
    """The QA set named by ``spec`` (see the module docstring); a new list each call."""
    if m := _WORLD_QA.fullmatch(spec):
        return list(getattr(world(int(m["seed"] or 0)), m["split"]))
    if spec.startswith("fanoutqa/") and spec.removeprefix("fanoutqa/") in FANOUTQA_LEVELS:
        return fanoutqa_questions(spec.removeprefix("fanoutqa/"))
    return read_qa(_file(spec, QA_FORMS, "QA set"))
