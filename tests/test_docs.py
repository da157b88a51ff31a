"""The user guide and its references stay true: README.md is short, docs/configuration.md and
docs/telemetry.md equal what `python -m stallwatch._docs` generates from the code, and every link
and file reference in README.md and docs/*.md resolves in the repository."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from stallwatch import _docs, config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted((ROOT / "src" / "stallwatch").rglob("*.py"))

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
FILE_REFERENCE = re.compile(r"(?:\.\./)*[\w.-]+(?:/[\w.*-]+)+/?")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".sh", ".toml", ".txt", ".html", "/")
TOP_LEVEL = {path.name for path in ROOT.iterdir()} - {".git", ".venvs"}
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.I)
COMMIT_HASH = re.compile(r"\b(?![0-9]+e[0-9]+\b)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")
INCIDENT_FILE = re.compile(r"incidents/\d")
INCIDENT_NAME = re.compile(r"\bincidents? (\d{3})\b", re.I)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchor for each heading of a Markdown page."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def _outside_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("path", sorted(_docs.generated()), ids=lambda path: path.name)
def test_each_generated_reference_equals_what_the_code_generates(path):
    expected = _docs.generated()[path]
    assert path.is_file() and path.read_text() == expected, f"{path} is stale: run python -m stallwatch._docs"


def test_the_docs_check_command_reports_a_stale_reference_and_accepts_a_fresh_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_docs, "DOCS", tmp_path)
    assert _docs.main(["--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert _docs.main([]) == 0
    assert _docs.main(["--check"]) == 0
    assert (tmp_path / "configuration.md").read_text() == _docs.configuration_markdown()


def test_every_setting_field_is_documented_in_the_configuration_reference():
    documented = {option.keyword for option in config.OPTIONS if option.keyword}
    settable = set(config.KEYWORDS) - {"signal_protocols"}
    assert set(config.KEYWORDS) == {f.name for f in fields(config.Settings)} - {"problems"}
    assert settable == documented
    reference = (ROOT / "docs" / "configuration.md").read_text()
    assert all(f"| `{option.env}` |" in reference for option in config.OPTIONS)


def test_the_readme_is_a_short_guide_with_the_two_setup_commands_and_ci_runs_the_test_command():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "stallwatch demo" in text
    assert "bash tests/run.sh" in text
    assert "bash tests/run.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_of_the_page_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        missing_anchor = bool(anchor) and resolved.suffix == ".md" and anchor not in _anchors(resolved)
        if not resolved.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_file_the_page_names_exists_in_the_repository(page):
    missing = []
    for code in CODE.findall(page.read_text()):
        match = FILE_REFERENCE.fullmatch(code)
        if not match or not code.endswith(FILE_SUFFIXES):
            continue
        relative = code if not code.startswith("../") else (page.parent / code).resolve().relative_to(ROOT).as_posix()
        if relative.split("/")[0] not in TOP_LEVEL:
            missing.append(code)  # a path that is not the repository's: write it from the root
        elif not list(ROOT.glob(relative.rstrip("/"))):
            missing.append(code)
    assert not missing, f"{page.name}: file references that do not resolve: {missing}"


@pytest.mark.parametrize(
    "path", [*PAGES, *SOURCES], ids=lambda path: path.relative_to(ROOT).as_posix()
)  # fmt: skip
def test_no_issue_numbers_commit_hashes_or_missing_incident_files_are_cited(path):
    text = _outside_code_blocks(path.read_text()) if path.suffix == ".md" else path.read_text()
    known = set(re.findall(r"^## Incident (\d{3})\b", (ROOT / "docs" / "incidents.md").read_text(), re.M))
    assert not ISSUE_NUMBER.findall(text), "issue numbers: say what the issue asked for instead"
    assert not COMMIT_HASH.findall(text), "commit hashes: history belongs in commit messages"
    assert not INCIDENT_FILE.findall(text), "incidents/NNN files are not in the repository: cite docs/incidents.md"
    assert set(INCIDENT_NAME.findall(text)) <= known, "an incident docs/incidents.md does not describe"
