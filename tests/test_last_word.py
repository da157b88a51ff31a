"""A frozen host that is killed (as the load balancer killed incident 000's): its watchdog's last word,
how long the host had been frozen and why, reaches the OTLP backend and a real Prometheus scraping at
the shipped 15 s before the watchdog exits, and the shipped alerts say so."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import SCENARIOS, attrs, clean_env, otlp_items
from otlp_receiver import otlp_attributes, otlp_gauge_points, otlp_logs, otlp_spans
from support.loopback import HeldPort, free_port, prometheus_env, scrape
from support.processes import is_gone
from support.waiting import wait_until

pytestmark = [
    pytest.mark.matrix,
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watchdog needs pidfd_open (Linux 5.3+)"),
]
KILLED = "stallwatch.freeze.host_killed"
FROZEN_AT = {"stallwatch.freeze.kind": "gil_held", "stallwatch.freeze.cause": "child_before_exec"}


def _frozen_host(telemetry_dir: Path, stderr: Path, **env: str) -> tuple[subprocess.Popen[str], int]:
    """A uvloop host that freezes (GIL held, a forked child sleeping before exec) 0.5 s after its watchdog
    watches, for longer than any test waits; and its watchdog's pid."""
    host = subprocess.Popen(
        [sys.executable, str(SCENARIOS / "freeze_probe.py"), str(telemetry_dir), "300"],
        env=clean_env(**env), stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True,
    )  # fmt: skip
    assert host.stdout is not None
    return host, json.loads(host.stdout.readline())["watchdog_pid"]


