"""What stallwatch costs a host that is idle: its threads in the host (tests/bench/bench_footprint.py
measures the rest)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env
from otlp_receiver import serving

pytestmark = [
    pytest.mark.matrix,
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs pidfd_open (Linux 5.3+)"),
]

_IDLE_HOST = """
import json, sys, threading, stallwatch
session = stallwatch.setup()
assert session.wait_for_watchdog(30)
threads = sorted(t.name for t in threading.enumerate())
print(json.dumps({"watchdog": session.watchdog_pid, "threads": threads}), flush=True)
sys.stdin.readline()
print(json.dumps({"shutdown": stallwatch.shutdown()}), flush=True)
"""


def _idle_host(tmp_path: Path, exporter: str) -> subprocess.Popen[str]:
    env = clean_env(
        XDG_RUNTIME_DIR=str(tmp_path),
        # With `otlp`, exporters that the watchdog's set-up would build too; nothing is exported while idle.
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        OTEL_TRACES_EXPORTER=exporter,
        OTEL_METRICS_EXPORTER=exporter,
        OTEL_LOGS_EXPORTER=exporter,
    )
    return subprocess.Popen([sys.executable, "-c", _IDLE_HOST], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


def test_the_heartbeat_the_wedge_check_and_the_shutdown_share_one_stallwatch_thread_in_the_host(tmp_path):
    host = _idle_host(tmp_path, "none")
    try:
        started = json.loads(host.stdout.readline())
        host.stdin.write("\n")
        host.stdin.flush()
        stopped = json.loads(host.stdout.readline())
    finally:
        host.kill()
        host.wait()

    assert started["threads"] == ["MainThread", "stallwatch-worker"]
    assert stopped["shutdown"] is True  # run on that thread


def test_a_host_exporting_three_signals_over_otlp_runs_one_export_thread_beside_the_heartbeats(tmp_path):
    host = _idle_host(tmp_path, "otlp")
    try:
        started = json.loads(host.stdout.readline())
    finally:
        host.kill()
        host.wait()

    # Not the SDK's three (a batch span and log processor and a periodic metric reader, a thread each).
    assert started["threads"] == ["MainThread", "stallwatch-export", "stallwatch-worker"]


def test_the_watchdog_of_a_host_that_beats_on_time_runs_one_thread_and_loads_neither_the_sdk_nor_wrapt(tmp_path):
    host = _idle_host(tmp_path, "otlp")
    try:
        watchdog = json.loads(host.stdout.readline())["watchdog"]
        threads = os.listdir(f"/proc/{watchdog}/task")
        maps = Path(f"/proc/{watchdog}/maps").read_text()
    finally:
        host.kill()
        host.wait()

    assert len(threads) == 1
    # wrapt's extension is loaded by stallwatch's package, psutil's by the SDK's resource detection
    assert "_wrappers" not in maps and "_psutil_linux" not in maps, maps


@pytest.mark.parametrize(("first", "before"), [("", False), ("import opentelemetry.sdk.trace\n", True)])
def test_import_stallwatch_says_the_sdk_was_loaded_before_it_only_when_it_was(first, before):
    # Taken after stallwatch's own modules had loaded the SDK, it was always true, and every import
    # of stallwatch scanned the whole heap for SDK objects built before it.
    code = first + "import json, stallwatch\nprint(json.dumps(stallwatch.FORK_SAFETY.sdk_loaded_before))\n"
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) is before


def test_a_set_up_exporting_over_otlp_loads_neither_the_file_exporters_nor_protobufs_json_printer():
    code = (
        "import json, sys, stallwatch\n"
        "stallwatch.setup()\n"
        "print(json.dumps(sorted(m for m in ('stallwatch.export.file', 'google.protobuf.json_format') "
        "if m in sys.modules)), flush=True)\n"
        "stallwatch.shutdown(timeout=0.5)\n"
    )
    signals = {f"OTEL_{signal}_EXPORTER": "otlp" for signal in ("TRACES", "METRICS", "LOGS")}
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", STALLWATCH_WATCHDOG="false", **signals)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)

    assert json.loads(proc.stdout.splitlines()[0]) == [], proc.stderr


def test_a_host_with_its_watchdog_loads_neither_the_watchdogs_module_nor_argparse_nor_difflib(tmp_path):
    code = (
        "import json, sys, stallwatch\n"
        "session = stallwatch.setup()\n"
        "assert session.watchdog_pid\n"
        "print(json.dumps(sorted(m for m in ('stallwatch.detect.watchdog', 'argparse', 'difflib') "
        "if m in sys.modules)), flush=True)\n"
        "stallwatch.shutdown(timeout=0.5)\n"
    )
    env = clean_env(XDG_RUNTIME_DIR=str(tmp_path), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                    OTEL_LOGS_EXPORTER="none")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0]) == [], proc.stderr  # the watchdog's command line needs none


# Started without PYTHONPROFILEIMPORTTIME, the host profiles none of its own imports; its watchdog inherits the
# environment setup() sees and writes each of its imports, as it makes them, to the stderr it shares with the host.
_IDLE_HOST_PROFILING_ITS_WATCHDOG = "import os\nos.environ['PYTHONPROFILEIMPORTTIME'] = '1'\n" + _IDLE_HOST
# What the idle watchdog polls with, beside the interpreter's own: imported by the smallest interpreter
# (`python -I -S`), which makes the set for the Python version that runs the tests.
_POLLS_WITH = "import os, select, fcntl, struct, warnings, __future__"


def _imported(importtime: str) -> set[str]:
    """The modules `-X importtime` (or PYTHONPROFILEIMPORTTIME) names in an interpreter's stderr."""
    lines = [line for line in importtime.splitlines() if line.startswith("import time:")]
    return {line.rpartition("|")[2].strip() for line in lines} - {"imported package"}


