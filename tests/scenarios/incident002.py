"""Scenario: a stale SystemExit from an execution timeout kills asyncio's default-executor worker.

Replays incident 002 of docs/incidents.md (NDIF's untrusted execution timeout wedges the replica)
in plain asyncio, with the incident's real mechanics:

1. `Actor.run(request)` first awaits `asyncio.to_thread(set_env, request)` -- an await made before
   the execution timeout arms -- then races `to_thread(execute, request)` against
   `asyncio.wait({job}, timeout=T)`.
2. `execute` records `threading.get_ident()`, takes a fresh runner process (incident002_runner.py)
   from a pre-warmed pool, sends the request over a Unix socket and parks in `sock.recv`.
   Request 1's runner sleeps far longer than T; every later request's runner answers at once.
3. On timeout `interrupt()` does what NDIF does: stop the runner (terminate + wait, blocking the loop
   thread like `Sandbox.stop`), then inject SystemExit into the recorded thread with
   `PyThreadState_SetAsyncExc`. By then the worker has seen EOF (or the reset), finished request
   1's item and gone idle, so the exception stays pending until that worker dequeues its next item.
4. Request 2 follows immediately. Its `set_env` item goes to that same idle worker, SystemExit fires
   right after `work_queue.get()` returns -- outside `_WorkItem.run()`'s try -- and the worker dies
   holding the item: request 2's first await never returns and its own timeout never arms.

Usage: python incident002.py [--timeout T] [--wait W] [--requests N] [--mode eof|rst]
                             [--import-stallwatch] [--telemetry-dir DIR] [--jitter S] [--seed N]
  --timeout  execution timeout T in seconds (default 1.0)
  --wait     how long to wait for each request past its expected run time (T for request 1, 0 for
             the others; default 5.0): one not done by then is reported "hung" and abandoned, and
             the next request is sent -- so a run takes about T + W seconds, never forever
  --requests request 1 times out, requests 2..N are fast (default 2)
  --mode     eof: the terminated runner's socket closes cleanly and recv returns b'' (the incident);
             rst: the runner dies with unread bytes, so recv raises ConnectionResetError
  --import-stallwatch  `import stallwatch` before anything else, then setup(file_dir=DIR)
  --telemetry-dir      that DIR (default: a temporary directory, removed at exit)
  --jitter   later requests arrive after a random 0..S s pause instead of immediately (default 0)
  --seed     seed for that randomness (default 0)

Prints one JSON object on its last stdout line: "requests" (per request: "outcome" -- "ok",
"timeout_error", "hung" or "error:<type>" --, "elapsed_s", "reached_execute", "timeout_armed",
"interrupt" {"thread", "set_async_exc"} and what `execute` raised), the default executor's
"threads", "qsize" and "idle_semaphore_value", the "worker_log" concurrent.futures wrote for
"Exception in worker" and "worker_died_at" (its innermost frame), and "wedged" (a request after
the first hung). Exits with os._exit: a wedged default executor would also hang interpreter exit
(concurrent.futures' _python_exit joins every worker).
"""

import sys

if "--import-stallwatch" in sys.argv:
    import stallwatch  # first import, as a server would do

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import platform
import queue
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from incident002_runner import frame, recv_frame

RUNNER = Path(__file__).with_name("incident002_runner.py")
SLOW_BLOCK_S = 60.0  # request 1's block, as in the incident: far past any timeout used here
RST_TRAILER_BYTES = 4096  # unread by a runner killed mid-block, so its socket resets the host's end
# Hung requests' tasks, kept until os._exit as Ray keeps the actor call. Once the work item is lost
# nothing else references them, and the GC would log "Task was destroyed but it is pending!".
ABANDONED: list[asyncio.Future] = []


@dataclass
class Request:
    id: int
    sleep_s: float
    trailer_bytes: int
    reached_execute: bool = False
    timeout_armed: bool = False
    interrupt: dict[str, Any] | None = None
    execute_raised: str | None = None
    outcome: str = "pending"
    elapsed_s: float = 0.0


# -- the sandbox: one runner process per request, as NDIF's sandbox/host.py -------------------------


