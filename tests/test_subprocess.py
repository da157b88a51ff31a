"""Subprocess instrumentation: every spawn path gives one span and metrics, and the host sees no difference."""

from __future__ import annotations

import subprocess

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from conftest import attrs, clean_env, latest_total, metric_points, otlp_items, run_python, run_scenario
from otlp_receiver import otlp_metric_names, otlp_spans

pytestmark = pytest.mark.matrix  # Popen/asyncio internals differ across CPython versions

StatusCode = Status.StatusCode

PROPAGATION_CASES = {"env_seen", "async_env_seen"}
LOOPS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("uvloop", {"STALLWATCH_UVLOOP_SPAWN": "fork"}),  # uvloop's own fork, the opt-out
    "uvloop-vfork": ("uvloop", {}),  # the default
}


def _popen_method_for_path(method: str) -> str:
    """How Popen spawns an executable given with its path (`/bin/echo`) when `method` is `vfork`.

    CPython 3.13 uses posix_spawn for it when the C library can close descriptors there (glibc 2.34+);
    `sh`, with no path, still goes through vfork. The span reports what really happened.
    """
    closefrom = getattr(subprocess, "_HAVE_POSIX_SPAWN_CLOSEFROM", False)
    return "posix_spawn" if method == "vfork" and closefrom and subprocess._USE_POSIX_SPAWN else method


def spans_by_case(path):
    return [s for s in otlp_items(path, "spans") if s["kind"] in (3, "SPAN_KIND_CLIENT")]


def find(spans, name, **match):
    found = [s for s in spans if s["name"] == name and all(attrs(s).get(k) == v for k, v in match.items())]
    assert found, f"no span {name} {match}; have {sorted({s['name'] for s in spans})}"
    return found


@pytest.mark.parametrize("loop", LOOPS)
def test_every_spawn_path_gives_a_span_and_the_host_sees_the_same_results(loop, tmp_path):
    loop_name, extra = LOOPS[loop]
    off = run_scenario("spawn_paths.py", "off", loop_name)
    on_env = clean_env(STALLWATCH_PROPAGATE_TO_CHILDREN="true", **extra)
    on = run_scenario("spawn_paths.py", "on", loop_name, str(tmp_path), env=on_env)

    assert {k: v for k, v in on.items() if k not in PROPAGATION_CASES} == {
        k: v for k, v in off.items() if k not in PROPAGATION_CASES
    }
    assert off["exec_segv"] == ["ok", -11] and off["missing"][:2] == ["raised", "FileNotFoundError"]
    # Trace context reaches the children's environment, never the host's.
    assert on["env_seen"] == ["ok", True] and on["async_env_seen"] == ["ok", True]
    assert off["env_seen"] == ["ok", False] and on["environ_untouched"] is True

    spans = spans_by_case(tmp_path / "traces.jsonl")
    for span in spans:
        a = attrs(span)
        assert a["process.executable.name"] == span["name"]
        assert float(a["stallwatch.spawn.blocked_seconds"]) > 0
        assert a["stallwatch.spawn.method"] in ("fork", "vfork", "posix_spawn")
        assert "process.command_args" not in a  # off by default: name and count only
    exit3 = attrs(find(spans, "sh", **{"process.exit.code": "3"})[0])
    assert exit3["error.type"] == "3" and exit3["stallwatch.spawn.loop"] == "none"
    assert exit3["stallwatch.spawn.method"] == "vfork"
    missing = find(spans, "prog")
    assert {attrs(s)["error.type"] for s in missing} == {"FileNotFoundError"}
    assert all("process.pid" not in attrs(s) for s in missing)
    assert all(s["status"].get("code") in (2, "STATUS_CODE_ERROR") for s in missing)
    killed = attrs(find(spans, "sleep", **{"stallwatch.exit.signal": "SIGSEGV"})[0])
    assert killed["process.exit.code"] == "-11" and killed["error.type"] == "SIGSEGV"
    spawned = attrs(find(spans, "sh", **{"process.exit.code": "5"})[0])
    assert spawned["stallwatch.spawn.method"] == "posix_spawn"
    assert find(spans, "true", **{"stallwatch.spawn.method": "posix_spawn"})

    # SIGSEGV right after the loop's own spawn, but from the program it ran: not the incident's signature.
    method = {"asyncio": "vfork", "uvloop": "fork", "uvloop-vfork": "vfork"}[loop]
    segv = find(spans, "sh", **{"stallwatch.exit.signal": "SIGSEGV"})[0]
    assert attrs(segv)["stallwatch.spawn.loop"] == loop_name
    assert attrs(segv)["stallwatch.spawn.method"] == method
    assert attrs(segv)["stallwatch.subprocess.exec"] == "done" and "events" not in segv
    echo = attrs(find(spans, "echo", **{"stallwatch.spawn.loop": loop_name})[0])
    assert echo["process.exit.code"] == "0" and "error.type" not in echo
    assert echo["stallwatch.spawn.method"] == _popen_method_for_path(method)
    assert attrs(find(spans, "exit", **{"process.exit.code": "7"})[0])["stallwatch.spawn.loop"] == loop_name
    assert "stallwatch.subprocess.running_at_shutdown" not in str(spans)

    metrics = tmp_path / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.subprocess.exits", **{"stallwatch.exit.signal": "SIGSEGV"}) == 2
    assert latest_total(metrics, "stallwatch.subprocess.exits", **{"stallwatch.exit.kind": "code"}) == 13
    assert latest_total(metrics, "stallwatch.subprocess.exits", **{"stallwatch.exit.signal": "SIGTERM"}) == 1
    assert latest_total(metrics, "stallwatch.subprocess.active") == 0
    durations = {
        (a["process.executable.name"], a["stallwatch.spawn.loop"], a["stallwatch.spawn.method"])
        for a in map(attrs, metric_points(metrics, "stallwatch.subprocess.spawn.duration"))
    }
    assert ("echo", loop_name, _popen_method_for_path(method)) in durations and (
        "sh",
        "none",
        "posix_spawn",
    ) in durations