def test_the_watchdog_of_a_host_that_beats_on_time_loads_nothing_beside_the_smallest_interpreter_but_what_it_polls_with(
    tmp_path,
):
    env = clean_env(
        XDG_RUNTIME_DIR=str(tmp_path),
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_LOGS_EXPORTER="otlp",
    )
    with (tmp_path / "stderr").open("w") as stderr:
        host = subprocess.Popen([sys.executable, "-c", _IDLE_HOST_PROFILING_ITS_WATCHDOG], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)  # fmt: skip
    try:
        json.loads(host.stdout.readline())  # the watchdog has read the host's heartbeats: it polls, idle
        loaded = _imported((tmp_path / "stderr").read_text())
    finally:
        host.kill()
        host.wait()
    smallest = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", "-c", _POLLS_WITH],
                              capture_output=True, text=True, timeout=60, check=True)  # fmt: skip

    # Neither `site` (nor the `.pth` files' hooks, nor sitecustomize), nor `signal`'s enums, nor what reports a freeze.
    ours = {f"stallwatch.{name}" for name in ("_watchdog", "detect", "detect.watchdog", "detect.heartbeat_file")}
    assert loaded - _imported(smallest.stderr) == ours, sorted(loaded)


def test_a_set_up_host_loads_the_paramiko_and_nebius_instrumentations_only_when_it_imports_those_libraries():
    pytest.importorskip("paramiko")
    pytest.importorskip("nebius")
    code = (
        "import json, sys, stallwatch\n"
        "stallwatch.setup()\n"
        "ours = ('stallwatch.instrument.paramiko', 'stallwatch.instrument.nebius')\n"
        "before = sorted(m for m in ours if m in sys.modules)\n"
        "import paramiko, nebius.aio.request\n"
        "from stallwatch.instrument.nebius import NebiusInstrumentor\n"
        "from stallwatch.instrument.paramiko import ParamikoInstrumentor\n"
        "on = [i().is_instrumented_by_opentelemetry for i in (ParamikoInstrumentor, NebiusInstrumentor)]\n"
        "print(json.dumps({'before': before, 'on': on}), flush=True)\n"
        "stallwatch.shutdown(timeout=0.5)\n"
    )
    env = clean_env(STALLWATCH_WATCHDOG="false", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                    OTEL_LOGS_EXPORTER="none")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0]) == {"before": [], "on": [True, True]}, proc.stderr


_SCRUB_FIRST_USE = """
import json, sys, threading, stallwatch
from stallwatch.core import scrub
stallwatch.setup()
lazy = [value for value in vars(scrub).values() if isinstance(value, scrub._LazyPattern)]
compiled = sum("match" in vars(pattern) for pattern in lazy)
command = ["curl", "-u", "admin:hunter2-correct-horse", "-H", "Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123", "https://u:p4ssw0rd-long@host/x?token=sekrit-value-1234"]
start = threading.Barrier(8)
results = []
def scrub_once():
    start.wait()
    results.append(scrub.scrub_args(command))
threads = [threading.Thread(target=scrub_once) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"patterns": len(lazy), "compiled_at_setup": compiled, "results": results}), flush=True)
stallwatch.shutdown(timeout=0.5)
"""


