"""STALLWATCH_UVLOOP_SPAWN=vfork (`stallwatch.forksafe.uvloop_spawn`): real uvloop, real children.

Each behaviour runs on three loops and must look the same on all of them: `native` (uvloop's own
fork-based spawn), `vfork` (uvloop as `import stallwatch` leaves it by default: spawns go through
`subprocess.Popen`) and `asyncio` (the standard loop, the reference). The routing is process-wide,
so the `native` loop is a uvloop subclass with uvloop's methods under every wrapper but the
routing one (stallwatch's exec-bound guard included). The tests of the setting itself and of at-fork handlers
run in fresh interpreters, with handlers registered before `import stallwatch` so its guard does
not hide them.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types
import warnings
from asyncio.subprocess import DEVNULL, PIPE, STDOUT
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
import uvloop
import wrapt

from conftest import clean_env, run_python
from stallwatch.forksafe import uvloop_layers, uvloop_spawn
from support.waiting import until

pytestmark = pytest.mark.matrix  # Popen/asyncio internals differ across CPython versions

T = TypeVar("T")
METHODS = ("subprocess_exec", "subprocess_shell")
MODES = ("native", "vfork", "asyncio")
QUIET = {"stdin": DEVNULL, "stdout": DEVNULL, "stderr": DEVNULL}
NativeLoop: type[uvloop.Loop]


def without_routing(name: str) -> Any:
    """uvloop's `Loop.<name>` with every layer stallwatch put on it but the routing one, in their order."""
    layers = dict(uvloop_layers.layers(name))
    assert "route" in layers, f"uvloop.Loop.{name} is not routed"
    method = vars(uvloop.Loop)[name].__wrapped__  # uvloop's own, under the one composing wrapper
    for layer_name in reversed(uvloop_layers.ORDER):
        if layer_name in layers and layer_name != "route":
            method = wrapt.FunctionWrapper(method, layers[layer_name])
    return method


@pytest.fixture(scope="module", autouse=True)
def vfork_installed() -> Iterator[None]:
    global NativeLoop
    assert uvloop_spawn.installed()  # by `import stallwatch`, the default
    NativeLoop = type("NativeLoop", (uvloop.Loop,), {name: without_routing(name) for name in METHODS})
    yield


def new_loop(mode: str) -> asyncio.AbstractEventLoop:
    if mode == "native":
        return NativeLoop()
    if mode == "vfork":
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(mode: str, main: Callable[[], Awaitable[T]]) -> T:
    loop = new_loop(mode)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def check_route(proc: asyncio.subprocess.Process) -> None:
    """The spawn went where the running loop says: Popen + pidfd on `vfork` only."""
    loop = asyncio.get_running_loop()
    routed = isinstance(proc._transport, uvloop_spawn._PidfdSubprocessTransport)  # type: ignore[attr-defined]
    assert routed == (isinstance(loop, uvloop.Loop) and not isinstance(loop, NativeLoop))
    if routed:
        assert uvloop_spawn.FALLBACK.get() is None


