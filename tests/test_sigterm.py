"""A normal SIGTERM stop keeps what the host recorded: uvicorn's re-raise after its graceful shutdown,
gunicorn stopping its workers, a plain script ended by the default action. The process still dies
by SIGTERM, a handler the host installed is never replaced, and a host ignoring SIGTERM goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from conftest import attrs, clean_env, latest_total, metric_points, otlp_items, run_python
from otlp_receiver import Receiver, otlp_attributes, otlp_received, otlp_received_from, serving
from stallwatch.detect import heartbeat
from support.processes import descendants
from support.served import SCENARIOS, Served
from support.waiting import wait_until

sys.path.insert(0, str(SCENARIOS))
from reliability_collectors import serve

REQUESTS = 30


def _host_env(telemetry: Path, **extra: str) -> dict[str, str]:
    # Metrics only at shutdown: what is on disk afterwards was written by the SIGTERM path.
    return clean_env(STALLWATCH_FILE_DIR=str(telemetry), OTEL_METRIC_EXPORT_INTERVAL="3600000", **extra)


def _spawn_requests(port: int) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for number in range(REQUESTS):
            response = client.get(f"/spawn/{number}")
            assert response.status_code == 200 and response.text == "0"


def _host_spans(telemetry: Path) -> tuple[list[str], list[dict]]:
    spans = otlp_items(telemetry / "traces.jsonl", "spans")
    requests = sorted(span["name"] for span in spans if span["name"].startswith("GET /spawn/"))
    children = [span for span in spans if attrs(span).get("process.executable.name") == "true"]
    return requests, children


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_uvicorn_stopped_by_sigterm_exports_every_request_and_child_and_still_dies_by_sigterm(tmp_path, loop):
    telemetry = tmp_path / "telemetry"
    command = [sys.executable, "-m", "uvicorn", "served_app:app", "--port", "0", "--loop", loop]
    host = Served(command, _host_env(telemetry), cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)").group(1))
        _spawn_requests(port)
        host.process.send_signal(signal.SIGTERM)
        code = host.finish()
    finally:
        host.kill()

    assert code == -signal.SIGTERM, host.stderr()
    assert "Finished server process" in host.stderr()  # uvicorn's graceful shutdown ran first
    requests, children = _host_spans(telemetry)
    assert requests == sorted(f"GET /spawn/{n}" for n in range(REQUESTS))
    assert len(children) == REQUESTS
    assert all(int(attrs(child)["process.exit.code"]) == 0 for child in children)
    exits = latest_total(
        telemetry / "metrics.jsonl", "stallwatch.subprocess.exits", **{"process.executable.name": "true"}
    )
    assert exits == REQUESTS


def test_gunicorn_stopping_its_uvicorn_workers_keeps_every_workers_spans(tmp_path):
    telemetry = tmp_path / "telemetry"
    command = [sys.executable, "-m", "gunicorn", "served_app:app", "-k", "uvicorn.workers.UvicornWorker",
               "-w", "2", "-b", "127.0.0.1:0"]  # fmt: skip
    host = Served(command, _host_env(telemetry), cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        for _ in range(2):
            host.wait_for(r"Application startup complete")
        _spawn_requests(port)
        host.process.send_signal(signal.SIGTERM)  # to the master, which stops its workers with SIGTERM
        code = host.finish()
    finally:
        host.kill()

    assert code == 0, host.stderr()  # gunicorn's master exits normally after stopping its workers
    requests, children = _host_spans(telemetry)
    assert requests == sorted(f"GET /spawn/{n}" for n in range(REQUESTS))
    assert len(children) == REQUESTS


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_uvicorn_workers_stopped_by_their_parent_export_every_request_and_child(tmp_path, stop):
    # Each spawned worker imports the app inside uvicorn's signal capture: SIGTERM is uvicorn's then, and
    # uvicorn raises it again at the default action once its graceful shutdown is over.
    telemetry = tmp_path / "telemetry"
    command = [sys.executable, "-m", "uvicorn", "served_app:app", "--port", "0", "--workers", "2"]
    host = Served(command, _host_env(telemetry), cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)").group(1))
        host.wait_for(r"Application startup complete", count=2)
        _spawn_requests(port)
        host.process.send_signal(stop)  # the parent stops its workers with SIGTERM
        code = host.finish()
    finally:
        host.kill()

    assert code == 0, host.stderr()
    assert host.stderr().count("Finished server process") == 2
    requests, children = _host_spans(telemetry)
    assert requests == sorted(f"GET /spawn/{n}" for n in range(REQUESTS))
    assert len(children) == REQUESTS


def test_ctrl_c_to_uvicorn_workers_stops_them_without_a_traceback_or_a_lost_watchdog_warning(tmp_path):
    # Ctrl-C signals the terminal's whole foreground process group: the parent, its workers, and
    # whatever they started in the same group.
    telemetry = tmp_path / "telemetry"
    command = [sys.executable, "-m", "uvicorn", "served_app:app", "--port", "0", "--workers", "2"]
    host = Served(command, _host_env(telemetry), cwd=SCENARIOS, own_group=True)
    try:
        port = int(host.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)").group(1))
        host.wait_for(r"Application startup complete", count=2)
        _spawn_requests(port)
        os.killpg(host.process.pid, signal.SIGINT)
        code = host.finish()
    finally:
        host.kill()

    assert code == 0, host.stderr()
    assert "Traceback" not in host.stderr() and "freeze watchdog" not in host.stderr(), host.stderr()
    requests, children = _host_spans(telemetry)
    assert requests == sorted(f"GET /spawn/{n}" for n in range(REQUESTS))
    assert len(children) == REQUESTS


def _watched(runtime: Path) -> list[int]:
    """The pids of the watchdogs that watch (marked their host's heartbeat file) under `runtime`."""
    snapshots = [heartbeat.read(path) for path in runtime.glob("stallwatch-*.hb")]
    return [snapshot["watchdog_pid"] for snapshot in snapshots if snapshot and snapshot["watchdog_pid"]]


def test_sigterm_to_every_process_of_gunicorn_as_systemd_stops_a_unit_keeps_each_watchdog_to_its_workers_end(
    tmp_path,
):
    telemetry, runtime = tmp_path / "telemetry", tmp_path / "run"
    runtime.mkdir()
    command = [sys.executable, "-m", "gunicorn", "served_app:app", "-k", "uvicorn.workers.UvicornWorker",
               "-w", "2", "-b", "127.0.0.1:0"]  # fmt: skip
    host = Served(command, _host_env(telemetry, XDG_RUNTIME_DIR=str(runtime)), cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        host.wait_for(r"Application startup complete", count=2)
        _spawn_requests(port)
        wait_until(lambda: len(_watched(runtime)) == 2, "each worker's watchdog watches")
        for pid in [host.process.pid, *descendants(host.process.pid)]:  # the whole cgroup, watchdogs included
            os.kill(pid, signal.SIGTERM)
        code = host.finish()
    finally:
        host.kill()

    assert code == 0, host.stderr()
    assert "freeze watchdog" not in host.stderr(), host.stderr()
    requests, _ = _host_spans(telemetry)
    assert requests == sorted(f"GET /spawn/{n}" for n in range(REQUESTS))
    wait_until(lambda: not list(runtime.glob("stallwatch-*")), "the watchdogs left and removed the heartbeat files")


def test_gunicorn_with_preload_stopping_its_forked_workers_keeps_every_workers_spans(tmp_path):
    # The workers are forks of a master that ran setup(); gunicorn's worker puts SIGTERM back to its
    # default action in each before uvicorn captures it.
    telemetry = tmp_path / "telemetry"
    command = [sys.executable, "-m", "gunicorn", "served_app:app", "-k", "uvicorn.workers.UvicornWorker",
               "-w", "2", "-b", "127.0.0.1:0", "--preload"]  # fmt: skip
    host = Served(command, _host_env(telemetry), cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        host.wait_for(r"Application startup complete", count=2)
        _spawn_requests(port)
        host.process.send_signal(signal.SIGTERM)
        code = host.finish()
    finally:
        host.kill()

    assert code == 0, host.stderr()
    requests, children = _host_spans(telemetry)
    assert requests == sorted(f"GET /spawn/{n}" for n in range(REQUESTS))
    assert len(children) == REQUESTS


_SCRIPT = """
import os, signal, sys, time
import stallwatch
from opentelemetry import trace

stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
tracer = trace.get_tracer("script")
for number in range(150):
    with tracer.start_as_current_span(f"step {number}"):
        pass
print("recorded", flush=True)
while True:
    time.sleep(0.05)
"""


def _script_until_sigterm(code: str, telemetry: Path) -> tuple[int, str]:
    command = [sys.executable, "-c", code]
    with subprocess.Popen(
        command, env=_host_env(telemetry), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as script:
        assert script.stdout.readline() == "recorded\n"
        script.send_signal(signal.SIGTERM)
        _, stderr = script.communicate(timeout=30)
        return script.returncode, stderr


def test_a_plain_script_ended_by_sigterm_exports_its_queued_spans_and_dies_by_sigterm(tmp_path):
    telemetry = tmp_path / "telemetry"
    code, stderr = _script_until_sigterm(_SCRIPT, telemetry)

    assert code == -signal.SIGTERM, stderr
    assert stderr == ""
    spans = otlp_items(telemetry / "traces.jsonl", "spans")
    assert sorted(span["name"] for span in spans) == sorted(f"step {n}" for n in range(150))


# An import finder that sleeps 1.5 s before the first import of `requests` (which the OTLP/HTTP
# exporter loads), longer than a 1 s budget, as a cold disk or a contended CPU would make an exporter's
# build; a sleep loads no CPU beside the other tests.
_SLOW_DISK = """
import importlib.abc, sys, time

class SlowDisk(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "requests":
            time.sleep(1.5)
        return None

"""


def test_a_script_whose_first_export_is_at_sigterm_builds_its_exporter_outside_the_budget_and_exports(receiver):
    # The exporter is built at the SIGTERM, slowly (`_SLOW_DISK`).
    slowed = 'sys.meta_path.insert(0, SlowDisk())\nprint("requests" in sys.modules, "recorded"'
    code = _SLOW_DISK + _SCRIPT.replace('print("recorded"', slowed)
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, NO_PROXY="127.0.0.1", STALLWATCH_SHUTDOWN_TIMEOUT="1",
                    OTEL_BSP_SCHEDULE_DELAY="60000", OTEL_LOGS_EXPORTER="none")  # fmt: skip
    with subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as script:
        assert script.stdout.readline() == "False recorded\n"  # nothing exported (nor built) before the SIGTERM
        script.send_signal(signal.SIGTERM)
        _, stderr = script.communicate(timeout=60)

    assert script.returncode == -signal.SIGTERM, stderr
    assert stderr == ""
    spans = otlp_received(receiver, "/v1/traces")
    assert sorted(span.name for span in spans) == sorted(f"step {n}" for n in range(150))


def test_a_sigterm_handler_the_host_installed_first_is_left_in_place(tmp_path):
    telemetry = tmp_path / "telemetry"
    host_handler = "import signal, sys\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
    code, stderr = _script_until_sigterm(host_handler + _SCRIPT, telemetry)

    assert code == 7, stderr  # the host's handler ran, and its exit flushed through atexit
    assert len(otlp_items(telemetry / "traces.jsonl", "spans")) == 150


def test_a_host_that_ignores_sigterm_keeps_ignoring_it(tmp_path):
    result = run_python(
        """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        import stallwatch

        stallwatch.setup(watchdog=False, file_dir=os.environ["TELEMETRY"])
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
        print("still here", flush=True)
        """,
        env=clean_env(TELEMETRY=str(tmp_path / "telemetry")),
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "still here\n"


def test_a_host_handler_installed_after_setup_replaces_stallwatchs(tmp_path):
    result = run_python(
        """
        import os, signal, sys
        import stallwatch

        stallwatch.setup(watchdog=False, file_dir=os.environ["TELEMETRY"])
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        signal.signal(signal.SIGTERM, lambda *a: print("host handler", flush=True))
        os.kill(os.getpid(), signal.SIGTERM)
        print("went on", flush=True)
        """,
        env=clean_env(TELEMETRY=str(tmp_path / "telemetry")),
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "host handler\nwent on\n"


@pytest.mark.serial  # a freeze threshold: not beside the other tests' load
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_uvicorn_flushing_to_a_collector_that_never_answers_keeps_its_loop_running_and_the_watchdog_quiet(
    tmp_path, loop
):
    # The flush after uvicorn's graceful shutdown waits for the collector up to the shutdown timeout;
    # on the loop, that wait would be a loop freeze longer than the threshold.
    runtime = tmp_path / "run"
    runtime.mkdir()
    command = [sys.executable, "-m", "uvicorn", "served_app:app", "--port", "0", "--loop", loop]
    with serve("silent") as endpoint:
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_METRIC_EXPORT_INTERVAL="3600000", XDG_RUNTIME_DIR=str(runtime),
            STALLWATCH_SHUTDOWN_TIMEOUT="6", STALLWATCH_FREEZE_THRESHOLD="3",
        )  # fmt: skip
        host = Served(command, env, cwd=SCENARIOS)
        try:
            port = int(host.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)").group(1))
            _spawn_requests(port)
            wait_until(lambda: len(_watched(runtime)) == 1, "the watchdog watches")
            host.process.send_signal(signal.SIGTERM)
            code = host.finish()
        finally:
            host.kill()

    assert code == -signal.SIGTERM, host.stderr()
    assert "Finished server process" in host.stderr()
    assert "freeze detected" not in host.stderr(), host.stderr()


_SERVERS = {  # how each is started, and how many workers record
    "uvicorn": (["uvicorn", "served_app:app", "--port", "0", "--loop", "asyncio"], 1),
    "uvicorn_workers": (["uvicorn", "served_app:app", "--port", "0", "--workers", "2"], 2),
    "gunicorn": (
        ["gunicorn", "served_app:app", "-k", "uvicorn.workers.UvicornWorker", "-w", "2", "-b", "127.0.0.1:0"],
        2,
    ),
    "gunicorn_preload": (
        [
            "gunicorn",
            "served_app:app",
            "-k",
            "uvicorn.workers.UvicornWorker",
            "-w",
            "2",
            "-b",
            "127.0.0.1:0",
            "--preload",
        ],
        2,
    ),
}


def _metric_exports(receiver: Receiver) -> dict[str, list[ExportMetricsServiceRequest]]:
    """The metric export requests the receiver got, by the `service.instance.id` of the process that sent them."""
    exports: dict[str, list[ExportMetricsServiceRequest]] = {}
    for body in receiver.bodies("/v1/metrics"):
        request = ExportMetricsServiceRequest.FromString(body)
        for resource in request.resource_metrics:
            instance = str(otlp_attributes(resource.resource)["service.instance.id"])
            exports.setdefault(instance, []).append(request)
    return exports


@pytest.mark.parametrize("server", list(_SERVERS))
def test_a_server_stopped_by_sigterm_exports_each_processs_metrics_once_with_every_spawn_counted(receiver, server):
    # The flush after uvicorn's graceful shutdown exports the metrics; where the process's own shutdown
    # follows (stallwatch's SIGTERM handler, atexit), its last collection would only repeat them. Without
    # the watchdog: no loop lag is sampled between the two, and no watchdog exports of its own.
    arguments, workers = _SERVERS[server]
    env = clean_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_METRIC_EXPORT_INTERVAL="3600000", STALLWATCH_WATCHDOG="false"
    )
    host = Served([sys.executable, "-m", *arguments], env, cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"(?:Uvicorn running on|Listening at:) http://127\.0\.0\.1:(\d+)").group(1))
        host.wait_for(r"Application startup complete", count=workers)
        _spawn_requests(port)
        host.process.send_signal(signal.SIGTERM)
        host.finish()
    finally:
        host.kill()

    exports = _metric_exports(receiver)
    assert len(exports) == workers + (server == "gunicorn_preload")  # a preloading master exports at its exit
    assert {instance: len(requests) for instance, requests in exports.items()} == dict.fromkeys(exports, 1)
    exits = [
        point.as_int
        for resource, _, metric in otlp_received_from(receiver, "/v1/metrics")
        if metric.name == "stallwatch.subprocess.exits"
        for point in metric.sum.data_points
        if otlp_attributes(point).get("process.executable.name") == "true"
    ]
    assert sum(exits) == REQUESTS


def test_a_worker_whose_first_export_is_the_flush_at_uvicorns_stop_builds_its_exporters_outside_the_budget(
    receiver,
):
    # As a `uvicorn --workers` worker: its first export is the flush at uvicorn's stop, whose exporter
    # builds slowly (`_SLOW_DISK`), and then uvicorn's re-raised SIGTERM ends it at the default action,
    # with no exit handler to export what the flush left.
    code = (
        _SLOW_DISK
        + """
import os, signal
import stallwatch
from opentelemetry import metrics, trace
from support.uvicorn_stop import serve_then_stop

stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
sys.meta_path.insert(0, SlowDisk())

def before_stop():
    metrics.get_meter("host").create_counter("host.stops").add(1)
    trace.get_tracer("host").start_span("before-stop").end()

serve_then_stop(before_stop=before_stop)
print("requests" in sys.modules, flush=True)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.raise_signal(signal.SIGTERM)
"""
    )
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, NO_PROXY="127.0.0.1", STALLWATCH_SHUTDOWN_TIMEOUT="1",
                    OTEL_BSP_SCHEDULE_DELAY="60000", OTEL_LOGS_EXPORTER="none")  # fmt: skip
    result = run_python(code, env=env)

    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stdout == "True\n"  # the flush built the exporters
    assert [span.name for span in otlp_received(receiver, "/v1/traces")] == ["before-stop"]
    assert _host_stops(receiver) == [1]


def test_what_a_process_records_after_uvicorns_stop_is_exported_at_its_exit_too(receiver):
    code = """
        import stallwatch
        from opentelemetry import metrics
        from support.uvicorn_stop import serve_then_stop

        stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
        stops = metrics.get_meter("host").create_counter("host.stops")
        serve_then_stop(before_stop=lambda: stops.add(1))
        stops.add(1)  # after the flush at uvicorn's stop: only the exit's export has it
        """
    result = run_python(code, env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url))

    assert result.returncode == 0, result.stderr
    stops = _host_stops(receiver)
    assert stops == [1, 2]


