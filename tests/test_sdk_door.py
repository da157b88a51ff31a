"""Private OpenTelemetry names are used only behind the door: `sdk_compat.py` and `forksafe/otel_compat.py`.

A private name is one the installed opentelemetry packages define with a leading underscore (a
function, class, module, or an attribute they assign), read or written on an SDK object; an import
of such a name or of a private module. The logs signal lives in underscore modules only
(`opentelemetry._logs`, `opentelemetry.sdk._logs`, `..._log_exporter`): those are its public home.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import opentelemetry
import pytest

import stallwatch

pytestmark = pytest.mark.matrix  # each SDK version's private names

SOURCE = Path(stallwatch.__file__).resolve().parent
DOORS = {SOURCE / "sdk_compat.py", SOURCE / "forksafe" / "otel_compat.py"}
LOGS_SIGNAL = frozenset({"_logs", "_log_exporter"})
# Underscore names shared with objects that are not OpenTelemetry's, as stallwatch's sources read them.
NOT_THE_SDKS = {
    "executor._shutdown": "concurrent.futures' ThreadPoolExecutor",
    "cf_thread._shutdown": "concurrent.futures.thread's interpreter-shutdown flag",
    "process._transport": "asyncio's subprocess.Process",
    "request._method": "the nebius SDK's request (opentelemetry-instrumentation-grpc, when installed, has one too)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@cache
def sdk_private_names() -> frozenset[str]:
    names: set[str] = set()
    for root in map(Path, opentelemetry.__path__):
        for path in root.rglob("*"):
            if _private(path.stem) and (path.is_dir() or path.suffix == ".py"):
                names.add(path.stem)
            if path.suffix != ".py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = node.name
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    name = node.attr
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    name = node.id
                else:
                    continue
                if _private(name):
                    names.add(name)
    return frozenset(names)


class _Reader(ast.NodeVisitor):
    """Collects the private SDK names one source file uses."""

    def __init__(self, private: frozenset[str]) -> None:
        self.private = private
        self.sdk_names: set[str] = set()  # names this file imported from opentelemetry
        self.sdk_classes: list[bool] = []  # per enclosing class: has an OpenTelemetry base
        self.found: list[tuple[int, str]] = []

    def _module(self, module: str, line: int) -> None:
        parts = module.split(".")
        if parts[0] == "opentelemetry" and any(_private(p) and p not in LOGS_SIGNAL for p in parts):
            self.found.append((line, f"import of {module}"))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._module(alias.name, node.lineno)
            if alias.name.split(".")[0] == "opentelemetry":
                self.sdk_names.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] != "opentelemetry":
            return
        self._module(module, node.lineno)
        for alias in node.names:
            if _private(alias.name) and alias.name not in LOGS_SIGNAL:
                self.found.append((node.lineno, f"import of {module}.{alias.name}"))
            self.sdk_names.add(alias.asname or alias.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.sdk_classes.append(any(self._root(base) in self.sdk_names for base in node.bases))
        self.generic_visit(node)
        self.sdk_classes.pop()

    @staticmethod
    def _root(node: ast.expr) -> str:
        while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else ""

    def _use(self, receiver: ast.expr, name: str, line: int, text: str) -> None:
        if name not in self.private:
            return
        own = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
        own = own or (isinstance(receiver, ast.Call) and self._root(receiver) == "super")
        if own:
            if self.sdk_classes and self.sdk_classes[-1]:
                self.found.append((line, f"{text} (a field of its OpenTelemetry base class)"))
            return
        if text not in NOT_THE_SDKS:
            self.found.append((line, text))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._use(node.value, node.attr, node.lineno, ast.unparse(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            receiver, name = node.args[0], node.args[1].value
            self._use(receiver, name, node.lineno, f"{ast.unparse(receiver)}.{name}")
        self.generic_visit(node)


def private_uses(path: Path) -> list[str]:
    reader = _Reader(sdk_private_names())
    reader.visit(ast.parse(path.read_text(encoding="utf-8")))
    return [f"{path.relative_to(SOURCE)}:{line}: {text}" for line, text in reader.found]


def test_private_opentelemetry_names_are_used_only_in_the_two_compatibility_modules():
    uses = [use for path in sorted(SOURCE.rglob("*.py")) if path not in DOORS for use in private_uses(path)]
    assert not uses, "private OpenTelemetry names outside sdk_compat.py / otel_compat.py:\n" + "\n".join(uses)


def test_the_reader_finds_each_kind_of_private_use(tmp_path):
    """A field read on an SDK object, one of an SDK base class, a getattr by name and private imports."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from opentelemetry.sdk.trace import ReadableSpan, _Span\n"
        "from opentelemetry.trace.propagation import _SPAN_KEY\n"
        "import opentelemetry.sdk._configuration\n"
        "from opentelemetry.sdk._logs import LoggerProvider\n"
        "class Mine(ReadableSpan):\n"
        "    def name_of(self):\n"
        "        return self._name\n"
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._name = 1\n"
        "def read(span, tracer):\n"
        "    return span._attributes, getattr(tracer, '_span_limits', None)\n"
    )
    reader = _Reader(sdk_private_names())
    reader.visit(ast.parse(sample.read_text()))
    assert [line for line, _ in reader.found] == [1, 2, 3, 7, 12, 12]