def test_the_scrubbers_patterns_are_compiled_at_first_use_and_threads_first_using_them_at_once_scrub_alike():
    signals = {f"OTEL_{signal}_EXPORTER": "otlp" for signal in ("TRACES", "METRICS", "LOGS")}
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", STALLWATCH_WATCHDOG="false", **signals)
    proc = subprocess.run([sys.executable, "-c", _SCRUB_FIRST_USE], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[0])
    assert found["patterns"] > 0 and found["compiled_at_setup"] == 0
    first, *others = found["results"]
    assert all(result == first for result in others)
    assert not any(
        secret in " ".join(first) for secret in ("hunter2", "abcdefghijklmnopqrstuvwxyz0123", "p4ssw0rd", "sekrit")
    )


_JOURNAL_FIRST_USE = """
import json, sys, threading, stallwatch
from opentelemetry import trace
from stallwatch import journal
stallwatch.setup()
at_setup = sorted(m for m in sys.modules if m.startswith("stallwatch.journal"))
tracer = trace.get_tracer("host")
start = threading.Barrier(8)
def open_tunnel(number):
    span = tracer.start_span(f"ssh.tunnel.open {number}")
    start.wait()
    journal.span_started(span, "ssh", durable=True)
threads = [threading.Thread(target=open_tunnel, args=(number,)) for number in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"at_setup": at_setup, "writer": "stallwatch.journal.writer" in sys.modules}), flush=True)
stallwatch.shutdown(timeout=5)
"""


def test_the_journal_loads_at_the_first_journaled_operation_and_threads_journaling_first_at_once_share_one(tmp_path):
    env = clean_env(STALLWATCH_JOURNAL_DIR=str(tmp_path / "journal"), STALLWATCH_FILE_DIR=str(tmp_path),
                    STALLWATCH_WATCHDOG="false", OTEL_TRACES_EXPORTER="file", OTEL_METRICS_EXPORTER="none",
                    OTEL_LOGS_EXPORTER="none")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _JOURNAL_FIRST_USE], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[0])
    assert found == {
        "at_setup": [
            "stallwatch.journal",
            "stallwatch.journal.current",
            "stallwatch.journal.names",
        ],
        "writer": True,
    }
    from stallwatch.journal import scan

    (journaled,) = scan(tmp_path / "journal")
    starts = sorted(record["name"] for record in journaled.host if record["type"] == "start")
    assert starts == [f"ssh.tunnel.open {number}" for number in range(8)]
    assert len(journaled.paths) == 1 and journaled.host[-1]["type"] == "close"


_LEDGER_FIRST_USE = """
import json, sys, stallwatch
stallwatch.setup()
at_setup = "stallwatch.journal.ledger" in sys.modules
from stallwatch.journal import ledger
recorded = []
class Host:
    def __init__(self, chain):
        self.chain = chain
    def intent(self, intent):
        recorded.append(intent.resource_type)
        self.chain.intent(intent)
    def outcome(self, intent, outcome):
        self.chain.outcome(intent, outcome)
ledger.set_recorder(Host(ledger.recorder()))
ledger.recorder().intent(ledger.Intent("create", "compute.instance", "nebius.compute.v1.InstanceService/Create",
                                       "0" * 32, "0" * 16))
print(json.dumps({"at_setup": at_setup, "recorded": recorded}), flush=True)
stallwatch.shutdown(timeout=5)
"""


def test_the_ledger_loads_at_its_first_use_after_setup_and_its_intents_are_journaled_then_passed_on(tmp_path):
    env = clean_env(STALLWATCH_JOURNAL_DIR=str(tmp_path / "journal"), STALLWATCH_WATCHDOG="false",
                    OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _LEDGER_FIRST_USE], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0]) == {"at_setup": False, "recorded": ["compute.instance"]}
    from stallwatch.journal import scan

    (journaled,) = scan(tmp_path / "journal")
    intents = [record for record in journaled.host if record["type"] == "intent"]
    assert [(intent["action"], intent["resource_type"]) for intent in intents] == [("create", "compute.instance")]


def test_doctor_and_its_report_load_at_first_use_and_stay_the_function_and_the_class_once_loaded():
    code = """
import json, sys, stallwatch
stallwatch.setup()
at_setup = set(sys.modules)
report = stallwatch.doctor(probe=False)
import stallwatch.checkup
function = callable(stallwatch.doctor) and not isinstance(stallwatch.doctor, type(sys))
print(json.dumps(["stallwatch.checkup" not in at_setup, type(report) is stallwatch.Report,
                  type(stallwatch.audit()).__name__, function]), flush=True)
stallwatch.shutdown(timeout=5)
"""
    env = clean_env(STALLWATCH_WATCHDOG="false", STALLWATCH_JOURNAL="false", OTEL_TRACES_EXPORTER="none",
                    OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0]) == [True, True, "Report", True]