def _host_stops(receiver: Receiver) -> list[int]:
    """The points of the host's `host.stops` counter, in the order the receiver got them."""
    return [
        point.as_int
        for metric in otlp_received(receiver, "/v1/metrics")
        if metric.name == "host.stops"
        for point in metric.sum.data_points
    ]


def test_a_stopping_process_whose_first_export_builds_its_exporters_slowly_exports_its_metrics_once(receiver):
    # As test_a_server_stopped_by_sigterm_exports_each_processs_metrics_once...[gunicorn] at load ~22: the
    # first log export builds the exporters (slowly, `_SLOW_DISK`) while the server stops, and must neither
    # back off from the collector as if it were slow (the next record dropped as backend_slow) nor make the
    # exit's last collection differ from the flush's (the metrics sent twice).
    code = (
        _SLOW_DISK
        + """
import logging
import stallwatch
from support.uvicorn_stop import serve_then_stop

stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
print("requests" in sys.modules, flush=True)
sys.meta_path.insert(0, SlowDisk())

def before_stop():
    logging.getLogger("host").warning("first")
    logging.getLogger("host").warning("second")  # the next batch, queued while the first is exported

serve_then_stop(before_stop=before_stop)
"""
    )
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, NO_PROXY="127.0.0.1", OTEL_BLRP_MAX_EXPORT_BATCH_SIZE="1")
    result = run_python(code, env=env)

    if result.stdout == "True\n":  # SDKs without the metric exporter's preferences door, or the fast paths off
        pytest.skip("the OTLP/HTTP metric exporter is built at setup() here: no build is left for the first export")
    assert result.returncode == 0, result.stderr
    assert [log.body.string_value for log in otlp_received(receiver, "/v1/logs")] == ["first", "second"]
    assert len(receiver.bodies("/v1/metrics")) == 1


