"""`stallwatch doctor`, `stallwatch demo` and the `opentelemetry-instrument` entry points, run as
an operator would run them: real commands in fresh processes, real test forks."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import clean_env, run_python, span_names

pytestmark = pytest.mark.matrix

BIN = Path(sys.executable).parent

HOST_PROVIDERS = """
from opentelemetry import trace, metrics
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader, ConsoleMetricExporter
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(ConsoleMetricExporter())])
"""


def stallwatch_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        [str(BIN / "stallwatch"), *args],
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_doctor_passes_when_providers_are_built_after_import(tmp_path):
    (tmp_path / "hostapp.py").write_text(HOST_PROVIDERS)
    env = clean_env(PYTHONPATH=str(tmp_path))

    proc = stallwatch_cli("doctor", "--json", "--import", "hostapp", env=env)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    names = [h["name"] for h in report["handlers"]]
    assert "BatchProcessor._at_fork_reinit" in names or "BatchSpanProcessor._at_fork_reinit" in names
    assert "PeriodicExportingMetricReader._at_fork_reinit" in names
    assert all(h["thread_starts"] == 0 for h in report["handlers"])
    assert report["unattributed_thread_starts"] == 0
    assert report["ok"] is True


def test_doctor_fails_and_names_objects_built_before_import():
    proc = run_python(
        HOST_PROVIDERS
        + """
