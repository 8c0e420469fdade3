"""The README is a manual: short, no commit hashes or issue references, and every command in it (and in
docs/cluster.md) runs as written.

``bridge-pl`` commands are parsed as the CLI parses them (``--print_config`` stops before any model loads),
``bridge-pl world`` runs, ``make`` targets exist in the Makefile, and every relative link points into the tree.
"""

import re
import shlex
from pathlib import Path

import pytest

from bridge_pl.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


def _commands(text: str = README) -> list[list[str]]:
    """The shell commands of ``text`` (```bash blocks), continuation lines joined and comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def test_the_readme_is_short_and_states_no_history():
    assert len(README.splitlines()) <= 300
    for name, text in DOCS.items():
        assert re.findall(r"\b[0-9a-f]{7}\b", text) == [], f"{name} names a commit"
        assert re.findall(r"\bissue[- ]\d+", text, re.I) == [], f"{name} refers to an issue"
        assert re.findall(r"\bstop \d+\b", text) == [], f"{name} refers to work history"


def test_every_relative_link_points_into_the_tree():
    for name, text in DOCS.items():
        base = ROOT if name == "README.md" else ROOT / "docs"
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if not target.startswith(("http://", "https://")):
                assert (base / target).exists(), f"{name} links to {target}"


def test_the_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    used = {words[1] for words in _commands() if words[0] == "make"}
    assert used and used <= targets


MANUAL_COMMANDS = [*_commands(), *_commands(DOCS["cluster.md"])]
RUN_COMMANDS = [w for w in MANUAL_COMMANDS if w[0] == "bridge-pl" and w[1] not in ("world", "index")]


@pytest.mark.parametrize("words", RUN_COMMANDS, ids=lambda words: " ".join(words[1:4]))
def test_a_bridge_pl_command_parses(words, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the checkout, as a user runs them
    args = [word for word in words[1:] if word != "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err
    assert "model:" in capsys.readouterr().out


def test_the_index_commands_parse():
    """``bridge-pl index`` commands (building encodes a whole corpus: parsed here, run by tests/test_index_build.py)."""
    from bridge_pl.index_cli import _parser

    commands = [w for w in MANUAL_COMMANDS if w[:2] == ["bridge-pl", "index"]]
    assert commands
    for words in commands:
        assert _parser().parse_args(words[2:]).command == words[2]


def test_the_world_command_runs(tmp_path, monkeypatch):
    (words,) = [w for w in _commands() if w[:2] == ["bridge-pl", "world"]]
    monkeypatch.chdir(tmp_path)
    main(words[1:])
    out = Path(words[words.index("--out") + 1])
    assert {path.name for path in (tmp_path / out).iterdir()} >= {"corpus.jsonl", "train.jsonl"}


def test_the_python_example_trains(tmp_path, monkeypatch):
    """The README's Python example (the block that calls ``Trainer.fit``) runs as written."""
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", README, re.S) if ".fit(" in block]
    monkeypatch.chdir(tmp_path)  # the Trainer writes under the working directory
    exec(compile(example, "README.md", "exec"), {})