def _dropped(collector: Receiver) -> dict[tuple[str, str], int]:
    """The stallwatch.telemetry.dropped counts of the last metric export `collector` got, by signal and reason."""
    last = ExportMetricsServiceRequest.FromString(collector.bodies("/v1/metrics")[-1])
    counts = {}
    for metric in (metric for scope in last.resource_metrics[0].scope_metrics for metric in scope.metrics):
        for point in metric.sum.data_points if metric.name == "stallwatch.telemetry.dropped" else ():
            key = otlp_attributes(point)
            counts[key["stallwatch.telemetry.signal"], key["stallwatch.telemetry.drop_reason"]] = point.as_int
    return counts


@pytest.mark.parametrize("collector", ["slow", "refusing_once"])
def test_a_processs_last_metric_collection_is_sent_unless_the_flush_at_uvicorns_stop_delivered_the_same(collector):
    # slow: the flush's metric export outlasts the loop's wait for it (1 s + 0.5 s), so the exit's shutdown
    # starts while it is in flight; the exit's collection waits for it and, repeating it, is not sent.
    # refusing_once: the flush's export never reached the backend, so the exit's collection is sent.
    code = """
        import stallwatch
        from opentelemetry import metrics
        from support.uvicorn_stop import serve_then_stop

        stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
        stops = metrics.get_meter("host").create_counter("host.stops")
        serve_then_stop(before_stop=lambda: stops.add(1))
        """
    fault = {"slow": {"slow": {"/v1/metrics": 2.0}}, "refusing_once": {"refused": {"/v1/metrics": 1}}}[collector]
    with serving(**fault) as receiver:
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, NO_PROXY="127.0.0.1", STALLWATCH_SHUTDOWN_TIMEOUT="1")
        result = run_python(code, env=env)

    assert result.returncode == 0, result.stderr
    if collector == "slow":
        assert _host_stops(receiver) == [1]
        return
    assert _host_stops(receiver) == [1, 1]  # the refused export, then the exit's
    assert _dropped(receiver)["metrics", "export_failed"] == 1