import json, stallwatch
report = stallwatch.doctor()
print(json.dumps(report.to_dict()))
"""
    )

    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert report["unattributed_thread_starts"] >= 2  # the span worker and the metric ticker
    assert any("built before `import stallwatch`" in h for h in report["hazards"])
    assert "PeriodicExportingMetricReader" in json.dumps(report["fork_guard"]["preexisting_objects"])
    assert "built before" in proc.stderr  # the import-time warning


def test_doctor_names_a_handler_that_starts_a_thread(tmp_path):
    (tmp_path / "badlib.py").write_text(
        "import os, threading, time\n"
        "def restart_worker():\n"
        "    threading.Thread(target=time.sleep, args=(0.01,), name='badlib-worker').start()\n"
        "os.register_at_fork(after_in_child=restart_worker)\n"
    )
    env = clean_env(PYTHONPATH=str(tmp_path))

    proc = stallwatch_cli("doctor", "--import", "badlib", env=env)

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 thread(s)  badlib.restart_worker ['badlib-worker']" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("FORK HAZARD")


def test_doctor_reports_grpc_imported_first():
    proc = run_python(
        """
        import grpc, json, stallwatch
        print(json.dumps(stallwatch.doctor(probe=False).to_dict()))
        """
    )

    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert any("GRPC_ENABLE_FORK_SUPPORT" in h for h in report["hazards"])
    assert report["grpc"]["env"]["GRPC_ENABLE_FORK_SUPPORT"] == "false"


@pytest.mark.serial  # a time bound: not beside the other tests' load
def test_demo_runs_on_local_files_and_shows_zero_thread_starts(tmp_path):
    # With warnings as errors, as in many hosts' test suites: SDK 1.45 deprecates the SDK's
    # LoggingHandler that the demo's host (and stallwatch's pipeline) builds, which failed the demo.
    env = clean_env(PYTHONWARNINGS="error")
    proc = stallwatch_cli("demo", "--out", str(tmp_path / "demo"), "--probes", "5", "--json", env=env)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["probes_answered"] == 5
    assert result["stallwatch_thread_starts_per_child"] == 0
    assert result["stock_thread_starts_per_child"] >= 3
    assert result["crashed_children"] == 0
    assert result["grpc_calls_during_spawns"] > 0  # gRPC busy while the children were spawned
    assert result["forked_worker_span_exported"] is True
    if shutil.which("true") and result["loop"] == "uvloop":
        assert "exec_bound" not in result["forks"]  # the default spawn under uvloop: vfork, no fork at all
    names = span_names(tmp_path / "demo" / "traces.jsonl")
    assert names.count("probe /healthcheck") == 5
    assert "forked worker" in names
    assert "stallwatch.fork.count" in (tmp_path / "demo" / "metrics.jsonl").read_text()
    # Both incidents: the freeze seen live, the killed create a leak candidate, the wedge refused then healed.
    assert result["freeze_detected_while_frozen"] is True and result["freeze_cause"] == "child_before_exec"
    assert result["freeze_seconds"] >= 2.4
    assert result["wedge_guarded"] == "B done"
    assert result["wedge_unguarded_healed"] == "WorkerDied" and result["wedge_heal_seconds"] < 2.5
    if importlib.util.find_spec("nebius") is not None:  # the `demo` extra; the matrix venvs lack it
        assert result["create_killed_leak_candidates"] == 1
    for line in ("[1/5]", "[2/5]", "[4/5]", "[5/5]"):
        assert line in proc.stderr  # progress, as it happens
    # The postmortem it ran: the freeze, its cause, the interrupted create and the wedge, in order.
    report = (tmp_path / "demo" / "postmortem.txt").read_text()
    timeline = report[report.index("\nTimeline (") :]  # the headline above it lists freezes and wedges first
    order = ["gil_held freeze", "InstanceService/Create never ended", "cloud resource create unconfirmed",
             "refused PyThreadState_SetAsyncExc", "wedge worker_died", "wedge orphaned_item"]  # fmt: skip
    if importlib.util.find_spec("nebius") is None:
        order = [marker for marker in order if "Create" not in marker and "cloud" not in marker]
    positions = [timeline.index(marker) for marker in order]
    assert positions == sorted(positions), timeline
    assert "cause child_before_exec" in timeline and report.index("What happened") < report.index("\nTimeline (")
    assert "<svg" in Path(result["report"]).read_text()


def test_demo_rejects_bad_input(tmp_path):
    proc = stallwatch_cli("demo", "--probes", "0", cwd=tmp_path)

    assert proc.returncode == 2
    assert "--probes must be at least 1" in proc.stderr


def test_demo_with_an_out_directory_it_cannot_create_says_so_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    proc = stallwatch_cli("demo", "--out", str(tmp_path / "file" / "demo"))

    assert proc.returncode == 2
    assert proc.stderr == f"stallwatch demo: --out {tmp_path / 'file' / 'demo'} cannot be created: Not a directory\n"


def test_doctor_import_that_fails_names_the_module_and_shows_the_modules_own_traceback(tmp_path):
    (tmp_path / "brokenapp.py").write_text("raise RuntimeError('the app is broken')\n")
    env = clean_env(PYTHONPATH=str(tmp_path))

    missing = stallwatch_cli("doctor", "--import", "no_such_app", env=env)
    broken = stallwatch_cli("doctor", "--import", "brokenapp", env=env)

    assert missing.returncode == broken.returncode == 2
    assert missing.stderr == (
        "stallwatch doctor: --import no_such_app failed: ModuleNotFoundError: No module named 'no_such_app'\n"
    )
    assert 'brokenapp.py", line 1' in broken.stderr  # where to fix it
    assert broken.stderr.endswith("stallwatch doctor: --import brokenapp failed: RuntimeError: the app is broken\n")


def test_opentelemetry_instrument_gets_the_fork_aware_pipeline(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(
        "import asyncio, os, threading\n"
        "from opentelemetry import trace\n"
        "with trace.get_tracer('app').start_as_current_span('app-span'):\n"
        "    pass\n"
        "asyncio.run(asyncio.to_thread(print, 'from a worker'))\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(w, str(threading.active_count()).encode())\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('child threads', os.read(r, 10).decode())\n"
    )
    env = clean_env(
        OTEL_PYTHON_DISTRO="stallwatch",
        OTEL_PYTHON_CONFIGURATOR="stallwatch",
        STALLWATCH_FILE_DIR=str(tmp_path / "out"),
    )

    proc = subprocess.run(
        [str(BIN / "opentelemetry-instrument"), sys.executable, str(app)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stderr
    assert "child threads 1" in proc.stdout
    assert span_names(tmp_path / "out" / "traces.jsonl") == ["app-span"]
    assert "stallwatch.executor.run.duration" in (tmp_path / "out" / "metrics.jsonl").read_text()
    assert "already instrumented" not in proc.stderr


# A host with an SSH tunnel open (journaled durably), its journal and heartbeat file in the
# machine's shared default places, as on a dstack server.
_HOST = """
import json, sys, stallwatch
from opentelemetry import trace
from stallwatch import journal
from stallwatch.detect import heartbeat
session = stallwatch.setup()
tunnel = trace.get_tracer("host").start_span("ssh.tunnel.open")
journal.span_started(tunnel, "ssh", durable=True)
journal.active().flush()
print(json.dumps({"watchdog": session.watchdog_pid, "heartbeat": str(heartbeat.AREA.path)}), flush=True)
sys.stdin.readline()
print(json.dumps({"shutdown": stallwatch.shutdown()}), flush=True)
"""


def _start_host(env: dict[str, str]) -> tuple[subprocess.Popen[str], dict]:
    host = subprocess.Popen([sys.executable, "-c", _HOST], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    return host, json.loads(host.stdout.readline())


def _snapshot(*roots: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every file's bytes and every file's and directory's mtime under `roots`."""
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            found[str(path)] = (path.read_bytes() if path.is_file() else None, path.stat().st_mtime_ns)
    return found