@pytest.mark.parametrize("first", ["scan", "ReplayResult", "to_span", "replay"])
def test_the_journals_replay_is_its_function_whichever_of_its_submodules_names_is_looked_up_first(first):
    # Loading a submodule sets the package's attribute of its name to the module.
    code = f"""
import json, stallwatch.journal as journal
getattr(journal, {first!r})
from stallwatch.journal import replay
print(json.dumps([callable(replay), type(replay).__name__]))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, "function"]


@pytest.mark.parametrize("package", ["stallwatch", "stallwatch.journal"])
def test_no_module_of_a_package_with_names_loaded_at_first_use_is_named_like_one_of_its_names(package):
    # Loading `package.x` sets the package's `x` to that module, hiding a function or class named `x`.
    module = importlib.import_module(package)
    directory = Path(module.__file__).parent
    submodules = {path.stem for path in directory.glob("*.py")} | {
        path.parent.name for path in directory.glob("*/__init__.py")
    }

    assert submodules & set(module.__all__) == set()


_EXPORTER_MODULES = (
    "requests",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._log_exporter",
)


def _metric_exporter_built_later(fast: bool) -> bool:
    """Whether the OTLP/HTTP metric exporter can wait for its first export: its temporality and
    aggregation preferences are read without building it only from exporter 1.45 on, on a fast path."""
    from opentelemetry.exporter.otlp.proto.http import __version__

    return fast and tuple(int(part) for part in __version__.split(".")[:2]) >= (1, 45)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-paths", "no-fast-paths"])
def test_the_otlp_http_exporters_are_built_at_their_first_export_and_export_what_was_recorded_before_it(fast):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the OTLP/HTTP exporter")
    code = (
        "import json, logging, sys, stallwatch\n"
        "from opentelemetry import metrics, trace\n"
        "stallwatch.setup()\n"
        f"loaded = [m for m in {_EXPORTER_MODULES!r} if m in sys.modules]\n"
        "with trace.get_tracer('probe').start_as_current_span('request'):\n"
        "    logging.getLogger('stallwatch').warning('recorded before the first export')\n"
        "metrics.get_meter('probe').create_counter('probe.requests').add(1)\n"
        "print(json.dumps({'loaded': loaded, 'shutdown': stallwatch.shutdown(timeout=20)}), flush=True)\n"
    )
    signals = {f"OTEL_{signal}_EXPORTER": "otlp" for signal in ("TRACES", "METRICS", "LOGS")}
    with serving() as collector:
        endpoint, requests = collector.url, collector.requests
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                        STALLWATCH_WATCHDOG="false", STALLWATCH_FAST_PATHS=str(fast).lower(), **signals)  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])

    # The metric exporter is built at setup() where its preferences cannot be read without building it.
    built_at_setup = [] if _metric_exporter_built_later(fast) else [_EXPORTER_MODULES[0], _EXPORTER_MODULES[2]]
    assert seen == {"loaded": built_at_setup, "shutdown": True}, proc.stderr
    bodies = {path: body for path, body in requests}
    assert set(bodies) == {"/v1/traces", "/v1/metrics", "/v1/logs"}, requests
    assert b"request" in bodies["/v1/traces"]
    assert b"recorded before the first export" in bodies["/v1/logs"]
    assert b"probe.requests" in bodies["/v1/metrics"]


def test_an_otlp_http_exporter_that_could_refuse_its_settings_is_built_at_setup_and_its_refusal_reported(
    monkeypatch,
):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the OTLP/HTTP exporter")
    with monkeypatch.context() as patched:  # the judge: this SDK's exporter refuses an unknown credential provider
        patched.setenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER", "no-such-provider")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        try:
            OTLPSpanExporter(endpoint="http://127.0.0.1:9").shutdown()
        except Exception:
            pass
        else:
            pytest.skip("this SDK's OTLP/HTTP exporter reads no credential provider")
    code = "import json, stallwatch\nsession = stallwatch.setup()\nprint(json.dumps(session.error), flush=True)\n"
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                    OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
                    OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER="no-such-provider",
                    STALLWATCH_WATCHDOG="false")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])

    assert error is not None and error.startswith("the OTLP traces exporter (http/protobuf) cannot be built"), error
    assert "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER" in error


def test_a_fork_child_of_a_host_whose_otlp_http_exporters_were_never_built_builds_its_own_and_exports():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the OTLP/HTTP exporter")
    code = (
        "import json, os, sys, stallwatch\n"
        "from opentelemetry import trace\n"
        "stallwatch.setup()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    with trace.get_tracer('probe').start_as_current_span('in-the-child'):\n"
        "        pass\n"
        "    sys.exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(json.dumps({'child': os.waitstatus_to_exitcode(status), 'built': 'requests' in sys.modules}))\n"
    )
    with serving() as collector:
        endpoint, requests = collector.url, collector.requests
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                        OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
                        STALLWATCH_WATCHDOG="false")  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

    assert json.loads(proc.stdout.splitlines()[-1]) == {"child": 0, "built": False}, proc.stderr
    assert any(path == "/v1/traces" and b"in-the-child" in body for path, body in requests), requests


def test_a_host_set_up_without_its_watchdog_or_prometheus_loads_neither_the_heartbeat_nor_the_scrape_counter():
    code = (
        "import json, sys, stallwatch\n"
        "stallwatch.setup()\n"
        "print(json.dumps(sorted(m for m in ('stallwatch.detect.heartbeat', 'stallwatch.export.scrapes') "
        "if m in sys.modules)), flush=True)\n"
    )
    signals = {f"OTEL_{signal}_EXPORTER": "otlp" for signal in ("TRACES", "METRICS", "LOGS")}
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", STALLWATCH_WATCHDOG="false", **signals)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)

    assert json.loads(proc.stdout.splitlines()[0]) == [], proc.stderr


_FORK_DURING_BUILD = """
import json, os, sys, threading, time
import stallwatch
from opentelemetry import trace