@pytest.mark.parametrize("after_stop", [0, 2])
def test_with_delta_temporality_a_process_exports_at_its_exit_only_what_it_recorded_after_uvicorns_stop(
    receiver, after_stop
):
    # The flush at uvicorn's stop sent the deltas until then; the exit's collection holds only what came
    # after (zero deltas of the observable counters when nothing did): sent if anything is not zero.
    code = f"""
        import stallwatch
        from opentelemetry import metrics
        from support.uvicorn_stop import serve_then_stop

        stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
        stops = metrics.get_meter("host").create_counter("host.stops")
        serve_then_stop(before_stop=lambda: stops.add(1))
        if {after_stop}:
            stops.add({after_stop})
        """
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE="delta")
    result = run_python(code, env=env)

    assert result.returncode == 0, result.stderr
    stops = _host_stops(receiver)
    assert stops == ([1, after_stop] if after_stop else [1])  # deltas: 1 and 2 add up to what was recorded
    assert len(receiver.bodies("/v1/metrics")) == (2 if after_stop else 1)


def test_a_flush_at_uvicorns_stop_that_outlasts_its_wait_counts_no_asyncio_timeout_of_the_host(tmp_path):
    # The shutdown awaits the flush up to its budget (0.2 s here, plus 0.5 s); a span export to a collector
    # that answers after 2 s outlasts that wait. The wait is stallwatch's: not a host's expired timeout.
    telemetry = tmp_path / "telemetry"
    code = """
        import stallwatch
        from opentelemetry import trace
        from support.uvicorn_stop import serve_then_stop

        stallwatch.setup(watchdog=False, metrics_exporter="file", logs_exporter="none")
        serve_then_stop(before_stop=lambda: trace.get_tracer("host").start_span("before-stop").end())
        assert stallwatch.shutdown(30)
        """
    with serve("slow") as endpoint:
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, STALLWATCH_FILE_DIR=str(telemetry), STALLWATCH_SHUTDOWN_TIMEOUT="0.2"
        )
        result = run_python(code, env=env)

    assert result.returncode == 0, result.stderr
    assert metric_points(telemetry / "metrics.jsonl", "stallwatch.fork.count")  # the exit's metrics are there
    assert metric_points(telemetry / "metrics.jsonl", "stallwatch.asyncio.timeouts") == []