@dataclass
class Sandbox:
    path: Path
    process: subprocess.Popen
    sock: socket.socket  # the host's connected end

    def stop(self) -> None:
        """NDIF's Sandbox.stop(): bounded, but it blocks the calling (event loop) thread."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.path.unlink(missing_ok=True)


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def spawn(path: Path, timeout: float = 30.0) -> Sandbox:
    """Start a runner and wait until it accepts our connection."""
    process = subprocess.Popen(
        [sys.executable, str(RUNNER), str(path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Sandbox(path, process, connect(path))
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"runner {path.name} did not start listening") from None
            time.sleep(0.01)


class Pool:
    """Pre-warmed runners, as NDIF's Pool: `acquire` hands out a fresh one and refills in the background."""

    def __init__(self, directory: Path, size: int = 2) -> None:
        self.directory = directory
        self.ready: queue.SimpleQueue[Sandbox] = queue.SimpleQueue()
        self.spawned: list[Sandbox] = []
        self.lock = threading.Lock()
        self.closed = False
        for _ in range(size):
            self.ready.put(self.spawn())

    def spawn(self) -> Sandbox:
        with self.lock:
            if self.closed:
                raise RuntimeError("the runner pool is closed")
            path = self.directory / f"sbx-{len(self.spawned) + 1}.sock"
            sandbox = spawn(path)  # under the lock, so close() never misses a runner being started
            self.spawned.append(sandbox)
        return sandbox

    def acquire(self) -> Sandbox:
        try:
            sandbox = self.ready.get_nowait()
        except queue.Empty:
            sandbox = self.spawn()
        threading.Thread(target=self.refill, name="pool-refill", daemon=True).start()
        return sandbox

    def refill(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.ready.put(self.spawn())

    def close(self) -> None:
        with self.lock:
            self.closed = True
            sandboxes = list(self.spawned)
        for sandbox in sandboxes:
            sandbox.stop()
            sandbox.sock.close()


# -- the actor: NDIF's BaseModelDeployment.run / SandboxModelDeployment, reduced to the mechanics ----


def idle(ident: int | None) -> bool:
    """Thread `ident` is an executor worker back in its loop, between items (waiting for the next)."""
    frame = sys._current_frames().get(ident or 0)
    return frame is not None and frame.f_code.co_name == "_worker" and "futures" in frame.f_code.co_filename


def kill_thread(ident: int | None, exc_type: type[BaseException] = SystemExit) -> int:
    """NDIF's util.kill_thread: schedule `exc_type` in thread `ident`; returns SetAsyncExc's count.

    NDIF passes `ctypes.c_long(ident)`; `c_ulong` is the C signature's type and the same value for
    any real thread ident.
    """
    if ident is None or ident not in {t.ident for t in threading.enumerate()}:
        return 0
    res = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))
    if res > 1:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
    return res


def thread_name(ident: int | None) -> str | None:
    return next((t.name for t in threading.enumerate() if t.ident == ident), None)


class Actor:
    def __init__(self, pool: Pool, execution_timeout: float) -> None:
        self.pool = pool
        self.execution_timeout = execution_timeout
        self.execution_ident: int | None = None
        self.execution_sandbox: Sandbox | None = None

    def set_env(self, request: Request) -> None:
        """The model's `_remoteable_set_env`: a no-op here, as for most NDIF models."""

    def execute(self, request: Request) -> str:
        self.execution_ident = threading.get_ident()
        request.reached_execute = True
        sandbox = self.execution_sandbox = self.pool.acquire()
        header = {"id": request.id, "sleep_s": request.sleep_s, "trailer_bytes": request.trailer_bytes}
        try:  # one sendall: a fast runner may answer and close before a second send (EPIPE)
            sandbox.sock.sendall(frame(json.dumps(header).encode()) + b"\0" * request.trailer_bytes)
            return json.loads(recv_frame(sandbox.sock))["result"]  # parks in sock.recv for the block
        except BaseException as exc:  # kept for the report (nobody reads a timed-out job's error); like
            # NDIF's `finally: connection.close()`, it is Python code on execute's error path
            request.execute_raised = type(exc).__name__
            raise

    async def run(self, request: Request) -> str:
        try:
            await asyncio.to_thread(self.set_env, request)  # awaited before the timeout arms
            job = asyncio.ensure_future(asyncio.to_thread(self.execute, request))
            request.timeout_armed = True
            done, pending = await asyncio.wait({job}, timeout=self.execution_timeout)
            for task in pending:
                task.cancel()
            if job in done:
                job.result()
                return "ok"
            request.interrupt = self.interrupt()
            return "timeout_error"
        except Exception as exc:
            return f"error:{type(exc).__name__}"
        finally:
            self.cleanup()

    def interrupt(self) -> dict[str, Any]:
        """SandboxModelDeployment.interrupt(): stop the runner, then kill_thread the executor thread."""
        if self.execution_sandbox is not None:
            self.execution_sandbox.stop()
        # The order the incident's root-cause analysis observed: by the time kill_thread runs, the
        # worker has seen EOF, finished item 1 and gone idle. On a loaded machine the worker can
        # lag behind the loop thread here: wait until it waits for its next item.
        ident = self.execution_ident
        deadline = time.monotonic() + 30
        while not idle(ident):
            assert time.monotonic() < deadline, "the executor worker never went idle"
            time.sleep(0.005)
        name = thread_name(ident)
        return {"thread": name, "set_async_exc": kill_thread(ident)}

    def cleanup(self) -> None:
        if self.execution_sandbox is not None:
            self.execution_sandbox.stop()
        self.execution_sandbox = None
        self.execution_ident = None


# -- what an on-call engineer would look at ---------------------------------------------------------