async def spawn(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(*args, **kwargs)
    check_route(proc)
    return proc


async def shell(cmd: str, **kwargs: Any) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_shell(cmd, **kwargs)
    check_route(proc)
    return proc


def proc_stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def children() -> set[int]:
    """This process's children, zombies included. Read again when a thread ends between the listing
    and the read (its children pass to another thread of the process, perhaps one already read)."""
    while True:
        try:
            return {
                int(pid)
                for tid in os.listdir("/proc/self/task")
                for pid in Path(f"/proc/self/task/{tid}/children").read_text().split()
            }
        except (FileNotFoundError, ProcessLookupError):
            continue


# ---- the same behaviour on every loop -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_stdout_stderr_and_exit_status(mode):
    async def main():
        proc = await spawn("sh", "-c", "echo out; echo err >&2; exit 3", stdout=PIPE, stderr=PIPE)
        out, err = await proc.communicate()
        return out, err, proc.returncode, await proc.wait()

    assert run(mode, main) == (b"out\n", b"err\n", 3, 3)


@pytest.mark.parametrize("mode", MODES)
def test_five_megabytes_each_way_through_pipes(mode):
    data = os.urandom(5 << 20)

    async def main():
        cat = await spawn("cat", stdin=PIPE, stdout=PIPE)
        echoed, _ = await cat.communicate(input=data)
        zeros = await spawn("head", "-c", str(5 << 20), "/dev/zero", stdout=PIPE)
        read = await zeros.stdout.read()
        return echoed == data, cat.returncode, len(read), set(read), await zeros.wait()

    assert run(mode, main) == (True, 0, 5 << 20, {0}, 0)


@pytest.mark.parametrize("mode", MODES)
def test_stream_reader_lines_and_stdin_writer(mode):
    async def main():
        proc = await spawn("cat", stdin=PIPE, stdout=PIPE)
        proc.stdin.write(b"one\ntwo\n")
        await proc.stdin.drain()
        first = await proc.stdout.readline()
        proc.stdin.close()
        rest = await proc.stdout.read()
        return first, rest, await proc.wait()

    assert run(mode, main) == (b"one\n", b"two\n", 0)


@pytest.mark.parametrize(
    ("how", "expected"),
    [("kill", -signal.SIGKILL), ("terminate", -signal.SIGTERM), ("send_signal", -signal.SIGTERM)],
)
@pytest.mark.parametrize("mode", MODES)
def test_signals_give_negative_returncode(mode, how, expected):
    async def main():
        proc = await spawn("sleep", "30", **QUIET)
        if how == "send_signal":
            proc.send_signal(signal.SIGTERM)
        else:
            getattr(proc, how)()
        return await proc.wait(), proc.returncode

    assert run(mode, main) == (expected, expected)


@pytest.mark.parametrize("mode", ["native", "vfork"])
def test_signal_after_exit_raises_process_lookup_error(mode):
    # uvloop's transport raises once the child is known to be gone (the stdlib's may not, on 3.10-3.12).
    async def main():
        proc = await spawn("true", **QUIET)
        await proc.wait()
        with pytest.raises(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with pytest.raises(ProcessLookupError):
            proc.kill()

    run(mode, main)


@pytest.mark.parametrize("mode", ["vfork", "asyncio"])  # uvloop's own spawn raises RuntimeError here too
def test_writing_to_the_stdin_of_a_child_whose_exit_closed_its_pipe_drops_the_data_as_the_standard_loop_does(mode):
    # Only stdin is piped, so the exit closes the transport and with it the stdin pipe: communicate() ignores the
    # broken pipe, and a write is dropped while drain() raises ConnectionResetError, as on the standard loop.
    async def main():
        proc = await spawn(sys.executable, "-c", "pass", stdin=PIPE)
        await proc.wait()
        communicated = await proc.communicate(b"x" * 4_000_000)
        proc.stdin.write(b"more")
        with pytest.raises(ConnectionResetError):
            await proc.stdin.drain()
        proc.stdin.close()
        return communicated, proc.returncode, proc.stdin.transport.is_closing()

    assert run(mode, main) == ((None, None), 0, True)


def test_a_write_pipe_the_host_connects_itself_stays_uvloops_and_raises_after_close():
    # Only the stdin of a routed child drops writes once closing; what the host connects itself is uvloop's.
    async def main():
        lost = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_lost(self, exc: Exception | None) -> None:
                lost.set_result(exc)

        read_end, write_end = os.pipe()
        try:
            transport, _ = await asyncio.get_running_loop().connect_write_pipe(Protocol, os.fdopen(write_end))
            transport.close()
            await asyncio.wait_for(lost, 30)
            with pytest.raises(RuntimeError, match="closed"):
                transport.write(b"x")
            return type(transport).__name__
        finally:
            os.close(read_end)

    assert run("vfork", main) == "WriteUnixTransport"


@pytest.mark.parametrize("mode", MODES)
def test_child_pid_and_parent(mode):
    async def main():
        proc = await spawn("sleep", "30", **QUIET)
        stat = proc_stat(proc.pid)
        same_pid = proc.pid == proc._transport.get_pid()
        proc.kill()
        await proc.wait()
        return int(stat[1]), same_pid

    assert run(mode, main) == (os.getpid(), True)


@pytest.mark.parametrize("mode", MODES)
def test_env_and_cwd_are_honoured(mode, tmp_path):
    async def main():
        proc = await spawn(
            "sh", "-c", 'echo "$FOO"; pwd', stdout=PIPE, env={"FOO": "bar", "PATH": os.environ["PATH"]}, cwd=tmp_path
        )
        out, _ = await proc.communicate()
        return out.decode().splitlines()

    assert run(mode, main) == ["bar", str(tmp_path)]


@pytest.mark.parametrize("mode", MODES)
def test_start_new_session(mode):
    async def main():
        results = []
        for new_session in (True, False):
            proc = await spawn("cat", "/proc/self/stat", stdout=PIPE, start_new_session=new_session)
            out, _ = await proc.communicate()
            fields = out.decode().rsplit(")", 1)[1].split()
            results.append((int(fields[3]) == proc.pid, int(fields[3]) == os.getsid(0)))
        return results

    assert run(mode, main) == [(True, False), (False, True)]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Popen(process_group=...) is new in 3.11")
@pytest.mark.parametrize("mode", ["vfork", "asyncio"])  # uvloop's own spawn raises ValueError
def test_process_group(mode):
    async def main():
        proc = await spawn("cat", "/proc/self/stat", stdout=PIPE, process_group=0)
        out, _ = await proc.communicate()
        return int(out.decode().rsplit(")", 1)[1].split()[2]) == proc.pid

    assert run(mode, main)


@pytest.mark.parametrize("mode", MODES)
def test_pass_fds_keeps_an_extra_fd_open_in_the_child(mode):
    async def main(pass_it):
        read_fd, write_fd = os.pipe()
        try:
            kwargs = {"pass_fds": (write_fd,)} if pass_it else {}
            proc = await spawn("sh", "-c", f"echo hi > /dev/fd/{write_fd}", stderr=DEVNULL, **kwargs)
            os.close(write_fd)
            return await proc.wait() == 0, os.read(read_fd, 100)
        finally:
            os.close(read_fd)

    assert run(mode, lambda: main(True)) == (True, b"hi\n")
    assert run(mode, lambda: main(False)) == (False, b"")  # the control: closed in the child without it


@pytest.mark.parametrize("mode", MODES)
def test_shell_stderr_to_stdout_and_devnull(mode, tmp_path):
    target = tmp_path / "out.txt"

    async def main():
        merged = await shell("echo $((1 + 2)); echo oops >&2", stdout=PIPE, stderr=STDOUT)
        merged_out, merged_err = await merged.communicate()
        quiet = await shell("cat; echo gone; echo gone >&2", **QUIET)
        with target.open("wb") as file:
            to_file = await spawn("sh", "-c", "echo into-file; echo fd >&2", stdout=file, stderr=file.fileno())
            await to_file.wait()
        return merged_out, merged_err, merged.stderr, await quiet.wait(), quiet.stdout, to_file.returncode

    assert run(mode, main) == (b"3\noops\n", None, None, 0, None, 0)
    assert sorted(target.read_text().splitlines()) == ["fd", "into-file"]


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        (("no-such-program-stallwatch",), {}, FileNotFoundError),
        (("/no/such/dir/program",), {}, FileNotFoundError),
        (("/dev/null",), {}, PermissionError),
        (("true",), {"cwd": "/no/such/dir"}, FileNotFoundError),
        (("true",), {"cwd": "/dev/null"}, NotADirectoryError),
        (("true",), {"env": {"PATH": "/no/such/dir"}}, FileNotFoundError),
        (("true",), {"pass_fds": (987,)}, OSError),
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_spawn_errors_have_uvloops_exception_types(mode, args, kwargs, error):
    new_loop(mode).close()  # libuv opens a process-wide pipe (its signal lock) with the first loop, and keeps it
    fds = open_fds()

    async def main():
        with pytest.raises(OSError) as raised:
            await asyncio.create_subprocess_exec(*args, **QUIET, **kwargs)
        return type(raised.value), raised.value.errno, uvloop_spawn.FALLBACK.get()

    kind, errno, fallback = run(mode, main)
    gc.collect()
    assert kind is error
    assert errno is not None
    assert fallback is None
    if mode != "native":  # uvloop's own spawn opens libuv's signal pipe once, and leaks pipes on a bad pass_fds
        assert open_fds() == fds


@pytest.mark.parametrize("mode", MODES)
def test_fifty_concurrent_spawns_are_all_reaped(mode):
    async def one(i):
        proc = await spawn("sh", "-c", f"exit {i % 7}", **QUIET)
        return proc.pid, await proc.wait()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(50)))

    results = run(mode, main)
    assert [code for _, code in results] == [i % 7 for i in range(50)]
    for pid, _ in results:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_spawn_kills_and_reaps_the_child(mode):
    before = children()

    async def main():
        task = asyncio.ensure_future(spawn("sleep", "30", stdin=PIPE, stdout=PIPE))
        deadline = time.monotonic() + 30
        while not children() - before:  # a loop step at a time: Popen ran, the pipes are being connected
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0)
        assert len(children() - before) == 1 and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await until(lambda: not children() - before, "the cancelled spawn's child is reaped")

    assert run(mode, main)