def _kill_frozen_child(child_pid: int) -> None:
    """The host's copy that sleeps before exec outlives the killed host: end it with the test."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child_pid, signal.SIGKILL)


def _detected(logs: Path) -> list[dict]:
    """The watchdog's "freeze detected" records in the file exporter's logs."""
    records = otlp_items(logs, "logs") if logs.exists() else []
    return [record for record in records if "freeze detected" in record["body"]["stringValue"]]


def test_a_host_killed_while_frozen_reaches_the_otlp_backend_with_how_long_and_why_before_its_watchdog_exits(
    receiver, telemetry_dir, tmp_path
):
    host, watchdog_pid = _frozen_host(telemetry_dir, tmp_path / "stderr", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url)
    detected = lambda: [r for r in otlp_logs(receiver) if "freeze detected" in r.body.string_value]  # noqa: E731
    wait_until(detected, "the watchdog reported the freeze")
    child_pid = int(otlp_attributes(detected()[0])["stallwatch.freeze.child.pid"])  # type: ignore[arg-type]
    try:
        host.send_signal(signal.SIGKILL)
        host.wait(10)
        wait_until(lambda: is_gone(watchdog_pid), "the watchdog exited", timeout=60)
    finally:
        _kill_frozen_child(child_pid)

    (span,) = [s for s in otlp_spans(receiver) if s.name == "stallwatch.freeze"]
    assert otlp_attributes(span)["stallwatch.freeze.outcome"] == "host_killed"
    assert otlp_attributes(span)["stallwatch.freeze.cause"] == "child_before_exec"
    frozen_for = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    last_words = [p for p in otlp_gauge_points(receiver, KILLED) if p.as_double > 0]
    assert last_words, "no stallwatch.freeze.host_killed above 0 reached the backend"
    assert {(k, v) for k, v in otlp_attributes(last_words[-1]).items()} >= set(FROZEN_AT.items())
    assert last_words[-1].as_double == pytest.approx(frozen_for, abs=0.5)
    assert frozen_for >= 1.0  # the freeze threshold
    over = [r for r in otlp_logs(receiver) if "freeze over after" in r.body.string_value]
    assert [otlp_attributes(r)["stallwatch.freeze.outcome"] for r in over] == ["host_killed"]


@pytest.mark.serial  # time bounds at the shipped 15 s scrape: not beside the other tests' load
def test_a_host_killed_while_frozen_leaves_a_critical_alert_firing_on_prometheus_at_the_shipped_scrape_interval(
    telemetry_dir, tmp_path
):
    pytest.importorskip("yaml", reason="needs pyyaml (the test extras)")
    from support.prometheus import HAVE_PROMETHEUS, HOST_JOB, WATCHDOG_JOB, Prometheus

    if not HAVE_PROMETHEUS:
        pytest.skip("needs prometheus: apt-get install prometheus")
    host_port, watchdog_port = free_port(), free_port()
    prometheus = Prometheus.shipped(
        tmp_path, {HOST_JOB: [f"127.0.0.1:{host_port}"], WATCHDOG_JOB: [f"127.0.0.1:{watchdog_port}"]}
    )
    assert prometheus.scrape_interval == 15
    child_pid = 0
    started = time.time()
    try:
        host, watchdog_pid = _frozen_host(
            telemetry_dir,
            tmp_path / "stderr",
            **prometheus_env(host_port, watchdog_port),
        )
        logs = telemetry_dir / "logs.jsonl"
        wait_until(lambda: _detected(logs), "the watchdog reported the freeze")
        child_pid = int(attrs(_detected(logs)[0])["stallwatch.freeze.child.pid"])
        prometheus.wait_for_alert("FreezeActive", timeout=90, **{k.replace(".", "_"): v for k, v in FROZEN_AT.items()})
        host.send_signal(signal.SIGKILL)
        host.wait(10)
        killed_at = time.time()
        wait_until(lambda: is_gone(watchdog_pid), "the watchdog exited", timeout=60)
        lingered = time.time() - killed_at
        fired = prometheus.wait_for_alert(
            "FrozenHostKilled", timeout=60, **{k.replace(".", "_"): v for k, v in FROZEN_AT.items()}
        )
        still_frozen = prometheus.alerts("FreezeActive")
        down = prometheus.wait_for_alert("HostDown", state="pending", timeout=90, job=HOST_JOB)
        recorded = prometheus.query("max_over_time(stallwatch_freeze_host_killed_seconds[5m]) > 0")
    finally:
        if child_pid:
            _kill_frozen_child(child_pid)
        prometheus.stop()

    # The watchdog left after the first scrape that began after the death (within an interval or two at
    # 15 s), not at the end of its 35 s timeout, which it would have said.
    assert "no Prometheus scrape came" not in (tmp_path / "stderr").read_text(), lingered
    assert lingered < 35, lingered
    assert fired["labels"]["severity"] == "critical"
    assert "died frozen (gil_held, child_before_exec)" in fired["annotations"]["summary"]
    (series,) = recorded
    assert series["metric"]["job"] == WATCHDOG_JOB
    assert 1.0 <= float(series["value"][1]) <= killed_at - started  # from the freeze's start to the death
    assert float(fired["value"]) == pytest.approx(float(series["value"][1]), rel=1e-3)
    assert still_frozen == []  # the last scrape said the host is no longer frozen: it is dead
    assert down["labels"]["instance"] == f"127.0.0.1:{host_port}"


def test_a_restarted_hosts_watchdog_serves_the_port_once_the_watchdog_of_the_host_that_died_frozen_has_left(
    telemetry_dir, tmp_path
):
    watchdog_port = free_port()
    patient = {"STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT": "60"}  # nobody scrapes until the new host is watched
    killed, old_watchdog = _frozen_host(
        telemetry_dir, tmp_path / "killed.stderr", **prometheus_env(free_port(), watchdog_port, **patient)
    )
    child_pid = 0
    restarted = None
    try:
        logs = telemetry_dir / "logs.jsonl"
        wait_until(lambda: _detected(logs), "the watchdog reported the freeze")
        child_pid = int(attrs(_detected(logs)[0])["stallwatch.freeze.child.pid"])
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        restarted = subprocess.Popen(  # as a supervisor restarts it: same settings, its watchdog the same port
            [sys.executable, "-c", RESTARTED_HOST],
            env=clean_env(**prometheus_env(free_port(), watchdog_port, **patient)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=(tmp_path / "restarted.stderr").open("w"), text=True,
        )  # fmt: skip
        assert restarted.stdout is not None
        assert json.loads(restarted.stdout.readline())["watchdog_pid"]  # its new watchdog watches it already
        assert not is_gone(old_watchdog)  # still waiting for the scrape that carries the death
        last_word = scrape(watchdog_port)
        wait_until(lambda: is_gone(old_watchdog), "the old watchdog left after its scrape")
        wait_until(lambda: f'stallwatch_watched_pid="{restarted.pid}"' in scrape(watchdog_port),
                   "the new watchdog served the port")  # fmt: skip
    finally:
        if restarted is not None:
            restarted.kill()
            restarted.wait(10)
        if child_pid:
            _kill_frozen_child(child_pid)

    assert f'stallwatch_watched_pid="{killed.pid}"' in last_word
    assert any(
        line.startswith("stallwatch_freeze_host_killed_seconds{")
        and 'stallwatch_freeze_kind="gil_held"' in line
        and not line.endswith(" 0.0")
        for line in last_word.splitlines()
    ), last_word[-3000:]
    assert "cannot listen" not in (tmp_path / "restarted.stderr").read_text()


def test_a_watchdog_whose_port_stays_busy_says_so_once_and_serves_it_when_it_frees(tmp_path):
    holder = HeldPort()
    port = holder.port
    stderr = tmp_path / "stderr"
    host = subprocess.Popen(
        [sys.executable, "-c", RESTARTED_HOST],
        env=clean_env(**prometheus_env(free_port(), port, STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT="1")),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True,
    )  # fmt: skip
    try:
        assert host.stdout is not None
        assert json.loads(host.stdout.readline())["watchdog_pid"]  # it watches its host with its port busy
        wait_until(lambda: f"port {port} is busy" in stderr.read_text(), "the watchdog said its port is busy")
        holder.free()
        wait_until(lambda: f'stallwatch_watched_pid="{host.pid}"' in scrape(port), "it served the port")
    finally:
        holder.free()
        host.kill()
        host.wait(10)

    lines = stderr.read_text().splitlines()
    assert [line for line in lines if "is busy" in line] == [
        f"stallwatch watchdog (host pid {host.pid}): port {port} is busy; the watchdog serves Prometheus once it "
        "is free (STALLWATCH_WATCHDOG_PROMETHEUS_PORT)"
    ]


RESTARTED_HOST = """
import json, sys
import stallwatch
session = stallwatch.setup()
assert session.wait_for_watchdog(30), "not watched"
print(json.dumps({"watchdog_pid": session.watchdog_pid}), flush=True)
sys.stdin.read()
"""


def test_a_scrape_already_in_flight_when_the_wait_begins_is_not_the_one_that_carries_the_last_word():
    """The watchdog's wait ends with a scrape that began after the death: one that collected its metrics
    before it (here, held inside its collect) answers with the host still frozen."""
    from prometheus_client import CollectorRegistry, start_http_server

    from stallwatch.export.scrapes import ScrapeCounter

    collecting, finish = threading.Event(), threading.Event()

    class HeldFirstCollect:
        def collect(self) -> Iterator[object]:
            collecting.set()
            assert finish.wait(30)
            return iter(())

    registry = CollectorRegistry()
    registry.register(HeldFirstCollect())
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    scrapes = ScrapeCounter(server.get_app())
    server.set_app(scrapes)
    port = server.server_address[1]
    try:
        before_any = scrapes.mark()
        in_flight = threading.Thread(target=scrape, args=(port,))
        in_flight.start()
        assert collecting.wait(30)
        during = scrapes.mark()  # the death, while that scrape collects
        finish.set()
        in_flight.join(30)
        assert scrapes.wait(before_any, 30)  # that scrape has been answered and counted
        assert not scrapes.wait(during, 0)  # but it began before the death
        assert "no answer" not in scrape(port)
        assert scrapes.wait(during, 30)
    finally:
        server.shutdown()
        server.server_close()