building = threading.Event()


class SlowRequests:
    # The export thread's first import of requests, made slow: it holds requests' import lock meanwhile.
    def find_spec(self, name, path=None, target=None):
        if name == "requests" and not building.is_set():
            building.set()
            time.sleep(0.5)
        return None


sys.meta_path.insert(0, SlowRequests())
stallwatch.setup()
with trace.get_tracer("probe").start_as_current_span("in-the-parent"):
    pass
lazy = stallwatch.session.current()._pipeline._processors[0].guard.inner
threading.Thread(target=lazy.built, daemon=True).start()  # as the export thread's first export builds it
assert building.wait(30)
pid = os.fork()
if pid == 0:
    with trace.get_tracer("probe").start_as_current_span("in-the-child"):
        pass
    os._exit(0 if stallwatch.shutdown(timeout=20) else 1)
deadline = time.monotonic() + 45
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print(json.dumps({"child": "hung"}), flush=True)
        sys.exit(0)
    time.sleep(0.05)
print(json.dumps({"child": "done"}), flush=True)
"""


def test_a_fork_while_the_export_thread_builds_its_exporter_waits_for_it_and_the_child_exports():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the OTLP/HTTP exporter")
    with serving() as collector:
        endpoint, requests = collector.url, collector.requests
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                        OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
                        STALLWATCH_WATCHDOG="false")  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", _FORK_DURING_BUILD], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr

    assert proc.stdout.splitlines()[-1] == '{"child": "done"}', proc.stderr
    assert any(path == "/v1/traces" and b"in-the-child" in body for path, body in requests), (requests, proc.stderr)


_PROPAGATE_AT_FIRST_USE = """
import json, sys, stallwatch
from opentelemetry import trace
stallwatch.setup()
loaded = "opentelemetry.propagate" in sys.modules
from opentelemetry import propagate
carrier = {}
with trace.get_tracer("t").start_as_current_span("s"):
    propagate.inject(carrier)
print(json.dumps({"loaded_at_setup": loaded, "carrier": sorted(carrier)}))
stallwatch.shutdown()
"""


@pytest.mark.parametrize("fast", [True, False], ids=["fast-paths", "no-fast-paths"])
def test_a_set_up_host_without_otel_propagators_loads_the_propagators_at_their_first_use_and_they_inject_the_defaults(
    fast,
):
    env = clean_env(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
                    STALLWATCH_FAST_PATHS=str(fast).lower())  # fmt: skip
    env.pop("OTEL_PROPAGATORS", None)
    proc = subprocess.run([sys.executable, "-c", _PROPAGATE_AT_FIRST_USE], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    # Without the fast paths setup() instruments through BaseInstrumentor, whose module loads them.
    assert json.loads(proc.stdout) == {"loaded_at_setup": not fast, "carrier": ["traceparent"]}