@pytest.mark.parametrize("mode", MODES)
def test_no_fd_leak_and_no_unclosed_transport(mode):
    async def batch():
        for _ in range(10):
            proc = await spawn("sh", "-c", "cat; echo err >&2", stdin=PIPE, stdout=PIPE, stderr=PIPE)
            assert await proc.communicate(b"x") == (b"x", b"err\n")
            proc = await spawn("sleep", "30", stdin=PIPE, stdout=PIPE)
            proc.kill()
            await proc.wait()

    loop = new_loop(mode)
    try:
        loop.run_until_complete(batch())  # warm up: the loop's own signal and child-watch fds
        gc.collect()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fds = open_fds()
            loop.run_until_complete(batch())
            gc.collect()
            assert open_fds() == fds
        assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        loop.close()


class ClosingProbe(io.FileIO):
    """A Popen pipe end that, as it is closed, looks whether its number was already released (closed
    by someone else) and, if so, plays another thread that opens a file at that instant: the kernel
    gives that file the lowest free number, made here to be this one. A real thread lands in that
    instant only now and then (a file read in a FastAPI thread pool did, once in 15 bursts of 300
    requests); the probe lands in it every time."""

    made: ClassVar[int] = 0
    planted: ClassVar[list[tuple[int, int]]] = []  # (number, inode of the other thread's file)

    def __init__(self, fd: int, mode: str) -> None:
        super().__init__(fd, mode)
        ClosingProbe.made += 1

    def close(self) -> None:
        if not self.closed:
            number = self.fileno()
            try:
                os.fstat(number)
            except OSError:
                other = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                if other != number:
                    os.dup2(other, number, inheritable=False)
                    os.close(other)
                ClosingProbe.planted.append((number, os.fstat(number).st_ino))
        super().close()