class WorkerLog(logging.Handler):
    """Keeps what concurrent.futures logs; a dying worker logs 'Exception in worker' there."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s [%(threadName)s]: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str | None:
        return "\n".join(self.format(record) for record in self.records) or None

    def died_at(self) -> list[dict[str, Any]]:
        """The innermost frame of each logged worker exception: where the SystemExit landed."""
        frames = [traceback.extract_tb(r.exc_info[2])[-1] for r in self.records if r.exc_info and r.exc_info[2]]
        return [{"function": f.name, "line": f.lineno, "code": f.line} for f in frames]


def capture_worker_log() -> WorkerLog:
    handler = WorkerLog()
    logging.getLogger("concurrent.futures").addHandler(handler)
    return handler


def executor_state(loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    executor = getattr(loop, "_default_executor", None)
    if executor is None:
        return {"class": None, "threads": [], "qsize": None, "idle_semaphore_value": None}
    threads = sorted(getattr(executor, "_threads", ()), key=lambda t: t.name)
    work_queue = getattr(executor, "_work_queue", None)
    idle = getattr(executor, "_idle_semaphore", None)
    return {
        "class": type(executor).__name__,
        "threads": [{"name": t.name, "alive": t.is_alive()} for t in threads],
        "qsize": work_queue.qsize() if work_queue is not None else None,
        "idle_semaphore_value": getattr(idle, "_value", None),
    }


# -- the replay -------------------------------------------------------------------------------------


@dataclass
class Options:
    timeout: float
    wait: float
    requests: int
    mode: str
    import_stallwatch: bool
    telemetry_dir: str | None
    jitter: float
    seed: int
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="incident002-")))


def make_requests(options: Options) -> list[Request]:
    trailer = RST_TRAILER_BYTES if options.mode == "rst" else 0
    slow = Request(1, SLOW_BLOCK_S, trailer)
    return [slow, *(Request(n, 0.0, trailer) for n in range(2, options.requests + 1))]


async def drive(actor: Actor, request: Request) -> str:
    try:
        return await actor.run(request)
    except BaseException as exc:  # a SystemExit landing inside an item surfaces here, not in run()
        return f"error:{type(exc).__name__}"


async def serve(actor: Actor, request: Request, bound: float) -> None:
    """Send one request and wait for it at most `bound` seconds, so the replay itself never hangs."""
    started = time.monotonic()
    task = asyncio.ensure_future(drive(actor, request))
    done, _ = await asyncio.wait({task}, timeout=bound)
    request.outcome = task.result() if done else "hung"
    request.elapsed_s = round(time.monotonic() - started, 3)
    if not done:
        ABANDONED.append(task)


async def replay(options: Options) -> dict[str, Any]:
    worker_log = capture_worker_log()
    pool = Pool(options.work_dir)
    actor = Actor(pool, options.timeout)
    rng = random.Random(options.seed)
    requests = make_requests(options)
    for request in requests:
        if request.id > 1 and options.jitter > 0:
            await asyncio.sleep(rng.uniform(0, options.jitter))
        expected = options.timeout if request.sleep_s > options.timeout else 0.0
        await serve(actor, request, expected + options.wait)
    state = executor_state(asyncio.get_running_loop())
    pool.close()
    return {
        "python": platform.python_version(),
        "mode": options.mode,
        "loop": type(asyncio.get_running_loop()).__name__,
        "stallwatch": "stallwatch" in sys.modules,
        "timeout_s": options.timeout,
        "requests": [report(request) for request in requests],
        "executor": state,
        "worker_log": worker_log.text(),
        "worker_died_at": worker_log.died_at(),
        "wedged": any(request.outcome == "hung" for request in requests[1:]),
    }


def report(request: Request) -> dict[str, Any]:
    return {
        "id": request.id,
        "outcome": request.outcome,
        "elapsed_s": request.elapsed_s,
        "reached_execute": request.reached_execute,
        "timeout_armed": request.timeout_armed,
        "interrupt": request.interrupt,
        "execute_raised": request.execute_raised,
    }


def parse_options(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--wait", type=float, default=5.0)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--mode", choices=("eof", "rst"), default="eof")
    parser.add_argument("--import-stallwatch", action="store_true")
    parser.add_argument("--telemetry-dir", default=None)
    parser.add_argument("--jitter", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    return Options(**vars(args))


def main() -> None:
    options = parse_options(sys.argv[1:])
    if options.import_stallwatch:  # telemetry goes to a throwaway dir unless --telemetry-dir keeps it
        stallwatch.setup(file_dir=options.telemetry_dir or str(options.work_dir / "telemetry"))
    loop = asyncio.new_event_loop()
    result = loop.run_until_complete(replay(options))
    if options.import_stallwatch:
        stallwatch.shutdown(timeout=1.0)
    shutil.rmtree(options.work_dir, ignore_errors=True)
    print(json.dumps(result), flush=True)
    os._exit(0)  # never join the executor's threads: a wedged default executor hangs normal exit


if __name__ == "__main__":
    main()
