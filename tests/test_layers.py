"""The library's import graph runs one way: down the floors below, and never into the plug-in layer ``callbacks/``.

A module may import modules of its own floor or of a floor below. A new module must be given a floor here (the
test names any module that has none), which is also where docs/design.md's layering is written down.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("records and utilities", ("records", "files", "seeding", "eval_mode", "config", "distributed", "run_lock",
                               "checkpoint_io", "models", "terminal", "memory")),
    ("readers and pure math", ("data.qa", "data.medical", "data.packaged", "data.world", "data.sources", "rewards",
                               "rl", "attention", "judge", "loss_surface")),
    ("the two learners", ("policy", "retrieval")),
    ("rollouts", ("rollout",)),
    ("training", ("batch_losses", "bilevel", "module", "metrics", "miss_analysis", "demonstrations", "signals",
                  "data.datamodule", "data.settings", "data.stream", "data.prompt_length", "data")),
    ("commands", ("cli", "index_cli", "__init__")),
]


def _floor(module: str) -> int | None:
    """The floor of ``bridge_pl.<module>`` (a package's entry covers its modules), None if it has none."""
    for level, (_, names) in enumerate(FLOORS):
        if any(module == name or module.startswith(name + ".") for name in names):
            return level
    return None


def _imports() -> dict[str, set[str]]:
    """``bridge_pl`` module (dotted, without the package prefix) -> the modules it imports (``bridge_pl.`` stripped,
    ``callbacks`` ones kept whole), at any depth of the file (function-level imports count)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "bridge_pl").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT / "bridge_pl").with_suffix("").parts)
        name = name.removesuffix(".__init__") if name != "__init__" else name
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "bridge_pl":  # from bridge_pl import rl
                    targets |= {alias.name for alias in node.names}
                elif node.module.startswith("bridge_pl."):
                    targets.add(node.module.removeprefix("bridge_pl."))
                elif node.module.split(".")[0] == "callbacks":
                    targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name.removeprefix("bridge_pl.") for a in node.names if a.name.startswith("bridge_pl.")}
                targets |= {a.name for a in node.names if a.name.split(".")[0] == "callbacks"}
        graph[name] = targets
    return graph


def test_every_library_module_has_a_floor():
    assert [name for name in _imports() if _floor(name) is None] == []


def test_no_import_runs_up_the_floors():
    upward = [f"{name} ({FLOORS[_floor(name)][0]}) imports {target} ({FLOORS[_floor(target)][0]})"
              for name, targets in _imports().items() for target in sorted(targets)
              if not target.startswith("callbacks") and _floor(target) is not None and _floor(target) > _floor(name)]
    assert upward == []


def test_the_library_never_imports_callbacks():
    assert {name: sorted(t for t in targets if t.startswith("callbacks"))
            for name, targets in _imports().items() if any(t.startswith("callbacks") for t in targets)} == {}
