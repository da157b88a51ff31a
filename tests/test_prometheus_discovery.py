"""Prometheus finds every endpoint stallwatch serves (`export.targets`): each writes its file for `file_sd_configs`
while it serves, and a multi-process server's workers each serve on a port of their own instead of turning their
telemetry off. Real processes, a real uvicorn under `stallwatch run` and a real Prometheus on the shipped config."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import SCENARIOS, clean_env
from stallwatch.export import targets
from support.loopback import HeldPort, free_port, prometheus_env, scrape
from support.served import SPAWNING_APP, Served
from support.waiting import wait_until

BIN = Path(sys.executable).parent

# Registers a host endpoint in argv[1] for argv[2] (a port), prints the file's name, then waits for stdin to close.
_REGISTERING = """
import sys
from pathlib import Path
from stallwatch.export import targets
target = targets.register(Path(sys.argv[1]), "host", f"localhost:{sys.argv[2]}", int(sys.argv[2]))
print(target.path.name, flush=True)
sys.stdin.read()
"""


def _registering(directory: Path, port: int) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _REGISTERING, str(directory), str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def _swept_elsewhere(directory: Path) -> int:
    """What `sweep()` removes, run by another process (a process never sweeps its own files)."""
    code = "import pathlib, sys; from stallwatch.export import targets; print(targets.sweep(pathlib.Path(sys.argv[1])))"
    swept = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=60)
    assert swept.returncode == 0, swept.stderr
    return int(swept.stdout)


def test_a_target_file_names_the_endpoint_for_file_sd_while_its_process_lives_and_goes_at_remove(tmp_path):
    directory = tmp_path / "targets"
    target = targets.register(directory, "watchdog", targets.target_address("127.0.0.1", 9465), 9465)

    assert target.path == directory / f"watchdog-{os.getpid()}-9465.json"
    assert json.loads(target.path.read_text()) == [{"targets": ["127.0.0.1:9465"], "labels": {}}]
    assert [p.name for p in directory.iterdir()] == [target.path.name]  # no temporary file left
    assert _swept_elsewhere(directory) == 0  # locked by this process: in use
    assert target.path.exists()
    target.remove()
    assert list(directory.iterdir()) == []
    target.remove()  # twice: nothing happens


def test_the_target_files_of_killed_processes_are_swept_and_nothing_else(tmp_path):
    directory = tmp_path / "targets"
    killed, killed_name = _registering(directory, 9464)
    live, live_name = _registering(directory, 9466)
    killed.kill()  # no remove(): the file stays behind
    killed.wait(30)
    unfinished = directory / f".writing-host-{killed.pid}-9467.json"  # killed between its write and its rename
    unfinished.write_text("[")
    old = time.time() - targets.UNFINISHED_SECONDS - 1
    os.utime(unfinished, (old, old))
    writing = directory / ".writing-host-1-9469.json"  # as young as a file a process is writing: kept
    writing.write_text("")
    others = [directory / "notes.json", directory / "host-listed.json"]  # a user's, e.g. static targets
    for path in others:
        path.write_text("[]")
    try:
        assert (directory / killed_name).exists()
        mine = targets.register(directory, "host", "localhost:9468", 9468)  # sweeps first
        kept = {live_name, mine.path.name, writing.name, *(p.name for p in others)}
        assert {p.name for p in directory.iterdir()} == kept
        assert _swept_elsewhere(directory) == 0
        mine.remove()
    finally:
        live.communicate("", timeout=30)


def test_a_fork_child_never_withdraws_its_parents_endpoint(tmp_path):
    target = targets.register(tmp_path, "host", "localhost:9464", 9464)
    pid = os.fork()
    if pid == 0:
        target.remove()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert target.path.exists()
    assert _swept_elsewhere(tmp_path) == 0  # and the child's exit released no lock of the parent's
    target.remove()
    assert not target.path.exists()


def test_a_wildcard_bind_is_dialled_at_localhost_and_an_ipv6_one_in_brackets():
    assert targets.target_address("0.0.0.0", 9464) == "localhost:9464"
    assert targets.target_address("::", 9464) == "localhost:9464"
    assert targets.target_address("::1", 9464) == "[::1]:9464"
    assert targets.target_address("localhost", 9464) == "localhost:9464"


_GROUP_HOLDER = """
import socket, subprocess, sys
held = socket.create_server(("127.0.0.1", 0))
print(held.getsockname()[1], flush=True)
sys.stdin.read()
"""


def test_a_port_is_this_servers_when_a_process_of_its_group_or_that_ones_watchdog_holds_it():
    group = os.getpgrp()
    with HeldPort() as elsewhere:  # another session: another program
        assert not targets.shared_with_this_server(elsewhere, group)
    member = subprocess.Popen([sys.executable, "-c", _GROUP_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert member.stdout is not None
        held = int(member.stdout.readline())
        assert targets.shared_with_this_server(held, group)  # as uvicorn's supervisor holds its workers' port
        assert not targets.shared_with_this_server(held, group + 100_000)  # no such group
    finally:
        member.kill()
        member.wait(30)
    assert not targets.shared_with_this_server(free_port(), group)  # nobody holds it


def test_a_host_whose_port_its_parent_holds_serves_on_a_free_port_registered_and_withdrawn_at_shutdown(tmp_path):
    # The parent (this test) is in the host's process group, as `stallwatch run`'s uvicorn supervisor is.
    directory = tmp_path / "targets"
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        code = """
            import json, os, sys
            from pathlib import Path
            import stallwatch
            session = stallwatch.setup()
            files = sorted(p.name for p in Path(sys.argv[1]).iterdir())
            address = session.prometheus_address
            stallwatch.shutdown()
            print(json.dumps({"error": session.error, "address": address, "files": files, "pid": os.getpid(),
                              "after": sorted(p.name for p in Path(sys.argv[1]).iterdir())}))
            """
        env = clean_env(
            **prometheus_env(port, STALLWATCH_WATCHDOG="false", OTEL_TRACES_EXPORTER="none", OTEL_LOGS_EXPORTER="none"),
            STALLWATCH_PROMETHEUS_TARGETS_DIR=str(directory),
        )
        run = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(directory)], env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["error"] is None, run.stderr
    assert report["address"][1] not in (0, port)
    assert report["files"] == [f"host-{report['pid']}-{report['address'][1]}.json"]
    assert report["after"] == []
    assert "cannot listen" not in run.stderr


def _kill_group(served: Served) -> None:
    """Kill the server and whatever is left of its process group: a failed test leaves its workers behind."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(served.process.pid, signal.SIGKILL)
    served.kill()