def _all_threads_stopped(pid: int) -> bool:
    tasks = Path(f"/proc/{pid}/task")
    return all((task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for task in tasks.iterdir())


@pytest.fixture(scope="module")
def shared_machine(tmp_path_factory):
    """A dead host's journal and heartbeat files (killed with its watchdog, as systemd stops a unit)
    and a live host's, in the default journal directory and the shared heartbeat directory. The live
    host and its watchdog are stopped (SIGSTOP) so that their files hold still while the doctor runs."""
    root = tmp_path_factory.mktemp("machine")
    env = clean_env(XDG_STATE_HOME=str(root / "state"), XDG_RUNTIME_DIR=str(root / "run"))
    del env["STALLWATCH_JOURNAL_DIR"]  # the default one, under XDG_STATE_HOME, as hosts share it
    (root / "run").mkdir()
    live, live_info = _start_host(env)  # first: the dead host's journal is left for a later start to replay
    dead, dead_info = _start_host(env)
    os.kill(dead_info["watchdog"], signal.SIGKILL)
    dead.kill()
    dead.wait(30)
    journal_dir = root / "state" / "stallwatch" / "journal"
    then = time.time() - 60  # old enough for a sweep to take the dead host's heartbeat file as left behind
    for path in [*journal_dir.iterdir(), *(root / "run").iterdir()]:
        os.utime(path, (then, then))
    stopped = (live.pid, live_info["watchdog"])
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not all(_all_threads_stopped(pid) for pid in stopped):  # a signal is delivered after kill() returns
        assert time.monotonic() < deadline, "the live host did not stop"
        time.sleep(0.01)
    yield root, env, dead_info
    for pid in stopped:
        os.kill(pid, signal.SIGCONT)
    out, _ = live.communicate("\n", timeout=60)
    assert json.loads(out)["shutdown"] is True


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--json"],
        ["--setup"],
        ["--setup", "--json", "--no-probe"],
        ["--import", "autoapp"],
        ["--import", "pinnedapp", "--setup"],
    ],
    ids=["plain", "json", "setup", "setup-json-no-probe", "import-auto", "import-setup-with-keywords"],
)
def test_doctor_in_every_mode_leaves_other_hosts_journals_heartbeat_files_and_telemetry_as_they_were(
    shared_machine, tmp_path, args
):
    root, env, dead = shared_machine
    state, run = root / "state", root / "run"
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "autoapp.py").write_text("import stallwatch.auto\n")
    (tmp_path / "app" / "pinnedapp.py").write_text(  # settings passed in code win over the environment
        "import stallwatch\n"
        f"stallwatch.setup(journal_dir={str(state / 'stallwatch' / 'journal')!r}, "
        f"file_dir={str(state / 'stallwatch' / 'telemetry')!r})\n"
    )
    scratch = tmp_path / "tmp"  # the doctor's temporary directory goes here
    scratch.mkdir()
    before = _snapshot(state, run)
    assert Path(dead["heartbeat"]).name in {p.name for p in run.iterdir()}

    doctor_env = {**env, "TMPDIR": str(scratch), "PYTHONPATH": str(tmp_path / "app")}
    proc = stallwatch_cli("doctor", *args, env=doctor_env)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _snapshot(state, run) == before  # byte for byte, every mtime, nothing added or removed
    assert list(scratch.iterdir()) == []
    if "--setup" in args or "autoapp" in args:  # the doctor's own setup() did run, with a watchdog
        if "--json" in args:
            assert json.loads(proc.stdout)["watchdog"]["alive"] is True
        else:
            assert re.search(r"freeze watchdog +pid \d+, running", proc.stdout)


def test_doctor_imports_a_module_from_the_directory_it_runs_in_as_uvicorn_does(tmp_path):
    (tmp_path / "app.py").write_text("async def app(scope, receive, send):\n    pass\n")

    proc = stallwatch_cli("doctor", "--no-probe", "--import", "app", cwd=tmp_path)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("OK")


