"""paramiko instrumentation against a real sshd on loopback, driven by the real paramiko client."""

from __future__ import annotations

import socket
import subprocess
import textwrap

import pytest

from conftest import attrs, clean_env, latest_total, metric_points, otlp_items, run_python

ERROR = (2, "STATUS_CODE_ERROR")

CONNECT = """
    import os, signal, sys, time
    import stallwatch
    {import_before}
    stallwatch.setup(file_dir={out!r}, watchdog=False)
    import paramiko

    def client():
        c = paramiko.SSHClient()
        c.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        return c

    def connect(c, port={port}, key={identity!r}):
        c.connect("{host}", port=port, username="{user}", key_filename=key, look_for_keys=False, allow_agent=False,
                  timeout=30)
"""


def _run(sshd, tmp_path, body: str, import_before: str = "", **env: str) -> list[str]:
    code = textwrap.dedent(CONNECT).format(
        import_before=import_before, out=str(tmp_path), port=sshd.port, identity=str(sshd.identity),
        host=sshd.host, user=sshd.user,
    ) + textwrap.dedent(body) + "\nstallwatch.shutdown(10)\n"  # fmt: skip
    proc = run_python(code, env=clean_env(**env), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stallwatch" not in proc.stderr, proc.stderr
    return proc.stdout.splitlines()


def _spans(tmp_path, name: str) -> list[dict]:
    return [s for s in otlp_items(tmp_path / "traces.jsonl", "spans") if s["name"] == name]


@pytest.mark.parametrize(
    ("import_before", "record_args"),
    [("import paramiko", "false"), ("", "true")],
    ids=["paramiko-imported-before-setup", "paramiko-imported-after-setup-recording-args"],
)
def test_a_connection_its_commands_and_an_sftp_session_are_traced_with_their_outcomes(
    sshd, tmp_path, import_before, record_args
):
    out = _run(
        sshd, tmp_path,
        """
        c = client()
        connect(c)
        _, echo_out, _ = c.exec_command("API_TOKEN=hunter2-secret echo hi")
        print(echo_out.read().decode().strip())  # its exit status is never asked for (the channel is kept)
        _, stdout, _ = c.exec_command("exit 3")
        print(stdout.channel.recv_exit_status())
        sftp = c.open_sftp()
        print(sorted(sftp.listdir("/"))[:1] != [])
        sftp.close()
        c.close()
        """,
        import_before=import_before, STALLWATCH_RECORD_ARGS=record_args,
    )  # fmt: skip
    assert out == ["hi", "3", "True"]

    (connection,) = _spans(tmp_path, "ssh.connection")
    a = attrs(connection)
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == str(sshd.port)
    assert a["stallwatch.ssh.auth"] == "success" and sshd.user not in str(connection)
    assert connection["status"].get("code") not in ERROR
    assert [e["name"] for e in connection.get("events", [])] == ["stallwatch.ssh.connected"]

    commands = {attrs(s).get("stallwatch.ssh.command.exit_status"): s for s in _spans(tmp_path, "ssh.command")}
    assert set(commands) == {"0", "3"}, [attrs(s) for s in commands.values()]
    ok, failed = attrs(commands["0"]), attrs(commands["3"])
    assert ok["server.address"] == "127.0.0.1" and ok["process.executable.name"] == "echo"
    assert commands["0"]["status"].get("code") not in ERROR
    assert failed["error.type"] == "3" and commands["3"]["status"].get("code") in ERROR
    assert "hunter2-secret" not in (tmp_path / "traces.jsonl").read_text()
    if record_args == "true":
        assert ok["process.command_args"] == {"values": [{"stringValue": "API_TOKEN=[REDACTED] echo hi"}]}
    else:
        assert "process.command_args" not in ok

    (sftp,) = _spans(tmp_path, "ssh.sftp")
    assert attrs(sftp)["server.port"] == str(sshd.port) and sftp["status"].get("code") not in ERROR

    metrics = tmp_path / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.ssh.connections.active") == 0
    assert latest_total(metrics, "stallwatch.ssh.connection.failures") == 0
    (connect_duration,) = metric_points(metrics, "stallwatch.ssh.connect.duration")
    assert int(connect_duration["count"]) == 1 and float(connect_duration["sum"]) > 0
    by_outcome = {
        attrs(p).get("error.type"): int(p["count"]) for p in metric_points(metrics, "stallwatch.ssh.command.duration")
    }
    assert by_outcome == {None: 1, "3": 1}


def test_a_refused_connection_and_a_rejected_key_end_their_spans_in_error_and_count_as_failures(sshd, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    wrong_key = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong_key)], check=True, timeout=30)
    out = _run(
        sshd, tmp_path,
        f"""
        try:
            connect(client(), port={closed_port})
        except paramiko.ssh_exception.NoValidConnectionsError:
            print("refused")
        try:
            connect(client(), key={str(wrong_key)!r})
        except paramiko.AuthenticationException:
            print("rejected")
        """,
    )  # fmt: skip
    assert out == ["refused", "rejected"]

    spans = {attrs(s)["error.type"]: s for s in _spans(tmp_path, "ssh.connection")}
    assert set(spans) == {"NoValidConnectionsError", "AuthenticationException"}
    refused, rejected = attrs(spans["NoValidConnectionsError"]), attrs(spans["AuthenticationException"])
    assert refused["server.port"] == str(closed_port) and "stallwatch.ssh.auth" not in refused
    assert rejected["server.port"] == str(sshd.port) and rejected["stallwatch.ssh.auth"] == "failure"
    assert all(s["status"].get("code") in ERROR for s in spans.values())

    metrics = tmp_path / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.ssh.connection.failures", **{"error.type": "NoValidConnectionsError"}) == 1
    rejected_labels = {"error.type": "AuthenticationException", "stallwatch.ssh.auth": "failure"}
    assert latest_total(metrics, "stallwatch.ssh.connection.failures", **rejected_labels) == 1
    assert latest_total(metrics, "stallwatch.ssh.connections.active") == 0


