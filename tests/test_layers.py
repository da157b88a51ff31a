"""The package's imports point down its layers (docs/architecture.md), read from the source with `ast`.

Every import counts, including those inside functions and under `TYPE_CHECKING`: an arrow hidden in a
function is still an arrow. Importing `a.b.c` also runs `a/b/__init__.py`, so a package's own
imports count for whoever imports one of its modules (the root `stallwatch` excepted: every module
runs it first, by Python's rules, and it sits at the top).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src"

# Bottom to top. A module belongs to the layer of the longest name it matches (a package's name
# matches its modules). Each may import its own layer and those below, never those above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contract", ("stallwatch.telemetry", "stallwatch._version", "stallwatch._private", "stallwatch._record")),
    ("core", ("stallwatch.core", "stallwatch.sentry", "stallwatch.sdk_compat")),
    ("settings", ("stallwatch.config",)),
    ("fork safety", ("stallwatch.forksafe",)),
    ("export", ("stallwatch.export",)),
    ("journal", ("stallwatch.journal",)),
    ("instrumentors", ("stallwatch.instrument", "stallwatch.interrupt", "stallwatch.timeout")),
    ("detectors", ("stallwatch.detect",)),
    ("session", ("stallwatch.pipeline", "stallwatch.session")),
    (
        "commands",
        (
            "stallwatch",
            "stallwatch.auto",
            "stallwatch.cli",
            "stallwatch.checkup",
            "stallwatch.demo",
            "stallwatch.demo_incidents",
            "stallwatch.postmortem",
            "stallwatch.otel_entrypoints",
            "stallwatch._bootstrap",
            "stallwatch._docs",
            "stallwatch._watchdog",
        ),
    ),
]

# Third-party packages stallwatch does not depend on (extras, or the host's own libraries).
OPTIONAL = (
    "dstack",
    "grpc",
    "nebius",
    "opentelemetry.exporter.otlp.proto.grpc",
    "opentelemetry.exporter.prometheus",
    "paramiko",
    "prometheus_client",
    "sentry_sdk",
    "uvloop",
)
# The reasons an import may sit inside a function, as the comment on its line (or the line above) starts.
REASON = re.compile(r"#\s*(optional|fork safety|footprint)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the stallwatch module imported, or the third-party module's dotted name
    line: int
    in_function: bool
    explained: bool


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted((SOURCE / "stallwatch").rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _nodes_in_functions(tree: ast.AST) -> set[int]:
    inside = set()
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(node) for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom)))
    return inside


def _group_heads(tree: ast.AST) -> dict[int, ast.stmt]:
    """For each import statement, the first of the run of import statements it belongs to."""
    heads: dict[int, ast.stmt] = {}
    for node in ast.walk(tree):
        for block in (getattr(node, name, None) for name in ("body", "orelse", "finalbody")):
            head = None
            for statement in block if isinstance(block, list) else ():
                if isinstance(statement, (ast.Import, ast.ImportFrom)):
                    head = head or statement
                    heads[id(statement)] = head
                else:
                    head = None
    return heads


def _explained(lines: list[str], node: ast.stmt, head: ast.stmt) -> bool:
    """A reason on the import's line, or in the comment right above it or above the run of imports it is in."""
    above = [lines[line - 2].strip() for line in (node.lineno, head.lineno) if line > 1]
    return bool(REASON.search(lines[node.lineno - 1]) or any(c.startswith("#") and REASON.search(c) for c in above))


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import in `module`, resolved to a stallwatch module where it names one."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    inside = _nodes_in_functions(tree)
    heads = _group_heads(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # `from package import name` imports the module `package.name` when there is one
            names = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        else:
            continue
        for name in names:
            while name.startswith("stallwatch.") and name not in modules:
                name = name.rpartition(".")[0]
            if name != module:
                explained = _explained(lines, node, heads.get(id(node), node))
                found.append(Import(module, name, node.lineno, id(node) in inside, explained))
    return found


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            matches = module == name or (name != "stallwatch" and module.startswith(name + "."))
            if matches and len(name) > best:
                best, rank = len(name), index
    return rank


def _runs(target: str, source: str) -> list[str]:
    """What importing `target` from `source` runs of stallwatch: it, and the packages above it that
    `source` is not itself inside (never the root)."""
    parts = target.split(".")
    ran = [target]
    for end in range(2, len(parts)):
        package = ".".join(parts[:end])
        if not (source == package or source.startswith(package + ".")):
            ran.append(package)
    return ran


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        for found in imports(module, path, modules):
            if found.target in modules:
                edges[module].update(ran for ran in _runs(found.target, module) if ran != module)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    assert [module for module in module_files() if layer_of(module) < 0] == []


def test_no_module_imports_a_layer_above_its_own():
    modules = module_files()
    upward = [
        f"{found.source} ({LAYERS[layer_of(found.source)][0]}) imports {found.target} "
        f"({LAYERS[layer_of(found.target)][0]}), line {found.line}"
        for module, path in modules.items()
        for found in imports(module, path, modules)
        if found.target in modules and layer_of(found.target) > layer_of(found.source)
    ]
    assert upward == []


def test_no_two_modules_import_each_other_however_indirectly():
    assert cycles(graph(module_files())) == []


def test_an_import_inside_a_function_says_why_it_is_there():
    """Of a stallwatch module or an optional package: the comment names the reason, `optional`
    (an extra or the host's library), `fork safety` (must load late) or `footprint` (loaded only
    when the feature is used)."""
    modules = module_files()
    unexplained = [
        f"{found.source}, line {found.line}: {found.target}"
        for module, path in modules.items()
        for found in imports(module, path, modules)
        if found.in_function
        and not found.explained
        and (found.target in modules or any(found.target == o or found.target.startswith(o + ".") for o in OPTIONAL))
    ]
    assert unexplained == []


def _drawn_layers(page: Path, heading: str) -> list[list[str]]:
    """The layers drawn in the first code block after `heading`, bottom first, as module names."""
    text = page.read_text().split(heading, 1)[1]
    drawing = text.split("```\n", 2)[1]
    rows = [re.split(r"\s{2,}", line.strip())[0] for line in drawing.splitlines() if line.strip()]
    return [["stallwatch." + name.strip().rstrip("/") for name in row.split(",")] for row in reversed(rows)]


@pytest.mark.parametrize(
    ("page", "heading"), [("README.md", "## Architecture"), ("docs/architecture.md", "# Architecture")]
)
def test_the_drawing_of_the_layers_matches_the_code(page, heading):
    modules = module_files()
    drawn = _drawn_layers(ROOT / page, heading)
    assert [name for row in drawn for name in row if name not in modules] == []
    assert [[layer_of(name) for name in row] for row in drawn] == [
        [index] * len(row) for index, row in enumerate(drawn)
    ]
    assert len(drawn) == len(LAYERS)


def test_the_layer_check_sees_an_upward_import_a_cycle_and_an_unexplained_late_import(tmp_path, monkeypatch):
    """The reader itself, on a made-up tree: core importing export inside a function, and export back."""
    package = tmp_path / "stallwatch"
    (package / "core").mkdir(parents=True)
    (package / "export").mkdir()
    for init in (package, package / "core", package / "export"):
        (init / "__init__.py").write_text("")
    (package / "core" / "faults.py").write_text("def late():\n    from ..export import file\n")
    (package / "export" / "file.py").write_text("from ..core import faults\n")
    monkeypatch.setattr(sys.modules[__name__], "SOURCE", tmp_path)
    modules = module_files()
    found = imports("stallwatch.core.faults", modules["stallwatch.core.faults"], modules)

    assert [(i.target, i.in_function, i.explained) for i in found] == [("stallwatch.export.file", True, False)]
    assert layer_of("stallwatch.export.file") > layer_of("stallwatch.core.faults")
    assert cycles(graph(modules)) == [["stallwatch.core.faults", "stallwatch.export.file"]]
