"""`stallwatch run -- COMMAND`: the command's own process starts stallwatch before its imports, and
is otherwise the command (argv, exit status, signals). Real processes throughout, dstack included."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import attrs, clean_env, latest_total, otlp_items, read_jsonl
from otlp_receiver import Receiver, otlp_received_from
from stallwatch.session import HOST_PROVIDERS_GRACE
from support.served import SPAWNING_APP, Served
from support.waiting import wait_until

BIN = Path(sys.executable).parent
STALLWATCH = str(BIN / "stallwatch")

# The command's first lines: was stallwatch set up before anything of the command was imported?
CHECK_SETUP = """\
import sys
before_imports = "stallwatch" in sys.modules and sys.modules["stallwatch"].FORK_SAFETY is not None
import os
import stallwatch.session
assert before_imports, "stallwatch was not imported before the command's first line"
assert stallwatch.session.current() is not None and stallwatch.session.current().telemetry_enabled
assert "STALLWATCH_RUN_PYTHONPATH" not in os.environ
"""


def launcher_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment whose PATH finds this virtualenv's python and console scripts first;
    PYTHONPATH only if `extra` sets it (what the launcher does with it is under test)."""
    env = clean_env(
        **{
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "STALLWATCH_FILE_DIR": str(tmp_path / "telemetry"),
            "STALLWATCH_WATCHDOG": "false",
            **extra,
        }
    )
    if "PYTHONPATH" not in extra:
        del env["PYTHONPATH"]
    return env


