"""EM and searches per question type of saved predictions files (``QAEval``'s ``predictions/*.jsonl``).

Files written before the records carried a ``type`` get it from the world's questions by id (``--world-seed``).
Prints, per file: per type, the number of questions, EM and mean searches (``callbacks.qa_eval.metrics_by_type``),
how many questions had 0, 1, 2, ... searches, how many later searches repeated a query the same
trajectory had already searched (a repeat returns the same passages when retrieval is greedy), and, for questions
of the world, how many trajectories were shown a gold passage of every hop and the EM with and without that (does
a miss come from the evidence or from the reading?). Usage::

    python experiments/dev_by_type.py runs/demo_seed*/lightning_logs/version_0/predictions/val_world_dev_step*.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from bridge_pl.data.world import build_world
from callbacks.qa_eval import metrics_by_type


def repeated_queries(records: list[dict]) -> tuple[int, int]:
    """(later searches whose query the same record had already searched, all later searches) over ``records``."""
    later = [(search["query"], {s["query"] for s in record["searches"][:i]})
             for record in records for i, search in enumerate(record["searches"]) if i > 0]
    return sum(query in earlier for query, earlier in later), len(later)


def em_by_gold_shown(records: list[dict], gold: dict[str, list[set[str]]]) -> dict[str, tuple[int, float]]:
    """``{"shown": (n, EM), "not shown": (n, EM)}`` over ``records`` whose id is in ``gold`` (question id -> one set
    of gold passage ids per hop): "shown" when the trajectory's searches, together, returned a gold passage of every
    hop. A side with no record is left out."""
    sides: dict[str, list[float]] = {}
    for record in records:
        if record["id"] in gold:
            returned = {pid for search in record["searches"] for pid in search["ids"]}
            shown = all(hop & returned for hop in gold[record["id"]])
            sides.setdefault("shown" if shown else "not shown", []).append(float(record["em"]))
    return {side: (len(ems), sum(ems) / len(ems)) for side, ems in sorted(sides.items(), reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--world-seed", type=int, default=0, help="world whose question types fill in missing ones")
    args = parser.parse_args()
    world = build_world(args.world_seed)
    examples = world.train + world.dev + world.test
    types = {ex.id: ex.metadata["type"] for ex in examples}
    gold = {ex.id: [set(hop) for hop in ex.metadata["gold_passages"]] for ex in examples}
    for path in args.files:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for record in records:
            record["type"] = record.get("type") or types.get(record["id"])
        counts = Counter(record["type"] for record in records)
        searches = Counter(len(record["searches"]) for record in records)
        repeats, later = repeated_queries(records)
        print(f"{path} ({len(records)} questions; searches per question: "
              + ", ".join(f"{n}: {searches[n]}" for n in sorted(searches))
              + f"; later searches repeating an earlier query: {repeats} of {later})")
        for key, value in metrics_by_type(records, "").items():
            kind, metric = key.split("/")[2:]
            print(f"  {kind:<12}{counts[kind]:>4} questions  {metric:<9}{value:.3f}")
        for kind in sorted(kind for kind in counts if kind is not None):
            sides = em_by_gold_shown([r for r in records if r["type"] == kind], gold)
            if sides:  # questions of the world only
                print(f"  {kind:<12}gold of every hop shown: " + "; ".join(f"{side} {n} (EM {em:.3f})"
                                                              for side, (n, em) in sides.items()))


if __name__ == "__main__":
    main()