@pytest.mark.parametrize("mode", MODES)
def test_closing_a_childs_pipes_never_closes_a_descriptor_another_thread_just_opened(mode, monkeypatch):
    def probe_open(file: Any, mode: str = "r", buffering: int = -1, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, int) and buffering == 0:  # Popen's pipe ends, as asyncio asks for them
            return ClosingProbe(file, mode.replace("b", ""))
        return open(file, mode, buffering, *args, **kwargs)

    monkeypatch.setattr(subprocess, "io", types.SimpleNamespace(**{**vars(io), "open": probe_open}))
    ClosingProbe.made, ClosingProbe.planted = 0, []

    async def main():
        for _ in range(3):
            proc = await spawn("sh", "-c", "cat; echo err >&2", stdin=PIPE, stdout=PIPE, stderr=PIPE)
            assert await proc.communicate(b"x") == (b"x", b"err\n")
            del proc
            gc.collect()
        await asyncio.sleep(0)

    run(mode, main)
    survivors = []
    for number, inode in ClosingProbe.planted:
        try:
            survivors.append(os.fstat(number).st_ino == inode)
            os.close(number)
        except OSError:
            survivors.append(False)
    assert survivors == [True] * len(survivors)
    assert ClosingProbe.made == (0 if mode == "native" else 9)  # uvloop's own spawn makes its pipes itself