def _target_files(directory: Path) -> dict[str, list[str]]:
    """Kind -> the targets its files list, as Prometheus reads them (the shipped patterns)."""
    listed = {kind: [json.loads(p.read_text()) for p in directory.glob(f"{kind}-*.json")] for kind in targets.KINDS}
    return {kind: [target for file in files for target in file[0]["targets"]] for kind, files in listed.items()}


@pytest.mark.serial  # the shipped 15 s scrape interval: a few scrapes in a bounded time
def test_every_uvicorn_worker_under_stallwatch_run_is_scraped_through_the_shipped_file_sd_with_its_watchdog(tmp_path):
    pytest.importorskip("uvloop")
    pytest.importorskip("yaml", reason="needs pyyaml (the test extras)")
    from support.prometheus import HAVE_PROMETHEUS, Prometheus

    if not HAVE_PROMETHEUS:
        pytest.skip("needs prometheus: apt-get install prometheus")
    directory = tmp_path / "targets"
    (tmp_path / "spawning_app.py").write_text(SPAWNING_APP)
    port, host_port, watchdog_port = free_port(), free_port(), free_port()
    env = clean_env(
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        **prometheus_env(host_port, watchdog_port),
        OTEL_TRACES_EXPORTER="file",
        OTEL_LOGS_EXPORTER="file",
        STALLWATCH_FILE_DIR=str(tmp_path / "telemetry"),
        STALLWATCH_PROMETHEUS_TARGETS_DIR=str(directory),
    )
    del env["PYTHONPATH"]  # the launcher's own
    command = [str(BIN / "stallwatch"), "run", "--", "uvicorn", "spawning_app:app", "--workers", "2", "--loop",
               "uvloop", "--port", str(port)]  # fmt: skip
    directory.mkdir()
    prometheus = Prometheus.shipped(tmp_path, discovered=directory)
    served = Served(command, env=env, cwd=tmp_path, own_group=True)  # a shell's job: a process group of its own
    try:
        served.wait_for(r"Application startup complete", count=2, timeout=120)
        # The supervisor, both workers, and a freeze watchdog for each.
        wait_until(lambda: [len(v) for v in _target_files(directory).values()] == [3, 3], "every endpoint registered")
        workers = set()
        requests = 12
        for _ in range(requests):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
                workers.add(int(response.read()))
        registered = _target_files(directory)
        prometheus.wait_until_up(6, timeout=90)
        children = 'stallwatch_subprocess_spawn_duration_seconds_count{job="stallwatch",process_executable_name="true"}'
        spawns = f"sum({children})"
        wait_until(lambda: _value(prometheus.query(spawns)) == requests, "Prometheus saw every request's spawn",
                   timeout=90)  # fmt: skip
        up = {(s["metric"]["job"], s["metric"]["instance"]): s["value"][1] for s in prometheus.query("up")}
        by_worker = prometheus.query(f"sum by (instance) ({children})")
        served.process.send_signal(signal.SIGTERM)
        assert served.finish() == 0, served.stderr()
        wait_until(lambda: not list(directory.iterdir()), "every endpoint withdrew its target at its stop")
    finally:
        _kill_group(served)
        prometheus.stop()

    assert "cannot listen" not in served.stderr() and "Telemetry is off" not in served.stderr(), served.stderr()
    assert up == {
        **{("stallwatch", target): "1" for target in registered["host"]},
        **{("stallwatch-watchdog", target): "1" for target in registered["watchdog"]},
    }
    assert f"127.0.0.1:{host_port}" in registered["host"] and f"127.0.0.1:{watchdog_port}" in registered["watchdog"]
    assert len([s for s in by_worker if _value([s]) > 0]) == len(workers)  # each serving worker, scraped on its own


