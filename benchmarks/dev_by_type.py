"""EM and searches per question type of saved predictions files (``QAEval``'s ``predictions/*.jsonl``).

Files written before the records carried a ``type`` get it from the world's questions by id (``--world-seed``).
Prints, per file: per type, the number of questions, EM and mean searches (``callbacks.qa_eval.metrics_by_type``),
how many questions had 0, 1, 2, ... searches, and how many later searches repeated a query the same
trajectory had already searched (a repeat returns the same passages when retrieval is greedy). Usage::

    python benchmarks/dev_by_type.py runs/demo_seed*/lightning_logs/version_0/predictions/val_world_dev_step*.jsonl
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--world-seed", type=int, default=0, help="world whose question types fill in missing ones")
    args = parser.parse_args()
    world = build_world(args.world_seed)
    types = {ex.id: ex.metadata["type"] for ex in world.train + world.dev + world.test}
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


if __name__ == "__main__":
    main()
