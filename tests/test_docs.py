"""The repo carries its own docs: every citation of docs/method.md resolves to a section there."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
CITATION = re.compile(r"method\.md,? (?:sections? )?(\d+(?:\.\d+)?)(?:-(\d+))?")


def _tracked_text() -> dict[str, str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    texts = {}
    for name in files:
        if Path(name).suffix in {".py", ".md", ".yaml", ".toml", ".cfg", ".txt", ""}:
            path = ROOT / name
            if path.is_file():
                texts[name] = path.read_text(encoding="utf-8", errors="replace")
    return texts


def test_no_file_points_outside_the_repo_for_its_docs():
    outside = "shared/" + "docs"  # split so this file does not match itself
    assert [name for name, text in _tracked_text().items() if outside in text] == []


def test_every_method_citation_names_a_section_of_docs_method():
    headings = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", (ROOT / "docs/method.md").read_text(), re.M)
    sections = set(headings)
    cited = {}
    for name, text in _tracked_text().items():
        for match in CITATION.finditer(text):
            first, last = match.group(1), match.group(2)
            numbers = [str(n) for n in range(int(first), int(last) + 1)] if last else [first]
            for number in numbers:
                cited.setdefault(number, name)
    assert cited, "no citations found: the pattern is out of date"
    assert {number: name for number, name in cited.items() if number not in sections} == {}


def _layout_names() -> set[str]:
    """File names listed in docs/design.md's Layout block."""
    text = (ROOT / "docs/design.md").read_text()
    block = text.split("## Layout\n```\n", 1)[1].split("```", 1)[0]
    return set(re.findall(r"[\w.-]+\.(?:py|yaml|sh|md|toml)\b", block))


def test_the_design_layout_lists_the_files_of_the_tree():
    """Every module, callback, config, benchmark and experiment script is listed, and every listed file exists."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    listed = _layout_names()
    kept = [name for name in tracked if (ROOT / name).is_file()]
    parts = ("bridge_pl/", "callbacks/", "configs/", "benchmarks/", "experiments/")
    code = [name for name in kept if name.startswith(parts) and Path(name).suffix in {".py", ".yaml", ".sh"}
            and name.count("/") <= (3 if name.startswith("bridge_pl/") else 2)]
    assert sorted(name for name in code if Path(name).name not in listed) == []
    assert sorted(name for name in listed if not any(Path(t).name == name for t in kept)) == []


def test_each_study_has_its_question_command_and_one_results_table():
    studies = sorted((ROOT / "experiments").glob("*/README.md"))
    assert len(studies) >= 2
    for readme in studies:
        text = readme.read_text()
        assert "**Question.**" in text and "```bash" in text, readme
        results = text.split("## Results", 1)[1].split("\n## ", 1)[0]
        assert sum(line.startswith("|---") for line in results.splitlines()) == 1, f"{readme}: one results table"
    assert not [p for p in (ROOT / "benchmarks/results").iterdir() if "superseded" in p.read_text(errors="ignore")]
