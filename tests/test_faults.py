"""Issue 9, item 3: a fault inside stallwatch never reaches the host (a matrix of wrappers and faults).

Each cell runs in a fresh interpreter. The host makes its calls once before `setup()`, with no
wrapper installed (the reference), then `setup()` runs, the fault is injected, and the host makes
the same calls again. What an on-call engineer relies on is then checked: the host saw the same
values and exceptions, `stallwatch.instrumentation.errors{stallwatch.component}` counted the
faults in the exported metrics, and exactly one WARNING named the setting that turns that part off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from conftest import attrs, clean_env, latest_total, otlp_items
from otlp_receiver import Receiver
from stallwatch.journal import scan

# ---- the host's calls, one workload per wrapper --------------------------------------------------

PRELUDE = """
import asyncio, json, os, signal, subprocess, sys, time
import stallwatch

def outcome(call):
    try:
        value = call()
    except Exception as exc:
        return ["raised", type(exc).__qualname__, str(exc)]
    return ["returned", value]

def instrument():  # what the host does after setup() (e.g. instrument_tunnel)
    pass
"""

POPEN = """
def host_calls():
    return {
        "exit code": outcome(lambda: subprocess.run(["sh", "-c", "exit 3"]).returncode),
        "output": outcome(lambda: subprocess.check_output(["echo", "hi"], text=True)),
        "check_call": outcome(lambda: subprocess.check_call(["false"])),
        "missing program": outcome(lambda: subprocess.run(["/nonexistent/program"])),
        "killed": outcome(lambda: subprocess.run(["sh", "-c", "kill -9 $$"]).returncode),
    }
"""

LOOP_SPAWNS = """
async def spawns():
    exec_ = await asyncio.create_subprocess_exec("sh", "-c", "echo exec; exit 4", stdout=subprocess.PIPE)
    shell = await asyncio.create_subprocess_shell("echo shell; exit 5", stdout=subprocess.PIPE)
    results = []
    for proc in (exec_, shell):
        out, _ = await proc.communicate()
        results.append([out.decode(), proc.returncode])
    return results

async def missing():
    await asyncio.create_subprocess_exec("/nonexistent/program")

def host_calls():
    return {"spawns": outcome(lambda: run(spawns())), "missing program": outcome(lambda: run(missing()))}
"""

ASYNCIO_SPAWNS = "run = asyncio.run\n" + LOOP_SPAWNS
UVLOOP_SPAWNS = "import uvloop\nrun = uvloop.run\n" + LOOP_SPAWNS  # the default: stallwatch's vfork spawn
# uvloop's own fork, the opt-out, as `setup(uvloop_spawn="fork")` leaves it (the host's setup() keeps the default).
UVLOOP_FORK_SPAWNS = (
    """
import uvloop
from stallwatch.forksafe import uvloop_spawn

def run(main):
    uvloop_spawn.disable()
    return uvloop.run(main)
"""
    + LOOP_SPAWNS
)

POSIX_SPAWN = """
def spawned(function, program, argv):
    pid = function(program, argv, os.environ)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)

def waited4(argv):
    pid = os.posix_spawnp(argv[0], argv, os.environ)
    return os.waitstatus_to_exitcode(os.wait4(pid, 0)[1])

def host_calls():
    return {
        "posix_spawn": outcome(lambda: spawned(os.posix_spawn, "/bin/sh", ["sh", "-c", "exit 6"])),
        "posix_spawnp": outcome(lambda: spawned(os.posix_spawnp, "sh", ["sh", "-c", "kill -TERM $$"])),
        "wait4": outcome(lambda: waited4(["sh", "-c", "exit 7"])),
        "missing program": outcome(lambda: spawned(os.posix_spawn, "/nonexistent/program", ["program"])),
    }
"""

SIGNALS = """
import uvloop

def killed(kill, **kwargs):
    child = subprocess.Popen(["sleep", "30"], **kwargs)
    sent = outcome(lambda: kill(child))
    return [sent, child.wait()]

def pidfd_kill(child):
    pidfd = os.pidfd_open(child.pid)
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)

def bad_then_kill(child):
    try:
        os.kill(child.pid, 12345)  # no such signal: EINVAL
    finally:
        child.kill()

async def process_calls():
    proc = await asyncio.create_subprocess_exec("sleep", "30")
    proc.kill()
    code = await proc.wait()
    return [code, outcome(proc.kill)]  # once it exited: ProcessLookupError from either loop

