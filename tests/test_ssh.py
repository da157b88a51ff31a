"""SSH tunnel instrumentation against a real sshd on loopback and dstack's real SSHTunnel."""

from __future__ import annotations

import tempfile

import pytest

from conftest import attrs, clean_env, latest_total, metric_points, otlp_items, run_python, run_scenario
from otlp_receiver import otlp_metric_names, otlp_spans
from sshd_fixture import HTTP_BODY

ERROR = (2, "STATUS_CODE_ERROR")


@pytest.mark.parametrize(
    ("loop", "order", "extra"),
    [
        ("asyncio", "before", {}),
        ("uvloop", "after", {"STALLWATCH_UVLOOP_SPAWN": "fork"}),
        ("uvloop", "before", {}),
    ],
    ids=["asyncio-imported-before", "uvloop-fork-imported-after", "uvloop-vfork-default"],
)
def test_dstack_tunnel_open_close_and_a_failed_close_are_traced(sshd, http_server, tmp_path, loop, order, extra):
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:  # short: unix socket paths are limited
        result = run_scenario(
            "ssh_tunnel.py", str(tmp_path), loop, order, sshd.user, sshd.host, str(sshd.port), str(sshd.identity),
            str(http_server), sock_dir, env=clean_env(**extra), timeout=180,
        )  # fmt: skip
    assert result == {"body": HTTP_BODY.decode(), "check": True, "exec": "hi\n"}

    spans = otlp_items(tmp_path / "traces.jsonl", "spans")
    by_id = {s["spanId"]: s for s in spans}
    opens = [s for s in spans if s["name"] == "ssh.tunnel.open"]
    closes = [s for s in spans if s["name"] == "ssh.tunnel.close"]
    assert len(opens) == 3 and len(closes) == 3
    for span in opens + closes:
        a = attrs(span)
        assert a["server.address"] == "127.0.0.1" and a["server.port"] == str(sshd.port)
        assert sshd.user not in str(a)  # never the user name
        assert a["stallwatch.ssh.forwards.local"] == "1" and a["stallwatch.ssh.forwards.remote"] == "0"
        assert a["stallwatch.ssh.socket.kinds"] == "tcp,unix"
        assert a["stallwatch.ssh.control_socket"] is True and a["stallwatch.ssh.background"] is True
    # The ssh children nest under the tunnel spans, which nest under the host's request span.
    ssh_children = [s for s in spans if s["name"] == "ssh"]
    tunnels = {s["spanId"] for s in spans if s["name"].startswith("ssh.tunnel.")}
    by_loop = {  # dstack's own spawns on the loop (kill_master's subprocess.run is a Popen of the host's)
        attrs(s)["stallwatch.spawn.method"]
        for s in ssh_children
        if attrs(s)["stallwatch.spawn.loop"] == loop and s.get("parentSpanId") in tunnels
    }
    if loop == "uvloop":  # each went the way the setting says
        assert by_loop == ({"fork"} if extra else {"vfork"}), by_loop
    for op in opens + closes:
        assert any(child.get("parentSpanId") == op["spanId"] for child in ssh_children), op["name"]
    probe = next(s for s in spans if s["name"] == "probe")
    assert by_id[opens[0]["parentSpanId"]]["spanId"] == probe["spanId"]
    assert {s["name"] for s in spans if s.get("parentSpanId") == probe["spanId"]} >= {
        "ssh.tunnel.open", "ssh.tunnel.check", "ssh.tunnel.exec", "ssh.tunnel.close",
    }  # fmt: skip

    failed = [s for s in closes if s["status"].get("code") in ERROR]
    assert len(failed) == 1
    failure = attrs(failed[0])
    assert failure["stallwatch.ssh.exit.status"] == "255" and failure["error.type"] == "255"
    assert by_id[failed[0]["parentSpanId"]]["name"] == "probe-killed-master"
    assert all(s["status"].get("code") not in ERROR for s in opens + closes if s is not failed[0])

    metrics = tmp_path / "metrics.jsonl"
    failures = {"stallwatch.ssh.phase": "close", "error.type": "255"}
    assert latest_total(metrics, "stallwatch.ssh.tunnel.failures", **failures) == 1
    assert latest_total(metrics, "stallwatch.ssh.tunnel.failures") == 1
    assert latest_total(metrics, "stallwatch.ssh.tunnel.active") == 0
    (open_duration,) = metric_points(metrics, "stallwatch.ssh.tunnel.open.duration")
    assert int(open_duration["count"]) == 3 and float(open_duration["sum"]) > 0
    (close_duration,) = metric_points(metrics, "stallwatch.ssh.tunnel.close.duration")
    assert int(close_duration["count"]) == 3