def test_a_scrape_after_uvicorns_stop_has_each_series_once():
    # A process that lives on after its server stopped: the flush at the stop must not leave a collection
    # queued in the pull reader, which the next scrape would serve beside its own.
    code = """
        import urllib.request
        import stallwatch
        from opentelemetry import metrics
        from support.uvicorn_stop import serve_then_stop

        session = stallwatch.setup(watchdog=False, metrics_exporter="prometheus", prometheus_port=0)
        metrics.get_meter("host").create_counter("host.stops").add(1)
        serve_then_stop()
        host, port = session.prometheus_address
        print(urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30).read().decode())
        """
    result = run_python(code, env=clean_env())

    assert result.returncode == 0, result.stderr
    assert [line.split("{")[0] for line in result.stdout.splitlines() if line.startswith("host_stops")] == [
        "host_stops_total"
    ], result.stdout


@pytest.mark.parametrize("end", ["exit", "sigterm"])
def test_the_metrics_a_flush_at_uvicorns_stop_exports_once_count_what_that_flush_failed_to_export(end):
    # The collector refuses the flush's log export. The flush's metrics must count that failure: a process
    # that then exits sends them once (its last collection repeats them), and one that uvicorn's re-raised
    # SIGTERM ends at the default action (a `uvicorn --workers` worker) sends nothing after the flush.
    code = f"""
        import logging, signal
        import stallwatch
        from support.uvicorn_stop import serve_then_stop

        stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
        serve_then_stop(before_stop=lambda: logging.getLogger("host").warning("stopping"))
        if {end!r} == "sigterm":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        """
    with serving(refused={"/v1/logs": sys.maxsize}) as collector:
        env = clean_env(  # the record waits for the flush
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, NO_PROXY="127.0.0.1", OTEL_BLRP_SCHEDULE_DELAY="60000"
        )
        result = run_python(code, env=env)

    assert result.returncode == (0 if end == "exit" else -signal.SIGTERM), result.stderr
    assert collector.bodies("/v1/logs")  # the flush's log export, refused
    assert len(collector.bodies("/v1/metrics")) == 1
    points = [
        (otlp_attributes(point), point.as_int)
        for metric in otlp_received(collector, "/v1/metrics")
        if metric.name == "stallwatch.telemetry.dropped"
        for point in metric.sum.data_points
    ]
    dropped = {(key["stallwatch.telemetry.signal"], key["stallwatch.telemetry.drop_reason"]): n for key, n in points}
    assert dropped["logs", "export_failed"] == 1


