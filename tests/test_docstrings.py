"""Docstrings state contracts and invariants, and stay short enough to be read.

Every module under src/ keeps its docstring within `MAX_MODULE_DOCSTRING_LINES` lines, and no
docstring or comment quotes a measured figure: a time in ns, µs or ms, a size in kB, MiB or the
like, or a ratio such as 3x. Measurements belong to the benchmark results (tests/bench/results,
docs/benchmarks.md), which say on what machine and version they hold and are rerun; a figure
copied into source goes stale unseen. A period the code keeps ("every 100 ms") is a design
statement, not a measurement, and passes.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "stallwatch"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_DOCSTRING_LINES = 15

_UNIT = r"(?:[µμ]s|us|ns|ms|kB|KB|KiB|MB|MiB|GB|GiB)"
FIGURE = re.compile(rf"(?<![\w.])(?<!every )\d+(?:[.,]\d+)*\s?(?:{_UNIT}\b|[x\u00d7](?!\w))")


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _texts(source: str) -> list[tuple[int, str]]:
    """Each line of every docstring (any string statement) and every comment, with its line number."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            texts.extend((node.lineno + offset, line) for offset, line in enumerate(node.value.value.splitlines()))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts.append((token.start[0], token.string))
    return texts


def figures(source: str) -> list[str]:
    """`line: figure` for every measured figure quoted in the docstrings and comments of `source`."""
    return [f"{line}: {match.group()}" for line, text in _texts(source) for match in FIGURE.finditer(text)]


@pytest.mark.parametrize("path", SOURCES, ids=_name)
def test_the_module_docstring_states_the_contract_within_the_line_limit(path):
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = len(inspect.cleandoc(docstring).splitlines())
    assert lines <= MAX_MODULE_DOCSTRING_LINES, (
        f"{_name(path)}: module docstring of {lines} lines (at most {MAX_MODULE_DOCSTRING_LINES}); "
        "rationale goes to docs/, history to commit messages"
    )


@pytest.mark.parametrize("path", SOURCES, ids=_name)
def test_no_docstring_or_comment_of_the_module_quotes_a_measured_figure(path):
    assert figures(path.read_text()) == [], f"{_name(path)}: figures belong in tests/bench/results"


@pytest.mark.parametrize(
    "text",
    [
        "a call costs 3.7 µs here",
        "10-12 µs per span",
        "159 µs / 3.98 ms",
        "40 to 80 us per record",
        "a batch is about 300 kB",
        "preallocated 1 MiB at a time",
        "about 5x cheaper",
        "1.3-1.5\u00d7 the p99",
        "250 ns per value",
    ],
)
def test_the_figure_pattern_finds_a_measurement_in_a_comment(text):
    assert figures(f"# {text}\n") != []


@pytest.mark.parametrize(
    "text",
    [
        "polls every 10 ms",
        "field 22 of /proc/PID/stat",
        "_PF_FORKNOEXEC is 0x40",
        "at most 1.2 times apart",
        "a 64-byte header, SHA-256",
        "2x2 grid",
        "HTTP 500 and 3 retries",
    ],
)
def test_the_figure_pattern_passes_periods_numbers_and_names(text):
    assert figures(f"# {text}\n") == []


def test_a_docstring_figure_is_found_on_its_own_line():
    source = '"""Title.\n\nA span costs 12 µs.\n"""\n\n\ndef f() -> None:\n    """Takes 2 ms."""\n'
    assert figures(source) == ["3: 12 µs", "8: 2 ms"]