# ---- what only the vfork route does ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [
        ("exec", {"universal_newlines": True}),
        ("exec", {"shell": True}),
        ("exec", {"bufsize": 1}),
        ("exec", {"text": True}),
        ("exec", {"encoding": "utf-8"}),
        ("exec", {"errors": "strict"}),
        ("shell", {"shell": False}),
        ("shell", {"universal_newlines": True}),
        ("shell", {"text": True}),
        ("shell", {"cmd": 42}),
    ],
)
def test_argument_checks_match_the_standard_loop(method, kwargs):
    arguments = dict(kwargs)
    cmd = arguments.pop("cmd", "true")

    async def main():
        loop = asyncio.get_running_loop()
        call = loop.subprocess_exec if method == "exec" else loop.subprocess_shell
        try:
            await call(asyncio.SubprocessProtocol, cmd, **arguments)
        except ValueError as exc:
            return str(exc)
        return None

    reference = run("asyncio", main)
    assert reference is not None
    assert run("vfork", main) == reference
    if method == "exec":  # uvloop's own wording differs, not the type
        assert run("native", main) is not None


@pytest.mark.parametrize("mode", MODES)
def test_executable_runs_with_the_given_argv0(mode):
    # Popen semantics (stdlib and vfork): `executable` runs, argv[0] stays; uvloop puts it in argv[0].
    async def main():
        proc = await spawn("my-shell", "-c", 'echo "$0"', executable="/bin/sh", stdout=PIPE)
        out, _ = await proc.communicate()
        return out

    assert run(mode, main) == (b"/bin/sh\n" if mode == "native" else b"my-shell\n")


@pytest.mark.parametrize("mode", MODES)
def test_raw_protocol_callbacks_in_the_same_order(mode):
    events: list[str] = []

    class Recorder(asyncio.SubprocessProtocol):
        def connection_made(self, transport):
            events.append("connection_made")

        def pipe_data_received(self, fd, data):
            events.append(f"data {fd} {data!r}")

        def pipe_connection_lost(self, fd, exc):
            events.append(f"pipe_connection_lost {fd}")

        def process_exited(self):
            events.append("process_exited")

        def connection_lost(self, exc):
            events.append("connection_lost")

    async def main():
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.subprocess_exec(Recorder, "sleep", "0.2", stdin=DEVNULL, stderr=DEVNULL)
        events.append("returned")
        assert isinstance(protocol, Recorder)
        code = await transport._wait()
        await until(lambda: "pipe_connection_lost 1" in events, "the pipe's EOF arrives")
        transport.close()
        return code

    assert run(mode, main) == 0
    # The pipe's EOF and the exit arrive in either order, on every loop; connection_lost comes last.
    assert events[:2] == ["connection_made", "returned"]
    assert sorted(events[2:4]) == ["pipe_connection_lost 1", "process_exited"]
    assert events[4:] == ["connection_lost"]


class PipeFailsLoop(uvloop.Loop):
    """A uvloop loop whose `connect_read_pipe` fails once it has connected the pipe, as a loop out of
    descriptors or memory can: a failure that cannot be brought about on demand here."""

    async def connect_read_pipe(self, *args: Any, **kwargs: Any) -> Any:
        transport, _ = await super().connect_read_pipe(*args, **kwargs)
        transport.close()
        raise OSError(errno.EMFILE, "connect_read_pipe failed")


def test_a_spawn_whose_pipe_cannot_be_connected_raises_and_leaves_no_child_instead_of_hanging():
    # On 3.11+ the transport's _wait() also waits for every pipe to be connected and closed.
    before = children()

    async def main():
        spawning = asyncio.create_subprocess_exec("sleep", "30", stdin=PIPE, stdout=PIPE)
        with pytest.raises(OSError, match="connect_read_pipe failed"):
            await asyncio.wait_for(spawning, 30)
        return children() - before

    loop = PipeFailsLoop()
    try:
        assert loop.run_until_complete(main()) == set()
    finally:
        loop.close()


