"""One string names a corpus or a QA set (as used in YAML configs); an inline list of records is read too.

Corpora: ``"world"`` / ``"world:SEED"`` (generated), ``"wikipedia"`` (packaged), ``"medrag:PATH"`` (MedRAG chunk
file or folder; ``"medrag:PATH?strict"`` refuses blank rows and repeated ids), or a corpus file.
QA sets: ``"world/SPLIT"`` / ``"world:SEED/SPLIT"`` (SPLIT in train, dev, test; ``world-mc`` for the world with
half its questions multiple choice), ``"fanoutqa/sub"``, ``"fanoutqa/top"``, ``"mirage:PATH#SUBSET"`` (one MIRAGE
subset; ``"mirage:PATH"`` as an evaluation set names all five), or a QA file (jsonl / json / parquet; MIRAGE's
``benchmark.json`` named without ``mirage:`` is refused with a hint).
Inline lists (``corpus: [{id: p1, contents: ...}, ...]`` in YAML) go through the same record checks as a file.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

from bridge_pl.data.medical import (
    MEDRAG_PREFIX,
    MIRAGE_PREFIX,
    check_choice_examples,
    load_medrag,
    load_mirage,
    looks_like_mirage,
    mirage_hint,
)
from bridge_pl.data.packaged import FANOUTQA_LEVELS, fanoutqa_questions, wikipedia_corpus
from bridge_pl.data.qa import passages_from_records, qa_from_records, read_corpus, read_qa
from bridge_pl.data.world import MC_SHARE, World, build_world
from bridge_pl.records import CorpusSpec, DataFormatError, Passage, QAExample, QASpec

_WORLD = re.compile(r"world(?::(?P<seed>-?\d+))?")
_WORLD_QA = re.compile(r"world(?P<mc>-mc)?(?::(?P<seed>-?\d+))?/(?P<split>train|dev|test)")
CORPUS_FORMS = ('"world"', '"world:SEED"', '"wikipedia"', '"medrag:PATH"', '"medrag:PATH?strict"',
                "a corpus .jsonl/.json/.parquet file path")
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


def _inline(records: list, what: str) -> list[tuple[str, Any]]:
    """``(location, record)`` pairs of an inline list; dataclass records (``Passage``, ``QAExample``) as dicts."""
    return [(f"{what} (inline list) item {i}", asdict(r) if isinstance(r, (Passage, QAExample)) else r)
            for i, r in enumerate(records)]


@lru_cache(maxsize=1)
def _corpus_file(path: Path, mtime_ns: int, size: int) -> tuple[Passage, ...]:
    """A corpus file's passages, read once per version of the file (the CLI checks it before the models load,
    the retriever reads it after)."""
    return tuple(read_corpus(path))


def load_corpus(spec: CorpusSpec) -> list[Passage]:
    """The corpus named by ``spec`` (see the module docstring); a new list each call."""
    if not isinstance(spec, str):
        return passages_from_records(_inline(spec, "corpus"), "corpus (inline list)")
    if m := _WORLD.fullmatch(spec):
        return list(world(int(m["seed"] or 0)).corpus)
    if spec == "wikipedia":
        return wikipedia_corpus()
    if spec.startswith(MEDRAG_PREFIX):
        return load_medrag(spec)
    path = _file(spec, CORPUS_FORMS, "corpus")
    stat = path.stat()
    return list(_corpus_file(path.resolve(), stat.st_mtime_ns, stat.st_size))


def check_corpus(spec: CorpusSpec) -> None:
    """Read (and so check) a corpus given as a file or an inline list; the named ones are the package's own."""
    if not (isinstance(spec, str) and (_WORLD.fullmatch(spec) or spec == "wikipedia")):
        load_corpus(spec)


def load_qa(spec: QASpec) -> list[QAExample]:
    """The QA set named by ``spec`` (see the module docstring); a new list each call."""
    if not isinstance(spec, str):
        return qa_from_records(_inline(spec, "QA set"), "QA set (inline list)")
    if m := _WORLD_QA.fullmatch(spec):
        return list(getattr(world(int(m["seed"] or 0), MC_SHARE if m["mc"] else 0.0), m["split"]))
    if spec.startswith("fanoutqa/") and spec.removeprefix("fanoutqa/") in FANOUTQA_LEVELS:
        return fanoutqa_questions(spec.removeprefix("fanoutqa/"))
    if spec.startswith(MIRAGE_PREFIX):
        return load_mirage(spec)
    path = _file(spec, QA_FORMS, "QA set")
    try:
        return check_choice_examples(spec, read_qa(path))
    except DataFormatError:
        if looks_like_mirage(path):
            raise DataFormatError(mirage_hint(spec)) from None
        raise