def test_arguments_are_recorded_only_when_asked_and_scrubbed(tmp_path):
    code = """
        import subprocess, sys
        import stallwatch
        stallwatch.setup(file_dir=sys.argv[1] if len(sys.argv) > 1 else {dir!r}, watchdog=False)
        subprocess.run(["sh", "-c", "true", "sh", "--password=hunter2-secret", "-i", "/home/ops/.ssh/id_prod",
                        "https://bob:tok3n-secret@example.com/x", "--keep-this"])
        stallwatch.shutdown(10)
    """
    for record, directory in (("false", tmp_path / "default"), ("true", tmp_path / "recorded")):
        proc = run_python(code.format(dir=str(directory)), env=clean_env(STALLWATCH_RECORD_ARGS=record))
        assert proc.returncode == 0, proc.stderr
    default = attrs(find(spans_by_case(tmp_path / "default" / "traces.jsonl"), "sh")[0])
    assert default["process.args_count"] == "9" and "process.command_args" not in default
    recorded = find(spans_by_case(tmp_path / "recorded" / "traces.jsonl"), "sh")[0]
    text = str(recorded)
    assert "--keep-this" in text and "example.com" in text
    for secret in ("hunter2-secret", "tok3n-secret", "/home/ops", "bob"):
        assert secret not in text


def test_a_child_still_running_at_shutdown_ends_its_span_marked(tmp_path):
    proc = run_python(
        f"""
        import subprocess
        import stallwatch
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        child = subprocess.Popen(["sleep", "30"])
        stallwatch.shutdown(10)
        child.kill()
        child.wait()
        """
    )
    assert proc.returncode == 0, proc.stderr
    (span,) = find(spans_by_case(tmp_path / "traces.jsonl"), "sleep")
    assert attrs(span)["stallwatch.subprocess.running_at_shutdown"] is True


def test_a_fork_child_that_lives_on_never_reports_its_parents_children(tmp_path):
    """The parent's running child is the parent's: a fork child's own shutdown must not end or report it."""
    proc = run_python(
        f"""
        import os, subprocess
        import stallwatch
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        subprocess.run(["true"])
        running = subprocess.Popen(["sleep", "2"])
        pid = os.fork()
        if pid == 0:
            subprocess.run(["echo"], stdout=subprocess.DEVNULL)  # the child's own: reported
            stallwatch.shutdown(10)
            os._exit(0)
        print(os.waitpid(pid, 0)[1])
        print(running.wait())
        stallwatch.shutdown(10)
        """,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "0"]
    spans = spans_by_case(tmp_path / "traces.jsonl")
    assert sorted(s["name"] for s in spans) == ["echo", "sleep", "true"]
    (sleep,) = find(spans, "sleep")
    assert "stallwatch.subprocess.running_at_shutdown" not in attrs(sleep)


def test_uninstrument_restores_uvloop_and_instrumenting_again_wraps_it_once(tmp_path):
    proc = run_python(
        f"""
        import asyncio
        import uvloop
        import stallwatch
        from stallwatch.instrument.subprocess import SubprocessInstrumentor

        names = ("subprocess_exec", "subprocess_shell")
        originals = [vars(uvloop.Loop)[name] for name in names]
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)

        async def spawn(program):
            child = await asyncio.create_subprocess_exec(program)
            return await child.wait()

        instrumentor = SubprocessInstrumentor()
        print(uvloop.run(spawn("true")))
        instrumentor.uninstrument()
        print([vars(uvloop.Loop)[name] is original for name, original in zip(names, originals)])
        print(uvloop.run(spawn("false")))
        for _ in range(3):
            instrumentor.instrument()
            instrumentor.uninstrument()
        instrumentor.instrument()
        print(uvloop.run(spawn("true")))
        instrumentor.uninstrument()
        print([vars(uvloop.Loop)[name] is original for name, original in zip(names, originals)])
        stallwatch.shutdown(10)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["0", "[True, True]", "1", "0", "[True, True]"]
    spans = spans_by_case(tmp_path / "traces.jsonl")
    # One span per uvloop child while instrumented (two `true`), none for `false` in between:
    # re-instrumenting never stacks a second wrapper on uvloop's Loop.
    assert sorted(span["name"] for span in spans) == ["true", "true"]
    assert {attrs(span)["stallwatch.spawn.loop"] for span in find(spans, "true")} == {"uvloop"}


def test_spawn_spans_and_metrics_reach_an_otlp_receiver(receiver, tmp_path):
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url)
    run_scenario("spawn_paths.py", "on", "uvloop", str(tmp_path), env=env)

    spans = otlp_spans(receiver)
    segv = [s for s in spans if s.name == "sh" and s.status.code == StatusCode.STATUS_CODE_ERROR]
    attributes = [{a.key: a.value for a in s.attributes} for s in segv]
    assert any(a.get("stallwatch.exit.signal") and a["stallwatch.exit.signal"].string_value == "SIGSEGV"
               and a["stallwatch.spawn.loop"].string_value == "uvloop" for a in attributes)  # fmt: skip
    assert {"echo", "true", "cat", "sleep", "prog"} <= {s.name for s in spans}
    assert {
        "stallwatch.subprocess.spawn.duration", "stallwatch.subprocess.exits", "stallwatch.subprocess.active",
    } <= otlp_metric_names(receiver)  # fmt: skip
    assert not (tmp_path / "traces.jsonl").exists()