def test_instrument_tunnel_on_a_custom_class_records_signal_deaths_and_exceptions(tmp_path):
    proc = run_python(
        f"""
        import asyncio, subprocess
        import stallwatch

        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)

        class Tunnel:
            def __init__(self, destination, port, fail=None):
                self.destination, self.port, self.fail = destination, port, fail
            def open(self):
                return subprocess.run(["sh", "-c", "exit 0"]).returncode
            async def aclose(self):
                if self.fail == "raise":
                    raise ConnectionError("gone")
                proc = await asyncio.create_subprocess_exec("sh", "-c", "kill -SEGV $$")
                return await proc.wait()

        stallwatch.instrument_tunnel(Tunnel, close=None, aopen=None)
        first = Tunnel("ops@bastion.example", 2222)
        print(first.open())
        print(asyncio.run(first.aclose()))
        t = Tunnel("bastion.example", None, fail="raise")
        t.open()
        try:
            asyncio.run(t.aclose())
        except ConnectionError as exc:
            print("raised", exc)
        stallwatch.shutdown(10)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["0", "-11", "raised gone"]
    spans = otlp_items(tmp_path / "traces.jsonl", "spans")
    closes = [attrs(s) | {"status": s["status"]} for s in spans if s["name"] == "ssh.tunnel.close"]
    assert len(closes) == 2
    segv = next(c for c in closes if c.get("stallwatch.exit.signal") == "SIGSEGV")
    assert segv["stallwatch.ssh.exit.status"] == "-11" and segv["error.type"] == "SIGSEGV"
    assert segv["server.address"] == "bastion.example" and segv["server.port"] == "2222"
    raised = next(c for c in closes if c.get("error.type") == "ConnectionError")
    assert raised["status"].get("code") in ERROR and "server.port" not in raised
    metrics = tmp_path / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.ssh.tunnel.failures", **{"stallwatch.exit.signal": "SIGSEGV"}) == 1
    assert latest_total(metrics, "stallwatch.ssh.tunnel.failures", **{"error.type": "ConnectionError"}) == 1
    assert latest_total(metrics, "stallwatch.ssh.tunnel.active") == 0


def test_instrument_tunnel_rejects_a_method_of_the_wrong_kind():
    proc = run_python(
        """
        import stallwatch
        class Tunnel:
            def aopen(self): ...
        try:
            stallwatch.instrument_tunnel(Tunnel, open=None, close=None, aclose=None)
        except TypeError as exc:
            print(exc)
        """
    )
    assert "Tunnel.aopen is not a coroutine function" in proc.stdout, proc.stderr


def test_tunnel_spans_and_metrics_reach_an_otlp_receiver(sshd, http_server, receiver, tmp_path):
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:
        run_scenario(
            "ssh_tunnel.py", str(tmp_path), "asyncio", "after", sshd.user, sshd.host, str(sshd.port),
            str(sshd.identity), str(http_server), sock_dir, env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url),
            timeout=180,
        )  # fmt: skip
    names = [span.name for span in otlp_spans(receiver)]
    assert names.count("ssh.tunnel.open") == 3 and names.count("ssh.tunnel.close") == 3 and "ssh" in names
    assert {
        "stallwatch.ssh.tunnel.open.duration", "stallwatch.ssh.tunnel.close.duration", "stallwatch.ssh.tunnel.active",
        "stallwatch.ssh.tunnel.failures",
    } <= otlp_metric_names(receiver)  # fmt: skip
