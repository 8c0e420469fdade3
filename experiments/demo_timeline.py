"""Where a run's wall time went, read back from its TensorBoard event files.

Every logged value carries the wall time it was written at. Events that end a phase (the warm start's steps, an
evaluation, a training iteration) split the run into intervals; each interval is charged to the phase its end
marker closes. The first interval starts when Lightning wrote the run's ``config.yaml`` (the models are loaded by
then; the loading itself is not in the event files), so it covers the passage encoding and the first evaluation.
Iterations that logged ``rollout/seconds`` and ``update/seconds`` are split into those and the rest (callbacks such
as the landscape probe, checkpoints). Usage::

    python experiments/demo_timeline.py runs/demo_s25_seed0 runs/demo_s25_seed1

prints one table per run: seconds per phase and their share of the span.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

#: tag (or tag prefix ending in "/") whose events end a phase -> that phase
MARKERS = {
    "warm_start/before/": "evaluation",
    "warm_start/loss": "warm start",
    "warm_start/after/": "evaluation",
    "val/em": "evaluation",
    "train/reward": "iteration",
}


def _marker(tag: str) -> str | None:
    return next((phase for key, phase in MARKERS.items() if tag == key or (key.endswith("/") and tag.startswith(key))),
                None)


def timeline(version_dir: Path) -> dict[str, float]:
    """Seconds per phase of one run (a ``lightning_logs/version_N`` folder).

    Phases: ``evaluation``, ``warm start``, ``iteration: rollout``, ``iteration: update``, ``iteration: other``
    (or ``iteration`` when the run did not log its split), ``after the last phase`` (up to the last event, e.g. a
    final landscape probe) and ``span`` (config.yaml written -> last event).
    """
    events = EventAccumulator(str(version_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    ends: dict[float, tuple[str, int]] = {}  # wall time -> (phase it ends, step)
    last = 0.0
    for tag in tags:
        phase = _marker(tag)
        for event in events.Scalars(tag):
            last = max(last, event.wall_time)
            if phase is not None:
                ends.setdefault(event.wall_time, (phase, event.step))
    split = {name: {e.step: e.value for e in events.Scalars(name)} if name in tags else {}
             for name in ("rollout/seconds", "update/seconds")}
    start = (version_dir / "config.yaml").stat().st_mtime
    seconds: dict[str, float] = defaultdict(float)
    previous = start
    for wall, (phase, step) in sorted(ends.items()):
        gap = wall - previous
        if phase == "iteration" and step in split["rollout/seconds"] and step in split["update/seconds"]:
            rollout, update = split["rollout/seconds"][step], split["update/seconds"][step]
            seconds["iteration: rollout"] += rollout
            seconds["iteration: update"] += update
            gap -= rollout + update
            phase = "iteration: other"
        seconds[phase] += gap
        previous = wall
    seconds["after the last phase"] = last - previous
    seconds["span"] = last - start
    return dict(seconds)


def markdown(runs: dict[str, dict[str, float]]) -> str:
    phases = sorted({p for r in runs.values() for p in r if p != "span"}) + ["span"]
    lines = ["| phase | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for phase in phases:
        cells = [f"{r.get(phase, 0.0):.0f} s ({r.get(phase, 0.0) / r['span']:.0%})" for r in runs.values()]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (default_root_dir) or lightning_logs/version_N folders")
    args = parser.parse_args(argv)
    found = {}
    for run in map(Path, args.runs):
        versions = [run] if (run / "config.yaml").is_file() else sorted(run.glob("lightning_logs/version_*"))
        if not versions:
            parser.error(f"{run}: no lightning_logs/version_*/config.yaml under it")
        found.update({str(run) if len(versions) == 1 else str(v): timeline(v) for v in versions})
    print(markdown(found))


if __name__ == "__main__":
    main()