def host_calls():
    gone = subprocess.Popen(["true"])
    gone.wait()
    return {
        "Popen.kill": outcome(lambda: killed(lambda c: c.kill())),
        "os.kill": outcome(lambda: killed(lambda c: os.kill(c.pid, signal.SIGTERM))),
        "os.killpg": outcome(lambda: killed(lambda c: os.killpg(c.pid, signal.SIGKILL), start_new_session=True)),
        "pidfd_send_signal": outcome(lambda: killed(pidfd_kill)),
        "bad signal": outcome(lambda: killed(bad_then_kill)),
        "reaped pid": outcome(lambda: os.kill(gone.pid, signal.SIGTERM)),
        "asyncio Process": outcome(lambda: asyncio.run(process_calls())),
        "uvloop Process": outcome(lambda: uvloop.run(process_calls())),
    }
"""

TUNNEL_CLASS = """
class Tunnel:  # a host's own tunnel class: real children, a close that fails
    destination, port = "user@127.0.0.1", 2222

    def open(self):
        return subprocess.run(["sh", "-c", "exit 0"]).returncode

    def close(self):
        code = subprocess.run(["sh", "-c", "exit 255"]).returncode
        raise OSError(5, f"close failed: exit status {code}")

    async def aopen(self):
        proc = await asyncio.create_subprocess_exec("true")
        return await proc.wait()

    async def aclose(self):
        raise ConnectionResetError("peer went away")

def instrument():
    stallwatch.instrument_tunnel(Tunnel)

def host_calls():
    tunnel = Tunnel()
    return {
        "open": outcome(tunnel.open), "close": outcome(tunnel.close),
        "aopen": outcome(lambda: asyncio.run(tunnel.aopen())), "aclose": outcome(lambda: asyncio.run(tunnel.aclose())),
        "reopen": outcome(tunnel.open),
    }
"""

DSTACK_TUNNEL = """
from pathlib import Path
from dstack._internal.core.services.ssh import tunnel as tunnel_module
from support.ssh_tunnels import get_through, loopback_tunnel

USER, HOST, PORT, IDENTITY, HTTP_PORT, SOCK_DIR = sys.argv[1:]
runs = iter(range(100))

def make(sock):
    return loopback_tunnel(USER, HOST, PORT, IDENTITY, HTTP_PORT, sock)

async def session(sock):
    tunnel = make(sock)
    await tunnel.aopen()
    body = await get_through(sock)
    checked = await tunnel.acheck()
    said = await tunnel.aexec("echo hi")
    await tunnel.aclose()
    return [body, checked, said]

def sync_session(sock):
    tunnel = make(sock)
    tunnel.open()
    tunnel.close()
    return "closed"

def host_calls():
    sock = Path(SOCK_DIR) / f"http-{next(runs)}.sock"
    return {"async": outcome(lambda: asyncio.run(session(sock))), "sync": outcome(lambda: sync_session(sock))}
"""

PARAMIKO = """
import socket
import paramiko

USER, HOST, PORT, IDENTITY = sys.argv[1:5]
with socket.socket() as probe:  # a port nothing listens on
    probe.bind(("127.0.0.1", 0))
    CLOSED_PORT = probe.getsockname()[1]

def connect(port):
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(HOST, port=port, username=USER, key_filename=IDENTITY, look_for_keys=False, allow_agent=False,
                   timeout=30)
    return client

def session():
    client = connect(int(PORT))
    _, stdout, _ = client.exec_command("echo hi; exit 3")
    said, status = stdout.read().decode(), stdout.channel.recv_exit_status()
    _, stdout, _ = client.exec_command("kill -KILL $$")
    killed = stdout.channel.recv_exit_status()
    sftp = client.open_sftp()
    listed = len(sftp.listdir("/")) > 0
    sftp.close()
    client.close()
    return [said, status, killed, listed]

def host_calls():
    return {"session": outcome(session), "refused": outcome(lambda: connect(CLOSED_PORT))}
"""

NEBIUS = """
from nebius.api.nebius.common.v1 import ResourceMetadata
from nebius.api.nebius.compute.v1 import (
    CreateInstanceRequest, DeleteInstanceRequest, GetInstanceRequest, InstanceServiceClient,
)
from support.fake_nebius import FakeNebius, sdk_for