def _value(result: list[dict]) -> float:
    return float(result[0]["value"][1]) if result else 0.0


def test_each_worker_gunicorn_forks_after_preload_serves_its_own_series_and_withdraws_them_at_its_stop(tmp_path):
    # The master set up and serves 9464; its forked workers inherit the reader but not its server thread.
    pytest.importorskip("gunicorn")
    pytest.importorskip("uvicorn")
    directory = tmp_path / "targets"
    env = clean_env(
        **prometheus_env(free_port(), free_port()),
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        STALLWATCH_PROMETHEUS_TARGETS_DIR=str(directory),
    )
    command = [sys.executable, "-m", "gunicorn", "served_app:app", "-k", "uvicorn.workers.UvicornWorker",
               "-w", "2", "-b", "127.0.0.1:0", "--preload"]  # fmt: skip
    host = Served(command, env, cwd=SCENARIOS, own_group=True)
    try:
        port = int(host.wait_for(r"Listening at: http://127\.0\.0\.1:(\d+)").group(1))
        host.wait_for(r"Application startup complete", count=2)
        # The master's and each worker's endpoint, and a watchdog for each.
        wait_until(lambda: [len(v) for v in _target_files(directory).values()] == [3, 3], "every endpoint registered")
        requests = 12
        for _ in range(requests):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
                assert response.read() == b"0"
        endpoints = _target_files(directory)["host"]
        spawns = {target: _spawns(scrape(int(target.rpartition(":")[2]))) for target in endpoints}
        host.process.send_signal(signal.SIGTERM)
        assert host.finish() == 0, host.stderr()
        wait_until(lambda: not list(directory.iterdir()), "every endpoint withdrew its target at its stop")
    finally:
        _kill_group(host)

    assert sum(spawns.values()) == requests, spawns  # served by the workers' own endpoints
    assert spawns[f"127.0.0.1:{env['OTEL_EXPORTER_PROMETHEUS_PORT']}"] == 0  # the master's serves the master's only


def _spawns(scraped: str) -> float:
    """The spawns of `true` one endpoint's scrape counts."""
    return sum(
        float(line.rpartition(" ")[2])
        for line in scraped.splitlines()
        if line.startswith("stallwatch_subprocess_spawn_duration_seconds_count{")
        and 'process_executable_name="true"' in line
    )