def test_a_python_command_runs_with_stallwatch_set_up_first_and_keeps_its_argv_and_exit_status(tmp_path):
    script = CHECK_SETUP + textwrap.dedent("""\
        assert sys.argv == ["-c", "first", "--second"], sys.argv
        assert "PYTHONPATH" not in os.environ and not any("_bootstrap" in entry for entry in sys.path)
        print("checked", flush=True)
        sys.exit(3)
    """)
    run = subprocess.run(
        [STALLWATCH, "run", "--", "python", "-c", script, "first", "--second"],
        env=launcher_env(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (run.returncode, run.stdout) == (3, "checked\n"), run.stderr


def test_python_processes_the_command_starts_do_not_load_stallwatch_again(tmp_path):
    script = CHECK_SETUP + textwrap.dedent("""\
        import subprocess
        child = "import sys; print('stallwatch' in sys.modules, sys.path.count('/elsewhere'))"
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout, end="")
    """)
    run = subprocess.run(
        [STALLWATCH, "run", "--", "python", "-c", script],
        env=launcher_env(tmp_path, PYTHONPATH="/elsewhere"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (run.returncode, run.stdout) == (0, "False 1\n"), run.stderr


def _instances_of_spans(telemetry: Path, name: str) -> Counter[str]:
    """How many spans named `name` each process (its `service.instance.id`) exported to the traces file."""
    return Counter(
        attrs(resource["resource"])["service.instance.id"]
        for request in read_jsonl(telemetry / "traces.jsonl")
        for resource in request["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
        if span["name"] == name
    )


def test_uvicorn_workers_started_as_fresh_interpreters_start_stallwatch_too(tmp_path):
    # `uvicorn --workers` spawns each worker (multiprocessing's spawn context): a fresh interpreter
    # that runs the app, not a fork of the stallwatch-set-up parent. The app itself never imports stallwatch.
    (tmp_path / "spawning_app.py").write_text(SPAWNING_APP)
    port = _free_port()
    command = [STALLWATCH, "run", "--", "uvicorn", "spawning_app:app", "--workers", "2", "--port", str(port)]
    served = Served(command, env=launcher_env(tmp_path), cwd=tmp_path)
    try:
        served.wait_for(r"Application startup complete", count=2, timeout=120)
        workers = set()
        for _ in range(20):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
                workers.add(int(response.read()))
        served.process.send_signal(signal.SIGTERM)
        assert served.finish() == 0, served.stderr()
    finally:
        served.kill()

    spawns = _instances_of_spans(tmp_path / "telemetry", "true")
    assert sum(spawns.values()) == 20  # every request's child, recorded by the worker that served it
    assert len(spawns) == len(workers)  # one exporting process per worker that served requests
    exporters = {attrs(resource["resource"])["service.instance.id"]
                 for request in read_jsonl(tmp_path / "telemetry" / "metrics.jsonl")
                 for resource in request["resourceMetrics"]}  # fmt: skip
    assert len(exporters) == 3, served.stderr()  # the parent and both workers, each set up


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_multiprocessing_workers_of_either_fresh_context_start_stallwatch_too(tmp_path, context):
    script = tmp_path / "pool.py"
    script.write_text(
        CHECK_SETUP
        + textwrap.dedent(f"""\
        import multiprocessing, subprocess

        def work():
            assert "stallwatch.auto" in sys.modules  # before the script's own module was imported here
            subprocess.run(["true"], check=True)

        if __name__ == "__main__":
            worker = multiprocessing.get_context("{context}").Process(target=work)
            worker.start()
            worker.join()
            sys.exit(worker.exitcode)
    """)
    )
    run = subprocess.run(
        [STALLWATCH, "run", "--", "python", str(script)],
        env=launcher_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert list(_instances_of_spans(tmp_path / "telemetry", "true").values()) == [1]  # the worker's own


def test_the_environments_own_sitecustomize_still_runs_after_stallwatch(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nSTALLWATCH_FIRST = 'stallwatch.session' in sys.modules\n")
    script = CHECK_SETUP + "import sitecustomize\nprint(sitecustomize.STALLWATCH_FIRST, os.environ['PYTHONPATH'])\n"
    run = subprocess.run(
        [STALLWATCH, "run", "--", "python", "-c", script],
        env=launcher_env(tmp_path, PYTHONPATH=str(site)), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (run.returncode, run.stdout) == (0, f"True {site}\n"), run.stderr


def test_the_module_form_runs_the_module_with_its_own_options(tmp_path):
    package = tmp_path / "app"
    package.mkdir()
    (package / "serve.py").write_text(CHECK_SETUP + "print(sys.argv[1:], flush=True)\nsys.exit(4)\n")
    run = subprocess.run(
        [STALLWATCH, "run", "-m", "serve", "--help", "x"],
        env=launcher_env(tmp_path, PYTHONPATH=str(package)), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (run.returncode, run.stdout) == (4, "['--help', 'x']\n"), run.stderr


def test_the_launched_process_is_the_command_so_sigterm_reaches_it_and_its_status_is_the_signal(tmp_path):
    script = CHECK_SETUP + "import signal\nprint('ready', os.getpid(), file=sys.stderr, flush=True)\nsignal.pause()\n"
    served = Served([STALLWATCH, "run", "--", "python", "-c", script], env=launcher_env(tmp_path))
    try:
        assert int(served.wait_for(r"ready (\d+)", timeout=60)[1]) == served.process.pid
        served.process.send_signal(signal.SIGTERM)
        assert served.finish() == -signal.SIGTERM
    finally:
        served.kill()


def test_a_missing_command_exits_127_with_one_line_and_no_command_is_a_usage_error(tmp_path):
    missing = subprocess.run(
        [STALLWATCH, "run", "--", "no-such-command-zz", "arg"],
        env=launcher_env(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (missing.returncode, missing.stderr) == (127, "stallwatch run: no-such-command-zz: command not found\n")
    # Not on PATH but a console script of stallwatch's own environment: `venv/bin/stallwatch run -- uvicorn`.
    beside = subprocess.run(
        [STALLWATCH, "run", "--", "uvicorn", "--version"],
        env=launcher_env(tmp_path) | {"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert beside.returncode == 0 and beside.stdout.startswith("Running uvicorn"), (beside.stdout, beside.stderr)
    for arguments in ([], ["--"], ["-m"]):
        usage = subprocess.run(
            [STALLWATCH, "run", *arguments], env=launcher_env(tmp_path), capture_output=True, text=True, timeout=60
        )
        assert usage.returncode == 2 and "stallwatch run --help" in usage.stderr, usage.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_served(url: str, served: Served, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert served.process.poll() is None, f"the server ended ({served.process.returncode}):\n{served.stderr()}"
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} never answered:\n{served.stderr()}")


def test_dstack_server_started_by_stallwatch_run_records_its_forks_and_spawns_and_flushes_on_sigterm(tmp_path):
    pytest.importorskip("dstack._internal.server.app", reason="dstack server needs the dstack[server] extra")
    port = _free_port()
    env = launcher_env(
        tmp_path, HOME=str(tmp_path / "home"), DSTACK_SERVER_DIR=str(tmp_path / "server"),
        OTEL_SERVICE_NAME="dstack-server", STALLWATCH_WATCHDOG="true",
    )  # fmt: skip
    served = Served(
        [STALLWATCH, "run", "--", "dstack", "server", "--host", "127.0.0.1", "--port", str(port), "-y"],
        env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        _wait_until_served(f"http://127.0.0.1:{port}/", served, timeout=180)
        served.process.send_signal(signal.SIGTERM)
        assert served.finish(timeout=60) in (0, -signal.SIGTERM), served.stderr()
    finally:
        served.kill()
    traces, metrics = tmp_path / "telemetry" / "traces.jsonl", tmp_path / "telemetry" / "metrics.jsonl"
    resources = [attrs(resource["resource"]) for resource in _resources(metrics)]
    host = [r for r in resources if r.get("stallwatch.process.role") != "watchdog"]
    assert host and all(r["service.name"] == "dstack-server" for r in host), resources
    # A watchdog whose host beats on time exports nothing (it sets its pipeline up at the first late
    # heartbeat): it ran if it started and did not die.
    assert "freeze watchdog" not in served.stderr(), served.stderr()
    assert latest_total(metrics, "stallwatch.loop.lag") >= 0  # the heartbeat of dstack's event loop
    spawned = [span for span in otlp_items(traces, "spans") if attrs(span).get("process.executable.name")]
    assert spawned, "dstack spawns git and ssh at start: their spans are missing"


def _resources(path: Path) -> list[dict]:
    return [resource for request in read_jsonl(path) for resource in request.get("resourceMetrics", [])]


WARNING = "STALLWATCH_PROVIDERS=host, but the host has installed no OpenTelemetry tracer or meter provider"


def test_host_providers_that_never_appear_get_one_line_and_ones_installed_even_after_the_first_record_none(tmp_path):
    spawn_twice = "import subprocess\nsubprocess.run(['true'])\nsubprocess.run(['true'])\n"
    install = textwrap.dedent("""\
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.trace import TracerProvider
        trace.set_tracer_provider(TracerProvider())
        metrics.set_meter_provider(MeterProvider())
    """)
    env = launcher_env(tmp_path, STALLWATCH_PROVIDERS="host")
    for host, lines in ((spawn_twice, 1), (install + spawn_twice, 0), (spawn_twice + install + spawn_twice, 0)):
        run = subprocess.run(
            [STALLWATCH, "run", "--", "python", "-c", host], env=env, capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0 and run.stderr.count(WARNING) == lines, run.stderr


def test_a_host_that_runs_on_without_providers_gets_the_one_line_while_it_runs(tmp_path):
    spawn_on = "import subprocess, time\nwhile True:\n    subprocess.run(['true'])\n    time.sleep(0.5)\n"
    served = Served(
        [STALLWATCH, "run", "--", "python", "-c", spawn_on], env=launcher_env(tmp_path, STALLWATCH_PROVIDERS="host")
    )
    try:
        served.wait_for(WARNING, timeout=HOST_PROVIDERS_GRACE + 60)
        served.process.send_signal(signal.SIGTERM)
        assert served.finish() == -signal.SIGTERM
    finally:
        served.kill()
    assert served.stderr().count(WARNING) == 1, served.stderr()


def _dstack_otel_env(tmp_path: Path, receiver: Receiver, **extra: str) -> dict[str, str]:
    """`dstack server` with every signal of its own OpenTelemetry set-up on, exporting to `receiver`, and
    batches held for ten minutes (longer than the test): what reaches the receiver was flushed at the stop
    unless `extra` shortens a delay. gpuhunt's catalogs come from a closed loopback port, never downloaded."""
    settings = {
        "HOME": str(tmp_path / "home"), "DSTACK_SERVER_DIR": str(tmp_path / "server"),
        "GPUHUNT_CATALOG_URL": f"http://127.0.0.1:{_free_port()}", "STALLWATCH_WATCHDOG": "true",
        "DSTACK_OTEL_TRACES_ENABLED": "1", "DSTACK_OTEL_METRICS_ENABLED": "1", "DSTACK_OTEL_LOGS_ENABLED": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "dstack-server",
        "OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BLRP_SCHEDULE_DELAY": "600000",
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",
    }  # fmt: skip
    return launcher_env(tmp_path, **{**settings, **extra})


def _serve_dstack_then_sigterm(tmp_path: Path, env: dict[str, str], before_stop: Callable[[], None]) -> str:
    """Start `stallwatch run -- dstack server`, make one API request once it answers, run `before_stop`,
    stop it with SIGTERM as systemd does; its stderr."""
    port = _free_port()
    served = Served(
        [STALLWATCH, "run", "--", "dstack", "server", "--host", "127.0.0.1", "--port", str(port), "-y"],
        env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        _wait_until_served(f"http://127.0.0.1:{port}/api/server/get_info", served, timeout=180)
        before_stop()
        served.process.send_signal(signal.SIGTERM)
        assert served.finish(timeout=60) in (0, -signal.SIGTERM), served.stderr()
    finally:
        served.kill()
    return served.stderr()


def _once_each(received: list[tuple[dict[str, str], str, Any]], key: Callable[[Any], object]) -> None:
    counts = Counter(key(item) for _, _, item in received)
    assert all(count == 1 for count in counts.values()), [k for k, count in counts.items() if count > 1]


def _log_bodies(receiver: Receiver) -> Counter[str]:
    return Counter(record.body.string_value for _, _, record in otlp_received_from(receiver, "/v1/logs"))


RUNNING = "The dstack server .* is running at"


def test_dstack_with_host_providers_exports_stallwatchs_records_through_its_own_once_each_and_flushes_at_sigterm(
    tmp_path, receiver
):
    pytest.importorskip("dstack._internal.server.utils.otel.utils", reason="needs dstack[otel]")
    env = _dstack_otel_env(tmp_path, receiver, STALLWATCH_PROVIDERS="host")
    stderr = _serve_dstack_then_sigterm(tmp_path, env, before_stop=lambda: None)
    assert WARNING not in stderr  # dstack installs its providers after its first spawns: not "nothing exported"
    spans = otlp_received_from(receiver, "/v1/traces")
    _once_each(spans, lambda span: span.span_id)
    # The watchdog's spans (a freeze while dstack imports, on a loaded machine) come with a resource of its own.
    host = [resource for resource, _, _ in spans if resource.get("stallwatch.process.role") != "watchdog"]
    assert host and all(resource == host[0] for resource in host), host  # one provider: dstack's
    assert host[0]["service.name"] == "dstack-server", host[0]
    scopes = {scope for _, scope, _ in spans}
    assert {"stallwatch", "dstack.server"} <= scopes, scopes
    assert "ssh" in {span.name for resource, scope, span in spans if scope == "stallwatch" and resource == host[0]}
    senders = {frozenset(resource.items()) for resource, scope, _ in otlp_received_from(receiver, "/v1/metrics")
               if scope == "stallwatch"}  # fmt: skip
    roles = Counter(dict(sender).get("stallwatch.process.role", "host") for sender in senders)
    # The watchdog exports with providers of its own once it has set them up, at a late heartbeat (a freeze
    # while dstack imports, on a loaded machine); an idle one exports nothing. tests/test_watchdog.py checks
    # its freeze under STALLWATCH_PROVIDERS=host.
    assert roles["host"] == 1 and roles.keys() <= {"host", "watchdog"} and roles["watchdog"] <= 1, senders
    assert frozenset(host[0].items()) in senders  # the host's records: through dstack's provider, and only there
    running = [body for body in _log_bodies(receiver).elements() if re.search(RUNNING, body)]
    assert len(running) == 1, _log_bodies(receiver)


@pytest.mark.parametrize("log_delay", ["500", "600000"], ids=["lines-leave-while-serving", "lines-leave-at-the-stop"])
def test_dstack_beside_stallwatchs_own_providers_exports_every_record_once_and_flushes_at_sigterm(
    tmp_path, receiver, log_delay
):
    pytest.importorskip("dstack._internal.server.utils.otel.utils", reason="needs dstack[otel]")
    # Host log lines at INFO are stallwatch's to export too. With a short delay they leave while the server
    # runs: one exported by both stallwatch and dstack's own log handler arrives twice before the stop. With a
    # long one only the flush at the stop sends them.
    env = _dstack_otel_env(tmp_path, receiver, STALLWATCH_LOG_LEVEL="INFO", OTEL_BLRP_SCHEDULE_DELAY=log_delay)

    def exported_at_start() -> None:
        lines = lambda: any(re.search(RUNNING, body) for body in _log_bodies(receiver))  # noqa: E731
        if log_delay == "500":
            wait_until(lines, "the server's start-up log lines are exported", timeout=60, interval=0.5)

    stderr = _serve_dstack_then_sigterm(tmp_path, env, before_stop=exported_at_start)
    assert WARNING not in stderr
    spans = otlp_received_from(receiver, "/v1/traces")
    _once_each(spans, lambda span: span.span_id)
    scopes = {scope for _, scope, _ in spans}
    assert {"stallwatch", "dstack.server", "opentelemetry.instrumentation.fastapi"} <= scopes, scopes
    assert "ssh" in {span.name for _, scope, span in spans if scope == "stallwatch"}
    metric_scopes = {scope for _, scope, _ in otlp_received_from(receiver, "/v1/metrics")}
    assert {"stallwatch", "dstack.server"} <= metric_scopes, metric_scopes
    logs = otlp_received_from(receiver, "/v1/logs")
    running = [resource for resource, _, record in logs if re.search(RUNNING, record.body.string_value)]
    assert len(running) == 1, _log_bodies(receiver)
    assert "service.version" in running[0], running  # dstack's resource: its own handler exported the line
    bodies = _log_bodies(receiver)
    assert all(count == 1 for body, count in bodies.items() if body.startswith("Failed to load")), bodies