fake = FakeNebius().start()

async def calls():
    results = {}
    async with sdk_for(fake.address) as sdk:
        instances = InstanceServiceClient(sdk)
        operation = await instances.create(
            CreateInstanceRequest(metadata=ResourceMetadata(name="vm", parent_id="project-e00test")), timeout=5)
        await operation.wait(interval=0.02, timeout=5)
        results["created"] = [operation.resource_id.split("-")[0], operation.done()]
        got = await instances.get(GetInstanceRequest(id=operation.resource_id), timeout=5)
        results["got"] = got.metadata.name
        try:
            await instances.get(GetInstanceRequest(id="computeinstance-missing"), timeout=5)
        except Exception as exc:
            status = getattr(getattr(exc, "status", None), "code", None)
            results["missing"] = ["raised", type(exc).__qualname__, getattr(status, "name", None)]
        deleted = await instances.delete(DeleteInstanceRequest(id=operation.resource_id), timeout=5)
        results["deleted"] = deleted.resource_id == operation.resource_id
    return results

def host_calls():
    return outcome(lambda: asyncio.run(calls()))
"""

# Executor items are submitted inside a sampled trace, so the wrapper builds a span per item.
SAMPLED_PARENT = """
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

def sampled(function):
    parent = NonRecordingSpan(SpanContext(0x5A1, 0x5A2, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    with trace.use_span(parent):
        return function()
"""

EXECUTOR_SUBMIT = (
    SAMPLED_PARENT
    + """
from concurrent.futures import ThreadPoolExecutor

def pool_calls():
    with ThreadPoolExecutor(2, thread_name_prefix="host-pool") as pool:
        squares = [pool.submit(pow, n, 2).result() for n in range(4)]
        mapped = list(pool.map(str.upper, ["a", "b"]))
        failed = outcome(lambda: pool.submit(int, "x").result())
    return [squares, mapped, failed]

def host_calls():
    return {"pool": sampled(pool_calls), "second pool": sampled(pool_calls)}
"""
)

TO_THREAD = (
    SAMPLED_PARENT
    + """
async def thread_calls():
    loop = asyncio.get_running_loop()
    total = await asyncio.to_thread(sum, [1, 2, 3])
    upper = await loop.run_in_executor(None, str.upper, "to_thread")
    try:
        await asyncio.to_thread(int, "y")
    except ValueError as exc:
        return [total, upper, ["raised", "ValueError", str(exc)]]

def host_calls():
    return {"first loop": sampled(lambda: asyncio.run(thread_calls())),
            "second loop": sampled(lambda: asyncio.run(thread_calls()))}
"""
)

EXECUTION_TIMEOUT = (
    SAMPLED_PARENT
    + """
async def guarded_thread():
    async with stallwatch.execution_timeout(0.1, name="request"):
        await asyncio.to_thread(time.sleep, 0.3)

@stallwatch.execution_timeout(5, name="decorated")
async def in_time():
    return await asyncio.to_thread(pow, 2, 10)

async def wait_for():
    return await asyncio.wait_for(asyncio.sleep(5), 0.05)

async def timeout_scope():
    async with asyncio.timeout(0.05):
        await asyncio.sleep(5)

async def wait():
    task = asyncio.ensure_future(asyncio.sleep(5))
    done, pending = await asyncio.wait({task}, timeout=0.05)
    task.cancel()
    return [len(done), len(pending)]

def host_calls():
    run = lambda coroutine: sampled(lambda: asyncio.run(coroutine()))  # noqa: E731
    return {name: outcome(lambda: run(coroutine)) for name, coroutine in [
        ("execution_timeout", guarded_thread), ("again", guarded_thread), ("in time", in_time),
        ("wait_for", wait_for), ("asyncio.timeout", timeout_scope), ("asyncio.wait", wait),
    ]}
"""
)


# ---- the faults -----------------------------------------------------------------------------------

# The tracer stallwatch got from the global provider raises on every span start: in start_span, and
# in the sampler, which stallwatch's light spans (core/light_span.py) consult without it.
TRACER = """
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import id_generator, sampling

def start_span(self, *args, **kwargs):
    raise RuntimeError("injected: tracer")

sdk_trace.Tracer.start_span = start_span
for sampler in (sampling.ParentBased, sampling.StaticSampler, sampling.TraceIdRatioBased):
    sampler.should_sample = start_span
# stallwatch's light spans skip the default sampler when its answer is known; every span needs an id
id_generator.RandomIdGenerator.generate_span_id = start_span
"""

# Every synchronous instrument raises, except the one that counts stallwatch's own faults, and so do
# the histograms stallwatch aggregates itself.
METER = """
from opentelemetry.sdk.metrics._internal import instrument as sdk_instruments

def broken(original):
    def call(self, *args, **kwargs):
        if self.name == "stallwatch.instrumentation.errors":
            return original(self, *args, **kwargs)
        raise RuntimeError("injected: meter")
    return call

for cls, method in [(sdk_instruments.Counter, "add"), (sdk_instruments.UpDownCounter, "add"),
                    (sdk_instruments.Histogram, "record")]:
    setattr(cls, method, broken(getattr(cls, method)))

# stallwatch's own duration histograms, which the pipeline aggregates instead of the SDK's
from stallwatch.core import histograms

def own_record(self, *args, **kwargs):
    raise RuntimeError("injected: meter")

for method in ("record", "record_many", "record_values"):
    setattr(histograms.OwnHistogram, method, own_record)
"""

# The function that turns the host's arguments into span attributes raises.
ATTRIBUTES = """
def broken(*args, **kwargs):
    raise RuntimeError("injected: attributes")

import {module} as module
module.{function} = broken
"""

SUBPROCESS = ("subprocess", "STALLWATCH_INSTRUMENT_SUBPROCESS", ("stallwatch.core.scrub", "executable_name"))
SSH = ("ssh", "STALLWATCH_INSTRUMENT_SSH", ("stallwatch.instrument.tunnels", "describe_generic"))
NEBIUS_CALLS = ("nebius", "STALLWATCH_INSTRUMENT_NEBIUS", ("stallwatch.instrument.nebius", "_operation_ids"))
EXECUTOR = ("executor", "STALLWATCH_INSTRUMENT_EXECUTOR", ("stallwatch.instrument.pools", "executor_name"))
TIMEOUTS = ("executor", "STALLWATCH_INSTRUMENT_EXECUTOR", ("stallwatch.timeout", "_call_site"))
# wrapper: (the host's calls, component, setting that turns it off, (module, attribute builder),
#           faults counted when the attribute builder raises: one per wrapped call)
WRAPPERS = {
    "Popen": (POPEN, *SUBPROCESS, 5),
    "asyncio subprocess_exec/shell": (ASYNCIO_SPAWNS, *SUBPROCESS, 3),  # one per child: named at its exit
    "uvloop subprocess_exec/shell": (UVLOOP_SPAWNS, *SUBPROCESS, 3),
    "uvloop subprocess_exec/shell, uvloop's own fork": (UVLOOP_FORK_SPAWNS, *SUBPROCESS, 3),
    "os.posix_spawn + wait": (POSIX_SPAWN, *SUBPROCESS, 4),
    # the host's signals to its children: one fault per signal sent to a child not yet reaped
    "os.kill, os.killpg, pidfd_send_signal, Process.kill": (
        SIGNALS,
        "subprocess",
        "STALLWATCH_INSTRUMENT_SUBPROCESS",
        ("stallwatch.instrument.child_fate", "_note"),
        8,
    ),
    "instrument_tunnel": (TUNNEL_CLASS, *SSH, 5),
    "dstack SSHTunnel": (DSTACK_TUNNEL, *SSH, 6),  # aopen, acheck, aexec, aclose, open, close
    "paramiko": (PARAMIKO, "ssh", "STALLWATCH_INSTRUMENT_SSH", ("stallwatch.instrument.paramiko", "_peer"), 2),
    "Nebius request": (NEBIUS, *NEBIUS_CALLS, 5),  # create, the operation's poll, get, get, delete
    "ThreadPoolExecutor.submit": (EXECUTOR_SUBMIT, *EXECUTOR, 2),  # one per executor built
    "asyncio.to_thread": (TO_THREAD, *EXECUTOR, 2),
    "execution_timeout": (EXECUTION_TIMEOUT, *TIMEOUTS, 3),  # wait_for, asyncio.timeout, asyncio.wait
}


def fault_code(fault: str, builder: tuple[str, str]) -> str:
    if fault == "tracer":
        return TRACER
    if fault == "meter":
        return METER
    module, function = builder
    return ATTRIBUTES.format(module=module, function=function)


def child(workload: str, *, setup: str, fault: str = "", before_setup: str = "", after_calls: str = "") -> str:
    """A host that makes its calls, sets stallwatch up, meets the fault, and makes them again."""
    return "\n".join(
        textwrap.dedent(part)
        for part in (
            PRELUDE,
            workload,
            "reference = host_calls()",
            before_setup,
            f"stallwatch_session = stallwatch.setup({setup}, metric_export_interval_ms=3600000)",
            fault,
            """
            instrument()
            faulted = host_calls()
            """,
            after_calls,
            """
            from opentelemetry import metrics
            metrics.get_meter_provider().force_flush()  # a periodic export while the host runs
            stallwatch.shutdown(10)
            print(json.dumps({"reference": reference, "faulted": faulted}))
            """,
        )
    )


def run_child(code: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env or clean_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def files(directory: Path) -> str:
    return f"file_dir={str(directory)!r}"


# ---- what the on-call engineer sees ---------------------------------------------------------------


def fault_warnings(file_dir: Path) -> dict[str, list[str]]:
    """stallwatch's fault WARNINGs in the exported logs, by the setting they name."""
    found: dict[str, list[str]] = {}
    for record in otlp_items(file_dir / "logs.jsonl", "logs"):
        body = record["body"].get("stringValue", "")
        if 13 <= record.get("severityNumber", 0) <= 16 and "=false to turn this part off" in body:  # WARN
            setting = body.rsplit("Set ", 1)[1].split("=false", 1)[0]
            found.setdefault(setting, []).append(body)
    return found


def assert_contained(
    result: dict, stderr: str, file_dir: Path, component: str, setting: str, at_least: int = 2, exactly: int = 0
) -> None:
    """Same values and exceptions; faults counted; one WARNING per component, naming its setting."""
    assert result["faulted"] == result["reference"]
    # Nothing escaped elsewhere: no SDK callback, thread, task or finalizer reported an exception.
    leaks = ("Callback failed", "Exception in thread", "Exception ignored", "exception was never retrieved")
    assert not [leak for leak in leaks if leak in stderr], stderr
    errors = latest_total(
        file_dir / "metrics.jsonl", "stallwatch.instrumentation.errors", **{"stallwatch.component": component}
    )
    if exactly:
        assert errors == exactly, f"{component} faults counted: {errors}"
    else:
        assert errors >= at_least, f"{component} faults counted: {errors}"
    warnings = fault_warnings(file_dir)
    assert len(warnings.get(setting, [])) == 1, warnings
    assert all(len(bodies) == 1 for bodies in warnings.values()), warnings
    assert stderr.count(f"Set {setting}=false") == 1, stderr
    errors_logged = [r["body"] for r in otlp_items(file_dir / "logs.jsonl", "logs") if r.get("severityNumber", 0) >= 17]
    assert errors_logged == []


@pytest.mark.parametrize("fault", ["tracer", "meter", "attributes"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_an_instrumentation_fault_never_reaches_the_host(wrapper, fault, tmp_path, request):
    workload, component, setting, builder, attribute_faults = WRAPPERS[wrapper]
    args: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:  # short: unix socket paths are limited
        if wrapper in ("dstack SSHTunnel", "paramiko"):
            sshd, http_port = request.getfixturevalue("sshd"), request.getfixturevalue("http_server")
            args = [sshd.user, sshd.host, str(sshd.port), str(sshd.identity), str(http_port), sock_dir]
        code = child(workload, setup=f"{files(tmp_path)}, watchdog=False", fault=fault_code(fault, builder))
        result, stderr = run_child(code, *args)
    assert_contained(
        result, stderr, tmp_path, component, setting, exactly=attribute_faults if fault == "attributes" else 0
    )


# ---- the journal's disk -----------------------------------------------------------------------------


@pytest.fixture
def read_only_directory(tmp_path: Path) -> Iterator[Path]:
    """An empty directory nothing can be written to: mode 0500, or for root (whom modes do not stop)
    a read-only bind mount of it."""
    directory = tmp_path / "read-only"
    directory.mkdir(mode=0o700)
    if os.geteuid() != 0:
        directory.chmod(0o500)
        yield directory
        directory.chmod(0o700)
        return
    for command in (["mount", "--bind", directory, directory], ["mount", "-o", "remount,bind,ro", directory]):
        mounted = subprocess.run(command, capture_output=True, text=True, check=False)
        if mounted.returncode != 0:
            subprocess.run(["umount", directory], capture_output=True, check=False)
            pytest.skip(f"root needs a read-only bind mount here, and mount failed: {mounted.stderr.strip()}")
    yield directory
    subprocess.run(["umount", directory], check=True)


def dump_receiver(receiver: Receiver, directory: Path) -> None:
    """Write what the OTLP receiver got as the file exporter's OTLP/JSON lines, for the same helpers."""
    directory.mkdir(exist_ok=True)
    for path, request_type, name in (
        ("/v1/metrics", ExportMetricsServiceRequest, "metrics.jsonl"),
        ("/v1/logs", ExportLogsServiceRequest, "logs.jsonl"),
    ):
        lines = [
            json.dumps(MessageToDict(request_type.FromString(body), use_integers_for_enums=True))
            for body in receiver.bodies(path)
        ]
        (directory / name).write_text("".join(line + "\n" for line in lines))


def test_a_read_only_journal_directory_is_reported_by_setup_and_never_reaches_the_host(read_only_directory, tmp_path):
    code = child(NEBIUS, setup=files(tmp_path / "telemetry") + ", watchdog=False")
    result, stderr = run_child(code, env=clean_env(STALLWATCH_JOURNAL_DIR=str(read_only_directory)))

    assert result["faulted"] == result["reference"]
    # Found at setup(), one line naming the variable and why; the journal is off, nothing fails later.
    line = (
        f"stallwatch: STALLWATCH_JOURNAL_DIR={str(read_only_directory)!r} is unusable: {read_only_directory} is not "
        "writable by this process; the journal is off (choose a writable directory, or set STALLWATCH_JOURNAL=false)."
    )
    assert line in stderr.splitlines() and stderr.count("STALLWATCH_JOURNAL_DIR") == 1, stderr
    assert line in [
        record["body"]["stringValue"] for record in otlp_items(tmp_path / "telemetry" / "logs.jsonl", "logs")
    ]
    assert "STALLWATCH_JOURNAL" not in fault_warnings(tmp_path / "telemetry")
    assert list(read_only_directory.iterdir()) == []


# The journal's disk fills up while the host runs: a file size limit (SIGXFSZ ignored, as a server
# would) makes every write past 1 KiB fail. Telemetry goes to an OTLP receiver, not to files.
DISK_FULL = """
import resource
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
"""


def test_a_full_journal_disk_never_reaches_the_host(receiver, tmp_path):
    code = child(NEBIUS, setup="watchdog=False", before_setup=DISK_FULL)
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, STALLWATCH_JOURNAL_DIR=str(tmp_path / "journal"))
    result, stderr = run_child(code, env=env)

    dump_receiver(receiver, tmp_path / "telemetry")
    assert_contained(result, stderr, tmp_path / "telemetry", "journal", "STALLWATCH_JOURNAL")
    assert "File too large" in stderr  # the limit, not something else, stopped the journal
    (journal,) = scan(tmp_path / "journal")  # it filled up while the host ran: what fitted is readable
    assert journal.host[0]["type"] == "open" and sum(path.stat().st_size for path in journal.paths) <= 1024


# ---- the watchdog and its heartbeat file ------------------------------------------------------------

WATCHED_HOST = """
async def serve():
    total = await asyncio.to_thread(sum, [1, 2, 3])
    proc = await asyncio.create_subprocess_exec("sh", "-c", "echo served; exit 2", stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    return [total, out.decode(), proc.returncode]

def host_calls():
    return {"loop": outcome(lambda: asyncio.run(serve())),
            "spawn": outcome(lambda: subprocess.run(["sh", "-c", "exit 3"]).returncode)}
"""

# SIGKILL the watchdog, then wait until the host has noticed: only the host's check reaps it.
KILL_WATCHDOG = """
pid = stallwatch_session.watchdog_pid
os.kill(pid, signal.SIGKILL)
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def test_a_killed_watchdog_is_reported_once_and_the_host_goes_on(tmp_path):
    code = child(WATCHED_HOST, setup=files(tmp_path), fault=KILL_WATCHDOG)
    result, stderr = run_child(code)

    assert_contained(result, stderr, tmp_path, "watchdog", "STALLWATCH_WATCHDOG", exactly=1)
    (warning,) = fault_warnings(tmp_path)["STALLWATCH_WATCHDOG"]
    assert "was killed by SIGKILL" in warning


# Remove the heartbeat file under the running host, twice (a /dev/shm cleaner), and wait each
# time until the host has made it again.
REMOVE_HEARTBEAT_FILE = """
from stallwatch.detect import heartbeat

path = heartbeat.AREA.path  # by name: a leftover of an earlier host may share this pid
for _ in range(2):
    inode = path.stat().st_ino
    path.unlink()
    deadline = time.monotonic() + 30
    while not (path.exists() and path.stat().st_ino != inode) and time.monotonic() < deadline:
        time.sleep(0.02)
"""

# The watchdog still watches the remade file: the loop blocked for twice the threshold is reported.
BLOCK_THE_LOOP = """
assert stallwatch_session.wait_for_watchdog(30), "the watchdog never read the remade heartbeat file"

async def blocked():
    time.sleep(1.0)

asyncio.run(blocked())
"""


def test_a_removed_heartbeat_file_is_reported_once_and_made_again(tmp_path):
    code = child(
        WATCHED_HOST, setup=files(tmp_path) + ", freeze_threshold=0.5", fault=REMOVE_HEARTBEAT_FILE,
        after_calls=BLOCK_THE_LOOP,
    )  # fmt: skip
    result, stderr = run_child(code)

    assert_contained(result, stderr, tmp_path, "watchdog", "STALLWATCH_WATCHDOG", exactly=2)
    (warning,) = fault_warnings(tmp_path)["STALLWATCH_WATCHDOG"]
    assert "was made again" in warning
    freezes = [r for r in otlp_items(tmp_path / "logs.jsonl", "logs") if "freeze detected" in r["body"]["stringValue"]]
    assert "loop_blocked" in [attrs(r)["stallwatch.freeze.kind"] for r in freezes]


def test_a_shutdown_inside_the_event_loop_leaves_the_loop_alone(tmp_path):
    # The heartbeat file is closed under the running loop, which still beats and tracks it.
    code = child(
        """
        async def serve():
            await asyncio.sleep(0.3)
            stallwatch.shutdown(10)
            await asyncio.sleep(0.3)
            return "served"

        def host_calls():
            return outcome(lambda: asyncio.run(serve()))
        """,
        setup=files(tmp_path),
    )
    result, stderr = run_child(code)

    assert result["faulted"] == result["reference"] == ["returned", "served"]
    assert "Traceback" not in stderr


# ---- the OpenTelemetry log handler ----------------------------------------------------------------

_LOG_HANDLER_FAULT = """
import json, logging
import stallwatch
from opentelemetry.sdk._logs import LoggingHandler

stallwatch.setup(file_dir={file_dir!r}, watchdog=False, metric_export_interval_ms=3600000)

def broken(self, record):
    raise RuntimeError("the SDK failed to translate a record")

LoggingHandler._translate = broken  # the fault: the SDK raising inside the handler stallwatch installs
returned = [logging.getLogger("host").warning("host line %d", n) for n in range(3)]
from opentelemetry import metrics
metrics.get_meter_provider().force_flush()
stallwatch.shutdown(10)
print(json.dumps({{"returned": returned}}))
"""


def test_a_log_handler_fault_never_reaches_the_hosts_logging_call(tmp_path):
    # Before, the SDK's exception went up into the host's `logger.warning()` (Python's Handler.handle
    # does not catch what emit raises): seen at exit on Python 3.12, where a thread start failed.
    result, stderr = run_child(_LOG_HANDLER_FAULT.format(file_dir=str(tmp_path)))

    assert result == {"returned": [None, None, None]}
    assert [line for line in stderr.splitlines() if line.startswith("host line")] == [
        f"host line {n}" for n in range(3)
    ]
    assert stderr.count("Set OTEL_LOGS_EXPORTER=none to turn this part off") == 1, stderr
    # Each host record failed in the handler and was counted; stallwatch's own warning about it, logged
    # while the handler ran, goes to stderr only (the log bridge never re-enters its handler).
    errors = latest_total(
        tmp_path / "metrics.jsonl", "stallwatch.instrumentation.errors", **{"stallwatch.component": "logs"}
    )
    assert errors == 3