def test_doctor_reports_a_journal_directory_the_host_cannot_use_and_creates_none(tmp_path):
    (tmp_path / "file").write_text("")
    unusable = tmp_path / "file" / "journal"
    absent = tmp_path / "not-yet" / "journal"

    bad_text = stallwatch_cli("doctor", "--no-probe", env=clean_env(STALLWATCH_JOURNAL_DIR=str(unusable)))
    bad = stallwatch_cli(
        "doctor", "--setup", "--json", "--no-probe", env=clean_env(STALLWATCH_JOURNAL_DIR=str(unusable))
    )
    good = stallwatch_cli(
        "doctor", "--setup", "--json", "--no-probe", env=clean_env(STALLWATCH_JOURNAL_DIR=str(absent))
    )

    problem = f"STALLWATCH_JOURNAL_DIR={str(unusable)!r} is unusable: {tmp_path / 'file'} is not a directory"
    assert f"journal                UNUSABLE: {problem}" in bad_text.stdout
    assert f"advice: {problem}" in bad_text.stdout
    assert json.loads(bad.stdout)["journal"] == {
        "enabled": True, "directory": str(unusable), "usable": False, "problem": problem,
    }  # fmt: skip
    assert json.loads(good.stdout)["journal"] == {
        "enabled": True, "directory": str(absent), "usable": True, "problem": None,
    }  # fmt: skip
    assert not (tmp_path / "not-yet").exists()


def test_doctor_setup_serves_prometheus_on_free_ports_not_the_ones_the_host_listens_on():
    with socket.create_server(("127.0.0.1", 0)) as host_port, socket.create_server(("127.0.0.1", 0)) as watchdog_port:
        env = clean_env(
            OTEL_METRICS_EXPORTER="prometheus",
            OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(host_port.getsockname()[1]),
            STALLWATCH_WATCHDOG_PROMETHEUS_PORT=str(watchdog_port.getsockname()[1]),
        )
        proc = stallwatch_cli("doctor", "--setup", "--json", "--no-probe", env=env)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""  # no "cannot listen", no "Telemetry is off"
    assert json.loads(proc.stdout)["watchdog"]["alive"] is True


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="the advice is about uvloop")
@pytest.mark.skipif(
    importlib.util.find_spec("dstack") is None or importlib.util.find_spec("uvicorn") is None,
    reason="the advice is about uvicorn and dstack hosts (the test extras)",
)
def test_the_uvloop_advice_comes_only_with_the_fork_opt_out_and_names_the_fix_for_the_host_inspected(tmp_path):
    def advice(*args: str, **env: str) -> list[str]:
        result = stallwatch_cli("doctor", "--no-probe", "--json", *args, env=clean_env(**env), cwd=tmp_path)
        return [a for a in json.loads(result.stdout)["advice"] if "uvloop forks" in a]

    assert advice() == []  # the default spawns without fork
    assert advice("--setup", "--import", "dstack._internal.server.app") == []
    plain = advice(STALLWATCH_UVLOOP_SPAWN="fork")
    assert len(plain) == 1 and "remove STALLWATCH_UVLOOP_SPAWN=fork (the default, vfork" in plain[0], plain
    assert "loop=stallwatch.uvicorn_loop()" in plain[0]
    dstack = advice("--import", "dstack._internal.server.app", STALLWATCH_UVLOOP_SPAWN="fork")
    assert len(dstack) == 1 and "remove STALLWATCH_UVLOOP_SPAWN=fork for `dstack server`" in dstack[0], dstack
    assert "uvicorn_loop" not in dstack[0]  # dstack builds its own uvicorn: that fix does not apply


@pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None or importlib.util.find_spec("uvicorn") is None,
    reason="the advice is about uvicorn picking uvloop",
)
def test_the_uvloop_advice_says_why_when_the_vfork_spawn_cannot_run_here():
    proc = run_python(
        """
        import json
        import stallwatch
        from stallwatch.forksafe import uvloop_spawn

        # A CPython whose private subprocess transport differs cannot be had here: its check's outcome is set.
        uvloop_spawn._STDLIB_TRANSPORT = None
        print(json.dumps([a for a in stallwatch.doctor(probe=False).advice if "uvloop forks" in a]))
        """
    )
    assert proc.returncode == 0, proc.stderr
    (advice,) = json.loads(proc.stdout.splitlines()[-1])
    assert "stallwatch's vfork spawn cannot run here (stdlib-internals; see docs/uvloop.md)" in advice
    assert "loop=stallwatch.uvicorn_loop()" in advice


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="the advice is about uvloop")
def test_the_uvloop_advice_names_the_setup_keyword_when_setup_opted_out(telemetry_dir):
    proc = run_python(
        f"""
        import json, uvloop
        import stallwatch
        stallwatch.setup(file_dir={str(telemetry_dir)!r}, watchdog=False, uvloop_spawn="fork")

        async def main():
            return [a for a in stallwatch.doctor(probe=False).advice if "uvloop forks" in a]

        print(json.dumps(uvloop.run(main())))
        stallwatch.shutdown(10)
        """
    )
    assert proc.returncode == 0, proc.stderr
    (advice,) = json.loads(proc.stdout.splitlines()[-1])
    assert 'remove uvloop_spawn="fork" from setup() (the default, vfork' in advice