def test_a_remote_command_killed_mid_run_ends_its_span_with_the_signal_and_a_dropped_one_as_closed(sshd, tmp_path):
    out = _run(
        sshd, tmp_path,
        """
        c = client()
        connect(c)
        _, stdout, _ = c.exec_command("echo $$; exec sleep 60")
        pid = int(stdout.readline())
        os.kill(pid, signal.SIGKILL)
        print(stdout.channel.recv_exit_status())
        _, stdout, _ = c.exec_command("echo started; exec sleep 60")
        print(stdout.readline().strip())
        stdout.channel.close()  # the host gives up on it
        c.close()
        """,
    )  # fmt: skip
    assert out == ["-1", "started"]

    commands = {attrs(s)["error.type"]: s for s in _spans(tmp_path, "ssh.command")}
    assert set(commands) == {"SIGKILL", "closed"}
    killed = attrs(commands["SIGKILL"])
    assert killed["stallwatch.exit.signal"] == "SIGKILL" and "stallwatch.ssh.command.exit_status" not in killed
    assert "stallwatch.ssh.command.exit_status" not in attrs(commands["closed"])
    assert all(s["status"].get("code") in ERROR for s in commands.values())
    by_outcome = {
        attrs(p)["error.type"]: int(p["count"])
        for p in metric_points(tmp_path / "metrics.jsonl", "stallwatch.ssh.command.duration")
    }
    assert by_outcome == {"SIGKILL": 1, "closed": 1}


def test_instrumenting_again_never_stacks_wrappers_and_the_setting_turns_it_off(sshd, tmp_path):
    out = _run(
        sshd, tmp_path,
        """
        from stallwatch.instrument.paramiko import ParamikoInstrumentor
        original = paramiko.SSHClient.connect.__wrapped__
        for _ in range(3):
            ParamikoInstrumentor().uninstrument()
            ParamikoInstrumentor().instrument()
        print(paramiko.SSHClient.connect.__wrapped__ is original)
        c = client()
        connect(c)
        c.close()
        ParamikoInstrumentor().uninstrument()
        print(paramiko.SSHClient.connect is original, paramiko.Channel._set_closed.__name__)
        c = client()
        connect(c)
        c.close()
        """,
        import_before="import paramiko",
    )  # fmt: skip
    assert out == ["True", "True _set_closed"]
    assert len(_spans(tmp_path, "ssh.connection")) == 1

    off = tmp_path / "off"
    body = "c = client()\nconnect(c)\nc.close()\nprint(hasattr(paramiko.SSHClient.connect, '__wrapped__'))"
    out = _run(sshd, off, body, STALLWATCH_INSTRUMENT_SSH="false")
    assert out == ["False"]
    assert not _spans(off, "ssh.connection")
