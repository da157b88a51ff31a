"""Shared helpers: every scenario runs in a fresh interpreter, because stallwatch's import-time
fork guard and the global OpenTelemetry providers are process-wide state."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from otlp_receiver import receiver  # noqa: F401 - fixtures for every test module
from secrets_corpus import SECRETS, leaked
from sshd_fixture import http_server, sshd  # noqa: F401

TESTS = Path(__file__).parent
SCENARIOS = TESTS / "scenarios"


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without OTEL_/STALLWATCH_/GRPC_ variables (but for
    STALLWATCH_FAST_PATHS, the mode the tests run in), plus `extra`.

    Each call gets its own empty journal directory: a host killed in one test must not be replayed
    by the next test's `setup()` (tests that replay on purpose pass `journal_dir` themselves); its
    own Prometheus targets directory; and its own telemetry directory, so that what a test reads there
    is its host's alone (the user's default one collects every other run's files).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STALLWATCH_", "GRPC_"))}
    if "STALLWATCH_FAST_PATHS" in os.environ:
        env["STALLWATCH_FAST_PATHS"] = os.environ["STALLWATCH_FAST_PATHS"]
    env["STALLWATCH_JOURNAL_DIR"] = _JOURNALS.mkdtemp()
    env["STALLWATCH_PROMETHEUS_TARGETS_DIR"] = _JOURNALS.mkdtemp()  # never the user's own, which Prometheus may read
    env["STALLWATCH_FILE_DIR"] = _JOURNALS.mkdtemp()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))  # `support.*`
    env.update(extra)
    return env


class _Journals:
    """Temporary journal (and Prometheus targets and telemetry) directories, removed when the test session ends (a
    journal holds 1 MiB files)."""

    def __init__(self) -> None:
        self.root: str | None = None

    def mkdtemp(self) -> str:
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="stallwatch-journals-")
            atexit.register(shutil.rmtree, self.root, ignore_errors=True)
        return tempfile.mkdtemp(dir=self.root)


_JOURNALS = _Journals()


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` (dedented) in a fresh interpreter; never raises on a non-zero exit."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_scenario(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    """Run tests/scenarios/<name> and parse the JSON object on its last stdout line."""
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS / name), *args],
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_jsonl(path: Path) -> list[dict]:
    """Every OTLP/JSON line the file exporter wrote; a last line without its newline is still being written (a
    read does not wait for a write of more than a page) and is left out."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


_OTLP_LEVELS = {
    "spans": ("resourceSpans", "scopeSpans", "spans"),
    "logs": ("resourceLogs", "scopeLogs", "logRecords"),
    "metrics": ("resourceMetrics", "scopeMetrics", "metrics"),
}


def otlp_items(path: Path, kind: str) -> list[dict]:
    """Every span, log record or metric (`kind`) in a file exporter's OTLP/JSON lines."""
    resources, scopes, items = _OTLP_LEVELS[kind]
    return [
        item
        for request in read_jsonl(path)
        for resource in request.get(resources, [])
        for scope in resource.get(scopes, [])
        for item in scope.get(items, [])
    ]


def span_names(path: Path) -> list[str]:
    return [span["name"] for span in otlp_items(path, "spans")]


def metric_points(path: Path, name: str) -> list[dict]:
    """Every data point of metric `name` in a metrics file."""
    points = []
    for metric in otlp_items(path, "metrics"):
        if metric["name"] == name:
            data = metric.get("sum") or metric.get("gauge") or metric.get("histogram") or {}
            points.extend(data.get("dataPoints", []))
    return points


def attrs(point: dict) -> dict:
    """A data point's (or span's) attributes as a plain dict."""
    return {a["key"]: next(iter(a["value"].values())) for a in point.get("attributes", [])}


def latest_total(path: Path, name: str, **match: object) -> float:
    """Sum over label sets of the latest cumulative value of `name` whose labels include `match`."""
    totals = {}
    for point in metric_points(path, name):
        labels = attrs(point)
        if all(labels.get(k) == v for k, v in match.items()):
            key = tuple(sorted(labels.items()))
            totals[key] = float(point.get("asDouble", point.get("asInt", point.get("count", 0))))
    return sum(totals.values())


@pytest.fixture
def telemetry_dir(tmp_path: Path) -> Path:
    return tmp_path / "telemetry"


# ---- the leak guard: no log record of stallwatch's carries a corpus secret, in any test ------------


class LeakGuard(logging.Handler):
    """Checks every record of the `stallwatch` loggers against the secrets corpus as it is emitted.

    One regular-expression search per record (message, `extra` fields, exception text), so the whole
    suite pays almost nothing. It sees the records of this process at the levels the tests set; the
    fresh interpreters that scenarios run in are checked by `test_secrets`, which reads what they wrote.
    """

    _STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.checked = 0
        self.leaks: list[str] = []
        self.test = "(outside any test)"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self._text(record)
        except Exception:  # a record that cannot even be read is logging's problem, reported its way
            self.handleError(record)
            return
        self.checked += 1
        found = leaked(text)
        if found:
            self.leaks.append(f"{self.test}: {record.name} {record.levelname} carries {found}: {text[:300]!r}")

    def _text(self, record: logging.LogRecord) -> str:
        try:
            parts = [record.getMessage()]
        except Exception:  # arguments that do not fit the format: check them as they are
            parts = [str(record.msg), repr(record.args)]
        parts += (f"{key}={value!r}" for key, value in record.__dict__.items() if key not in self._STANDARD)
        if record.exc_info and record.exc_info[1] is not None:
            parts.append(logging.Formatter().formatException(record.exc_info))
        return "\n".join(parts)


_GUARD = pytest.StashKey[LeakGuard]()


def pytest_configure(config: pytest.Config) -> None:
    guard = LeakGuard()
    logging.getLogger("stallwatch").addHandler(guard)
    config.stash[_GUARD] = guard


@pytest.fixture
def leak_guard(request: pytest.FixtureRequest) -> LeakGuard:
    """The session's leak guard (to check that it is attached and counting)."""
    return request.config.stash[_GUARD]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    guard = item.config.stash[_GUARD]
    guard.test = item.nodeid
    try:
        return (yield)
    finally:
        guard.test = "(outside any test)"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    guard = session.config.stash[_GUARD]
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller reports and fails the session
        workeroutput["leak_guard"] = {"checked": guard.checked, "leaks": guard.leaks}
    elif guard.leaks and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """A pytest-xdist worker finished: its leak guard's count and leaks join the controller's."""
    found = getattr(node, "workeroutput", {}).get("leak_guard")
    if found is not None:
        guard = node.config.stash[_GUARD]
        guard.checked += found["checked"]
        guard.leaks.extend(found["leaks"])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    guard = terminalreporter.config.stash[_GUARD]
    logging.getLogger("stallwatch").removeHandler(guard)
    summary = f"{guard.checked} records of the stallwatch loggers checked against {len(SECRETS)} corpus secrets"
    if not guard.leaks:
        terminalreporter.write_line(f"leak guard: {summary}: no leak")
        return
    terminalreporter.section("leak guard: secrets in stallwatch log records", red=True)
    terminalreporter.write_line(f"{summary}: {len(guard.leaks)} leaking records")
    for leak in guard.leaks:
        terminalreporter.write_line(leak)