SETTING_PROBE = """
import asyncio, json, sys
import stallwatch
import uvloop

async def spawn():
    proc = await asyncio.create_subprocess_exec("true")
    await proc.wait()
    return type(proc._transport).__name__

kinds = [uvloop.run(spawn())]
if len(sys.argv) > 1:
    stallwatch.setup(uvloop_spawn=sys.argv[1], traces_exporter="none", metrics_exporter="none",
                     logs_exporter="none", watchdog=False, journal=False)
    kinds.append(uvloop.run(spawn()))
    stallwatch.shutdown(10)
print(json.dumps([stallwatch.FORK_SAFETY.uvloop_spawn, kinds]))
"""


@pytest.mark.parametrize(
    ("variable", "keyword", "expected"),
    [
        (None, None, ["vfork", ["_PidfdSubprocessTransport"]]),
        ("vfork", None, ["vfork", ["_PidfdSubprocessTransport"]]),
        ("fork", None, ["fork", ["UVProcessTransport"]]),
        (" FORK ", None, ["fork", ["UVProcessTransport"]]),
        ("posix_spawn", None, ["vfork", ["_PidfdSubprocessTransport"]]),  # a bad value: the default
        (None, "fork", ["vfork", ["_PidfdSubprocessTransport", "UVProcessTransport"]]),
        ("fork", "vfork", ["fork", ["UVProcessTransport", "_PidfdSubprocessTransport"]]),
    ],
)
def test_import_stallwatch_routes_uvloop_spawns_unless_the_setting_says_fork_and_setup_follows_its_keyword(
    variable, keyword, expected
):
    env = clean_env(**({} if variable is None else {uvloop_spawn.SETTING: variable}))
    proc = subprocess.run(
        [sys.executable, "-c", SETTING_PROBE, *([keyword] if keyword else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == expected


def test_setup_switches_the_spawn_with_telemetry_off_too():
    env = clean_env(OTEL_SDK_DISABLED="true")
    proc = subprocess.run(
        [sys.executable, "-c", SETTING_PROBE, "fork"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == ["vfork", ["_PidfdSubprocessTransport", "UVProcessTransport"]]


def test_routed_and_fallback_spawns_mixed_on_one_loop():
    async def one(i, **kwargs):
        proc = await asyncio.create_subprocess_exec("sh", "-c", f"sleep 0.0{i % 5}; exit {i % 7}", **QUIET, **kwargs)
        return await proc.wait()

    async def main():
        routed = [one(i) for i in range(20)]
        native = [one(i, preexec_fn=os.getpid) for i in range(20)]
        return await asyncio.gather(*routed, *native)

    assert run("vfork", main) == [i % 7 for i in range(20)] * 2


def test_child_reaped_by_someone_else(caplog):
    async def main():
        proc = await spawn("sh", "-c", "sleep 0.1; exit 3", **QUIET)
        os.waitpid(proc.pid, 0)  # reaped behind the loop's back: the status is lost, as with asyncio
        lost = await proc.wait()
        proc = await spawn("sh", "-c", "sleep 0.1; exit 3", **QUIET)
        popen = proc._transport.get_extra_info("subprocess")
        while popen.poll() is None:  # Popen reaps it itself: its returncode is the one reported
            time.sleep(0.01)
        return lost, await proc.wait()

    assert run("vfork", main) == (255, 3)
    assert [r.getMessage() for r in caplog.records if "255" in r.getMessage()] != []


def test_preexec_fn_falls_back_to_uvloops_fork(tmp_path, caplog, monkeypatch):
    marker = tmp_path / "preexec"
    monkeypatch.setattr(uvloop_spawn, "_logged_reasons", set())  # logged once per reason and process
    caplog.set_level(logging.INFO, logger="stallwatch.forksafe")

    def preexec():
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600))

    async def main():
        proc = await asyncio.create_subprocess_exec("true", preexec_fn=preexec, **QUIET)
        fallback = uvloop_spawn.FALLBACK.get()
        native = not isinstance(proc._transport, uvloop_spawn._PidfdSubprocessTransport)
        code = await proc.wait()
        await spawn("true", **QUIET)  # the next plain spawn is routed again, FALLBACK back to None
        return fallback, native, code

    assert run("vfork", main) == ("preexec_fn", True, 0)
    assert marker.exists()  # preexec_fn ran in the child
    assert any("preexec_fn" in r.getMessage() and uvloop_spawn.SETTING in r.getMessage() for r in caplog.records)


def test_unknown_keyword_falls_back_and_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(uvloop_spawn, "_logged_reasons", set())
    caplog.set_level(logging.INFO, logger="stallwatch.forksafe")
    keyword = {"__uvloop_sleep_after_fork": False}  # a keyword only uvloop's own spawn takes

    async def main():
        reasons = []
        for _ in range(2):
            proc = await asyncio.create_subprocess_exec("true", **QUIET, **keyword)
            reasons.append(uvloop_spawn.FALLBACK.get())
            await proc.wait()
        return reasons

    reason = "unknown keyword: __uvloop_sleep_after_fork"
    assert run("vfork", main) == [reason, reason]
    assert sum(reason in r.getMessage() for r in caplog.records) == 1


def test_install_is_idempotent():
    wrappers = [vars(uvloop.Loop)[name] for name in METHODS]
    uvloop_spawn.install()
    assert [vars(uvloop.Loop)[name] for name in METHODS] == wrappers
    assert uvloop_spawn.installed()


def test_unsupported_reason():
    assert uvloop_spawn.unsupported_reason({}) is None
    assert uvloop_spawn.unsupported_reason({"preexec_fn": None, "user": None, "cwd": "/", "env": {}}) is None
    assert uvloop_spawn.unsupported_reason({"preexec_fn": print}) == "preexec_fn"
    assert uvloop_spawn.unsupported_reason({"user": 0}) == "user"
    assert uvloop_spawn.unsupported_reason({"group": 0}) == "group"
    assert uvloop_spawn.unsupported_reason({"extra_groups": []}) == "extra_groups"
    assert uvloop_spawn.unsupported_reason({"zz": 1, "aa": 2}) == "unknown keyword: aa, zz"
    expected = None if sys.version_info >= (3, 11) else "unknown keyword: process_group"
    assert uvloop_spawn.unsupported_reason({"process_group": 0}) == expected


# ---- at-fork handlers, in fresh interpreters ------------------------------------------------------

FORK_HANDLER_PROBE = """
import asyncio, json, os

calls = {{"before": 0}}
marker = {marker!r}


def before():
    calls["before"] += 1


def in_child():
    os.close(os.open(marker + "." + str(os.getpid()), os.O_WRONLY | os.O_CREAT, 0o600))


os.register_at_fork(before=before, after_in_child=in_child)  # before stallwatch: not guarded
from stallwatch.forksafe import uvloop_spawn

import uvloop

async def spawns():
    procs = [await asyncio.create_subprocess_exec("/bin/true"), await asyncio.create_subprocess_shell("exit 0")]
    kinds = sorted({{type(p._transport).__name__ for p in procs}})
    return [await p.wait() for p in procs], kinds


def measure():
    start, children = calls["before"], len(os.listdir(os.path.dirname(marker)))
    loop = uvloop.new_event_loop()
    codes, kinds = loop.run_until_complete(spawns())
    loop.close()
    return {{"codes": codes, "kinds": kinds, "before": calls["before"] - start,
            "in_child": len(os.listdir(os.path.dirname(marker))) - children}}


result = {{}}
if not uvloop_spawn.installed():
    result["native"] = measure()
    uvloop_spawn.install()
result["vfork"] = measure()
print(json.dumps(result))
"""


@pytest.mark.parametrize("setting", ["default", "fork"])
def test_fork_handlers_run_on_uvloops_spawn_and_not_on_the_vfork_route(tmp_path, setting):
    (tmp_path / "markers").mkdir()
    code = FORK_HANDLER_PROBE.format(marker=str(tmp_path / "markers" / "child"))
    proc = run_python(code, env=clean_env(**({} if setting == "default" else {uvloop_spawn.SETTING: setting})))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    assert result["vfork"] == {"codes": [0, 0], "kinds": ["_PidfdSubprocessTransport"], "before": 0, "in_child": 0}
    if setting == "default":  # installed by the import, before uvloop was imported: the post-import hook patched it
        assert "native" not in result
    else:  # the control: the same handlers do run, in parent and child, on uvloop's own spawn
        assert result["native"] == {"codes": [0, 0], "kinds": ["UVProcessTransport"], "before": 2, "in_child": 2}