@pytest.mark.parametrize("end", ["exit", "sigterm"])
def test_the_last_metrics_a_process_exports_count_what_its_exits_span_and_log_exports_failed_to_export(end):
    # The collector refuses every span and log export; the span and the record wait for the exit's export. The
    # exit's last metric collection must come after both exports, or their failures are counted and never sent.
    code = f"""
        import logging, signal
        import stallwatch
        from opentelemetry import trace

        stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
        trace.get_tracer("host").start_span("stopping").end()
        logging.getLogger("host").warning("stopping")
        if {end!r} == "sigterm":
            signal.raise_signal(signal.SIGTERM)
        """
    with serving(refused={"/v1/traces": sys.maxsize, "/v1/logs": sys.maxsize}) as collector:
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, NO_PROXY="127.0.0.1")
        result = run_python(code, env=env)

    assert result.returncode == (0 if end == "exit" else -signal.SIGTERM), result.stderr
    assert len(collector.bodies("/v1/traces")) == len(collector.bodies("/v1/logs")) == 1  # refused
    assert len(collector.bodies("/v1/metrics")) == 1
    dropped = _dropped(collector)
    assert (dropped["traces", "export_failed"], dropped["logs", "export_failed"]) == (1, 1)


def test_a_record_a_hosts_opentelemetry_handler_makes_during_the_last_metric_export_is_sent_too():
    # The OTLP exporter logs the refused metric export; the host's own OpenTelemetry logging handler (bound to
    # stallwatch's provider) takes that line while the meter shuts down, after the exit's first log export.
    code = """
        import logging
        import stallwatch
        from opentelemetry.sdk._logs import LoggingHandler

        stallwatch.setup(watchdog=False, metric_export_interval_ms=3600000)
        logging.getLogger().addHandler(LoggingHandler())
        logging.getLogger("host").warning("stopping")
        """
    with serving(refused={"/v1/metrics": sys.maxsize}) as collector:
        result = run_python(code, env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, NO_PROXY="127.0.0.1"))

    assert result.returncode == 0, result.stderr
    bodies = [record.body.string_value for record in otlp_received(collector, "/v1/logs")]
    assert bodies[0] == "stopping" and bodies[1].startswith("Failed to export metrics"), bodies


def test_a_module_without_the_function_a_flush_hook_wraps_still_imports_with_one_warning():
    # A version of uvicorn or multiprocessing that renamed what stallwatch wraps: the host's import goes on.
    code = """
        import stallwatch, stallwatch.session
        stallwatch.setup(watchdog=False)
        stallwatch.session._wrap_once("colorsys", "Renamed.shutdown", lambda wrapped, instance, args, kwargs: None)
        import colorsys
        print(colorsys.rgb_to_hsv(0, 0, 0))
        """
    result = run_python(code, env=clean_env(STALLWATCH_FILE_DIR="/nonexistent-not-written"))

    assert result.returncode == 0, result.stderr
    assert result.stdout == "(0.0, 0.0, 0)\n"
    assert result.stderr.count("stallwatch: cannot wrap colorsys.Renamed.shutdown") == 1, result.stderr
