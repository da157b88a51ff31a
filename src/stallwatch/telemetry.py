"""The telemetry contract: every metric, attribute and resource attribute stallwatch emits.

This module is the single source of names. Instrumentation imports its names from here, and the
telemetry reference in docs/telemetry.md is generated from `reference_markdown()` (a test checks
that they match). Names follow the OpenTelemetry semantic conventions where one exists (`process.*`,
`error.type`) and use the `stallwatch.` prefix otherwise. Durations are histograms in seconds.
"""

from __future__ import annotations

from typing import Literal

from ._record import Record

InstrumentKind = Literal[
    "counter", "updowncounter", "histogram", "observable_counter", "observable_updowncounter", "observable_gauge"
]


AttributeType = Literal["string", "int", "double", "boolean", "string[]"]


class Attribute(Record):
    """One attribute key with the values it may take and what it means."""

    __slots__ = ("description", "name", "type", "values")
    name: str
    description: str
    values: tuple[str, ...]
    type: AttributeType

    def __init__(
        self, name: str, description: str, values: tuple[str, ...] = (), type: AttributeType = "string"
    ) -> None:
        self._set(name=name, description=description, values=values, type=type)


# Explicit boundaries in seconds for every duration histogram (the SDK's default ones are for milliseconds).
DURATION_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# 15 round values a decade, each at most 1.2 times the one before.
_FINE_STEPS = (1.0, 1.2, 1.4, 1.6, 1.9, 2.2, 2.6, 3.0, 3.5, 4.0, 4.8, 5.6, 6.5, 7.5, 9.0)


def fine_buckets(fine_from: float) -> tuple[float, ...]:
    """`DURATION_BUCKETS` below `fine_from` (a power of ten), then boundaries at most 1.2 times apart
    up to 600 s: from there on, `histogram_quantile` reads a single value within 20 % of it (it
    interpolates inside the value's bucket, whose upper bound is at most 1.2 times its lower)."""
    steps = (round(step * 10.0**exponent, 9) for exponent in range(-3, 3) for step in _FINE_STEPS)
    coarse = (bound for bound in DURATION_BUCKETS if bound < fine_from)
    return (*coarse, *(bound for bound in steps if fine_from <= bound < 600.0), 600.0)


FREEZE_BUCKETS = fine_buckets(1.0)  # fine from STALLWATCH_FREEZE_THRESHOLD's default
BLOCKED_BUCKETS = fine_buckets(0.1)  # fine from the SpawnBlockedHigh alert's threshold
SSH_BUCKETS = fine_buckets(0.1)  # a tunnel opens or closes in a tenth of a second at best
NEBIUS_BUCKETS = fine_buckets(0.01)  # an API call answers in ten milliseconds at best


class Metric(Record):
    """One metric instrument: its name, kind, UCUM unit, meaning and attribute keys."""

    __slots__ = ("attributes", "bounds", "description", "kind", "name", "unit")
    name: str
    kind: InstrumentKind
    unit: str
    description: str
    attributes: tuple[Attribute, ...]
    bounds: tuple[float, ...]  # a duration histogram's bucket boundaries

    def __init__(
        self,
        name: str,
        kind: InstrumentKind,
        unit: str,
        description: str,
        attributes: tuple[Attribute, ...] = (),
        bounds: tuple[float, ...] = DURATION_BUCKETS,
    ) -> None:
        self._set(name=name, kind=kind, unit=unit, description=description, attributes=attributes, bounds=bounds)

    @property
    def buckets(self) -> tuple[float, ...] | None:
        """Explicit bucket boundaries (seconds) for a duration histogram."""
        return self.bounds if self.kind == "histogram" and self.unit == "s" else None

    @property
    def prometheus_name(self) -> str:
        """The series name Prometheus stores (OTel → Prometheus: `.`→`_`, unit suffix, `_total`)."""
        base = self.name.replace(".", "_").replace("-", "_")
        unit_suffix = {"s": "_seconds", "By": "_bytes"}.get(self.unit, "")
        if unit_suffix and not base.endswith(unit_suffix):
            base += unit_suffix
        if self.kind in ("counter", "observable_counter"):
            base += "_total"
        return base


# ---- attributes -------------------------------------------------------------------------------

FORK_KIND = Attribute(
    "stallwatch.fork.kind",
    "Why the process forked: `exec_bound` (a child created only to exec, e.g. a uvloop subprocess "
    "spawn or `Popen(preexec_fn=...)`) or `fork` (a child that lives on, e.g. `os.fork()`).",
    ("exec_bound", "fork"),
)
GRPC_ACTIVE = Attribute(
    "stallwatch.grpc.active",
    "gRPC core threads (`event_engine`, `lifeguard`, `grpc_global_tim`) were running at fork time "
    "(read from `/proc/self/task`, at most once a second).",
    ("true", "false"),
)
SPAWN_LOOP = Attribute(
    "stallwatch.spawn.loop",
    "Event loop of the forking or spawning thread (for a loop's `subprocess_exec`, that loop): `uvloop`, "
    "`asyncio` or `none`.",
    ("uvloop", "asyncio", "none"),
)

# ---- resource attributes ----------------------------------------------------------------------

RESOURCE_VERSION = Attribute("stallwatch.version", "Version of stallwatch in the process.")
RESOURCE_UVLOOP_VERSION = Attribute(
    "stallwatch.uvloop.version", "Installed uvloop version (absent when uvloop is not installed)."
)
RESOURCE_GRPC_FORK_SUPPORT = Attribute(
    "stallwatch.grpc.fork_support",
    "Value of `GRPC_ENABLE_FORK_SUPPORT` the process runs with (`unset` when not set).",
)
RESOURCE_PROCESS_ROLE = Attribute(
    "stallwatch.process.role", "`watchdog` for the freeze watchdog (absent on the host).", ("watchdog",)
)

EXECUTOR_NAME = Attribute(
    "stallwatch.executor.name",
    "Thread-name prefix of a ThreadPoolExecutor (`asyncio-default` for an event loop's default executor).",
)
ERROR_TYPE = Attribute("error.type", "Exception class name (semantic convention `error.type`).")
WEDGE_KIND = Attribute(
    "stallwatch.wedge.kind",
    "What was found: `worker_died` (an executor thread ended abnormally), `orphaned_item` (a submitted "
    "item whose worker died, so its future never completes), `queue_stalled` (items waiting while no "
    "worker is alive), `execution_overdue` (guarded work still running past its deadline).",
    ("worker_died", "orphaned_item", "queue_stalled", "execution_overdue"),
)
EXECUTION_NAME = Attribute("stallwatch.execution.name", "The `name=` given to `stallwatch.execution_timeout`.")
CODE_FUNCTION = Attribute(
    "code.function.name", "Which asyncio timeout expired.", ("asyncio.wait_for", "asyncio.wait", "asyncio.timeout")
)
CODE_FILE = Attribute("code.file.path", "Source file of the host code that set the timeout.")
CODE_LINE = Attribute("code.line.number", "Line of the host code that set the timeout.")
FREEZE_KIND = Attribute(
    "stallwatch.freeze.kind",
    "`gil_held` (no Python thread of the host ran: e.g. uvloop waiting for a forked child to exec) or "
    "`loop_blocked` (the event loop did not run its callbacks while other Python threads did).",
    ("gil_held", "loop_blocked"),
)
FREEZE_CAUSE = Attribute(
    "stallwatch.freeze.cause",
    "What /proc showed the host waiting on: `child_core_dump`, `child_before_exec` (a forked copy that "
    "has not exec'd), `vfork_child`, `blocked_syscall` or `unknown`.",
    ("child_core_dump", "child_before_exec", "vfork_child", "blocked_syscall", "unknown"),
)
LOOP = Attribute("stallwatch.loop", "Event loop implementation.", ("uvloop", "asyncio"))
TELEMETRY_SIGNAL = Attribute("stallwatch.telemetry.signal", "Which signal.", ("traces", "metrics", "logs"))
DROP_REASON = Attribute(
    "stallwatch.telemetry.drop_reason",
    "Why telemetry was dropped: `queue_full` (the exporter fell behind; for metrics, values that waited for a "
    "collection past an instrumentation's limit of 100,000), `export_failed` (the backend refused "
    "or failed), `backend_down` (made while the last export had failed: dropped at once, see "
    "docs/guarantees.md), `shutdown_timeout` (still queued when STALLWATCH_SHUTDOWN_TIMEOUT ran out), `backend_slow` "
    "(made while the last export took longer than STALLWATCH_SLOW_EXPORT_SECONDS: dropped at once). A sampled "
    "span that starts while every span queue is full or the backend is down or slow is not recorded at all, "
    "and counted with that reason.",
    ("queue_full", "export_failed", "backend_down", "shutdown_timeout", "backend_slow"),
)
INSTRUMENTATION_COMPONENT = Attribute(
    "stallwatch.component", "Which part of stallwatch failed (e.g. `executor`); its setting turns it off."
)

PROCESS_EXECUTABLE_NAME = Attribute(
    "process.executable.name",
    "Basename of the spawned program (for a shell command, its first word after `NAME=value` assignments).",
)
SPAWN_METHOD = Attribute(
    "stallwatch.spawn.method",
    "How the child was created: `fork` (a full copy of the host: uvloop's spawn, `Popen(preexec_fn=...)`), "
    "`vfork` (the host is suspended until the child execs; no fork handler runs) or `posix_spawn`.",
    ("fork", "vfork", "posix_spawn"),
)
EXIT_KIND = Attribute(
    "stallwatch.exit.kind",
    "How a child ended: `code` (it exited) or `signal` (a signal killed it).",
    ("code", "signal"),
)
EXIT_SIGNAL = Attribute(
    "stallwatch.exit.signal",
    "Name of the signal that killed a child (`SIGSEGV`, `SIGABRT`, `SIGKILL`, ...); absent when it exited.",
)
SIGNALLED_BY_HOST = Attribute(
    "stallwatch.subprocess.signalled_by_host",
    "The host sent the child a signal while it lived, from Python: `os.kill`/`os.killpg` (so `Popen.send_signal`, "
    "`terminate`, `kill`), `signal.pidfd_send_signal` or `asyncio.subprocess.Process`; absent otherwise.",
    type="boolean",
)
SSH_PHASE = Attribute("stallwatch.ssh.phase", "Which tunnel operation failed.", ("open", "close"))
SSH_AUTH = Attribute(
    "stallwatch.ssh.auth",
    "Outcome of a paramiko connection's authentication; absent when the connection failed before it "
    "(refused, unknown host key, timeout).",
    ("success", "failure"),
)

RPC_SERVICE = Attribute("rpc.service", "Full gRPC service name, e.g. `nebius.compute.v1.InstanceService`.")
RPC_METHOD = Attribute("rpc.method", "gRPC method name, e.g. `Create`.")
RPC_GRPC_STATUS_CODE = Attribute(
    "rpc.grpc.status_code",
    "Numeric gRPC status of the logical call (0 OK, 5 NOT_FOUND, ...); a caller-side timeout counts as 4 "
    "(DEADLINE_EXCEEDED) and a caller cancellation as 1 (CANCELLED).",
    type="int",
)
CLOUD_RESOURCE_TYPE = Attribute(
    "stallwatch.cloud.resource.type", "Kind of cloud resource, from the service name: `compute.instance`, ..."
)

SERVICE_NAME = Attribute(
    "service.name",
    "The service (`OTEL_SERVICE_NAME`); the freeze watchdog carries its host's, and a label on every "
    "Prometheus series.",
)
SERVICE_INSTANCE_ID = Attribute(
    "service.instance.id",
    "The process: the one set in `OTEL_RESOURCE_ATTRIBUTES`, else a UUID made at setup. The freeze watchdog "
    "carries its host's, and a label on every Prometheus series, so one value selects a host and its freezes.",
)

RESOURCE_ATTRIBUTES: tuple[Attribute, ...] = (
    RESOURCE_VERSION,
    RESOURCE_UVLOOP_VERSION,
    RESOURCE_GRPC_FORK_SUPPORT,
    RESOURCE_PROCESS_ROLE,
    SERVICE_NAME,
    SERVICE_INSTANCE_ID,
)
# The resource attributes the Prometheus exporter puts on every series (the rest go to `target_info` only).
PROMETHEUS_RESOURCE_LABELS: tuple[Attribute, ...] = (SERVICE_NAME, SERVICE_INSTANCE_ID)

# ---- metrics ----------------------------------------------------------------------------------

FORK_COUNT = Metric(
    "stallwatch.fork.count",
    "observable_counter",
    "{fork}",
    "Real fork() calls made by the process (not vfork/posix_spawn), by kind, gRPC activity and loop.",
    (FORK_KIND, GRPC_ACTIVE, SPAWN_LOOP),
)
FORK_HANDLERS_SKIPPED = Metric(
    "stallwatch.fork.handlers_skipped",
    "observable_counter",
    "{handler}",
    "Python at-fork handlers skipped because the child was created only to exec.",
)
FORK_WORKERS_DEFERRED = Metric(
    "stallwatch.fork.workers_deferred",
    "observable_counter",
    "{worker}",
    "OpenTelemetry background workers whose restart was moved out of an after-fork handler "
    "to first use in a child that lives on.",
)

EXECUTOR_QUEUE_DURATION = Metric(
    "stallwatch.executor.queue.duration", "histogram", "s",
    "Time a submitted item waited in the executor's queue before a worker started it.", (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTOR_RUN_DURATION = Metric(
    "stallwatch.executor.run.duration", "histogram", "s", "Time a worker spent running an item.", (EXECUTOR_NAME,)
)
EXECUTOR_PENDING = Metric(
    "stallwatch.executor.pending", "observable_updowncounter", "{item}",
    "Items submitted and not started yet (the executor's queue length).", (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTOR_OLDEST_PENDING = Metric(
    "stallwatch.executor.pending.oldest_age", "observable_gauge", "s",
    "How long the oldest item still waiting in the executor's queue has waited (0 when none waits).",
    (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTOR_RUNNING = Metric(
    "stallwatch.executor.running", "observable_updowncounter", "{item}",
    "Items a live worker is running now.", (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTOR_WORKERS = Metric(
    "stallwatch.executor.workers", "observable_gauge", "{thread}", "Worker threads alive.", (EXECUTOR_NAME,)
)
EXECUTOR_MAX_WORKERS = Metric(
    "stallwatch.executor.max_workers", "observable_gauge", "{thread}",
    "Configured max_workers; dead workers still count against it in CPython.", (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTOR_WORKER_DEATHS = Metric(
    "stallwatch.executor.worker.deaths", "counter", "{thread}",
    "Executor worker threads that ended by an exception (e.g. a stale async SystemExit).", (EXECUTOR_NAME, ERROR_TYPE),
)  # fmt: skip
EXECUTOR_ORPHANED = Metric(
    "stallwatch.executor.orphaned", "counter", "{item}",
    "Items dequeued or run by a worker that died, whose futures would never complete.", (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTOR_ORPHANED_OUTSTANDING = Metric(
    "stallwatch.executor.orphaned.outstanding", "observable_updowncounter", "{item}",
    "Orphaned items whose futures are still not done: their awaiters wait. Back to 0 once each is healed "
    "(STALLWATCH_EXECUTOR_HEAL=true), cancelled or completed by the host.", (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTOR_HEALED = Metric(
    "stallwatch.executor.healed", "counter", "{item}",
    "Orphaned items failed with stallwatch.WorkerDied (STALLWATCH_EXECUTOR_HEAL=true).", (EXECUTOR_NAME,),
)  # fmt: skip
WEDGE_DETECTED = Metric(
    "stallwatch.wedge.detected", "counter", "{wedge}", "Wedges found, by kind.", (WEDGE_KIND, EXECUTOR_NAME)
)
ASYNC_EXC_INJECTED = Metric(
    "stallwatch.async_exception.injected", "counter", "{exception}",
    "Async exceptions scheduled into a running executor work item (interrupt_thread or a guarded raw call).",
    (EXECUTOR_NAME,),
)  # fmt: skip
ASYNC_EXC_DELIVERED = Metric(
    "stallwatch.async_exception.delivered", "counter", "{exception}",
    "Scheduled async exceptions that landed inside the item they were meant for.", (EXECUTOR_NAME,),
)  # fmt: skip
ASYNC_EXC_REVOKED = Metric(
    "stallwatch.async_exception.revoked", "counter", "{exception}",
    "Scheduled async exceptions cleared because their item ended (or the wait timed out) first.", (EXECUTOR_NAME,),
)  # fmt: skip
ASYNC_EXC_REFUSED = Metric(
    "stallwatch.async_exception.refused", "counter", "{exception}",
    "Async exceptions not scheduled because the target worker was idle (it would have killed it).",
    (EXECUTOR_NAME,),
)  # fmt: skip
EXECUTION_TIMEOUTS = Metric(
    "stallwatch.execution.timeouts", "counter", "{timeout}",
    "stallwatch.execution_timeout scopes that expired.", (EXECUTION_NAME,),
)  # fmt: skip
EXECUTION_OVERRUN_DURATION = Metric(
    "stallwatch.execution.overrun.duration", "histogram", "s",
    "How long executor work guarded by an expired execution_timeout kept running past the deadline.",
    (EXECUTION_NAME,),
)  # fmt: skip
EXECUTION_OVERDUE = Metric(
    "stallwatch.execution.overdue", "observable_gauge", "{item}",
    "Guarded executor work still running past its execution_timeout deadline now.", (EXECUTION_NAME,),
)  # fmt: skip
ASYNCIO_TIMEOUTS = Metric(
    "stallwatch.asyncio.timeouts", "counter", "{timeout}",
    "Expirations of asyncio.wait_for, asyncio.timeout and asyncio.wait(timeout=), by call site.",
    (CODE_FUNCTION, CODE_FILE, CODE_LINE),
)  # fmt: skip
FREEZE_ACTIVE = Metric(
    "stallwatch.freeze.active", "observable_gauge", "{freeze}",
    "1 while the watchdog sees the host frozen (exported by the watchdog process, live).", (FREEZE_KIND, FREEZE_CAUSE),
)  # fmt: skip
FREEZE_DURATION = Metric(
    "stallwatch.freeze.duration", "histogram", "s", "How long each freeze lasted, from the last fresh heartbeat.",
    (FREEZE_KIND, FREEZE_CAUSE), FREEZE_BUCKETS,
)  # fmt: skip
FREEZE_HOST_KILLED = Metric(
    "stallwatch.freeze.host_killed", "observable_gauge", "s",
    "How long the host had been frozen when it died, by the freeze's kind and cause: 0 until the host dies "
    "frozen. The watchdog's last word: it keeps its Prometheus endpoint up for one scrape after the death "
    "(STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT) and exports it over OTLP before it exits.",
    (FREEZE_KIND, FREEZE_CAUSE),
)  # fmt: skip
LOOP_LAG = Metric(
    "stallwatch.loop.lag", "histogram", "s",
    "How long the main event loop took to run a heartbeat callback handed to it (every 100 ms) from another thread.",
    (LOOP,),
)  # fmt: skip
CLOUD_RESOURCES_UNCONFIRMED = Metric(
    "stallwatch.cloud.resources.unconfirmed", "observable_updowncounter", "{resource}",
    "Leak candidates not confirmed yet: creates a dead process's journal held with an intent and no outcome "
    "(each was a WARNING `cloud resource create unconfirmed` with its ids at the start that found it), until "
    "`stallwatch leaks --confirm` says they were reconciled against the cloud. Reported by one process per "
    "journal directory.",
    (CLOUD_RESOURCE_TYPE,),
)  # fmt: skip
TELEMETRY_DROPPED = Metric(
    "stallwatch.telemetry.dropped", "observable_counter", "{item}",
    "Spans, log records or metric exports that never reached the backend; the host was never held up for them.",
    (TELEMETRY_SIGNAL, DROP_REASON),
)  # fmt: skip
INSTRUMENTATION_ERRORS = Metric(
    "stallwatch.instrumentation.errors", "counter", "{error}",
    "Failures inside stallwatch (its wrappers, heartbeat, freeze watchdog); the host's calls went ahead unchanged.",
    (INSTRUMENTATION_COMPONENT,),
)  # fmt: skip

SUBPROCESS_SPAWN_DURATION = Metric(
    "stallwatch.subprocess.spawn.duration", "histogram", "s",
    "How long the calling thread was blocked inside the spawn call (under uvloop: the whole loop, holding the GIL).",
    (PROCESS_EXECUTABLE_NAME, SPAWN_LOOP, SPAWN_METHOD), BLOCKED_BUCKETS,
)  # fmt: skip
SUBPROCESS_EXITS = Metric(
    "stallwatch.subprocess.exits", "observable_counter", "{process}", "Children reaped, by how they ended.",
    (PROCESS_EXECUTABLE_NAME, EXIT_KIND, EXIT_SIGNAL, SIGNALLED_BY_HOST),
)  # fmt: skip
SUBPROCESS_ACTIVE = Metric(
    "stallwatch.subprocess.active", "observable_updowncounter", "{process}", "Children spawned and not reaped yet.",
    (PROCESS_EXECUTABLE_NAME,),
)  # fmt: skip
SSH_TUNNEL_OPEN_DURATION = Metric(
    "stallwatch.ssh.tunnel.open.duration",
    "histogram",
    "s",
    "Time to open an SSH tunnel (successful or not).",
    bounds=SSH_BUCKETS,
)
SSH_TUNNEL_CLOSE_DURATION = Metric(
    "stallwatch.ssh.tunnel.close.duration",
    "histogram",
    "s",
    "Time to close an SSH tunnel (successful or not).",
    bounds=SSH_BUCKETS,
)
SSH_TUNNEL_ACTIVE = Metric(
    "stallwatch.ssh.tunnel.active", "updowncounter", "{tunnel}", "SSH tunnels opened and not closed yet."
)
SSH_TUNNEL_FAILURES = Metric(
    "stallwatch.ssh.tunnel.failures", "counter", "{failure}",
    "Tunnel opens or closes that raised or whose ssh child failed (non-zero exit status or killed by a signal).",
    (SSH_PHASE, EXIT_SIGNAL, ERROR_TYPE),
)  # fmt: skip
SSH_CONNECT_DURATION = Metric(
    "stallwatch.ssh.connect.duration", "histogram", "s",
    "Time a paramiko `SSHClient.connect` took: TCP, key exchange and authentication (successful or not).",
    bounds=SSH_BUCKETS,
)  # fmt: skip
SSH_CONNECTIONS_ACTIVE = Metric(
    "stallwatch.ssh.connections.active", "updowncounter", "{connection}",
    "paramiko SSH connections established and not closed yet.",
)  # fmt: skip
SSH_CONNECTION_FAILURES = Metric(
    "stallwatch.ssh.connection.failures", "counter", "{failure}",
    "paramiko connects that raised, by `error.type` (`NoValidConnectionsError` when refused) and "
    "`stallwatch.ssh.auth` (`failure` when the server rejected the credentials).",
    (SSH_AUTH, ERROR_TYPE),
)  # fmt: skip
SSH_COMMAND_DURATION = Metric(
    "stallwatch.ssh.command.duration", "histogram", "s",
    "Remote commands run through paramiko, from the exec request to the exit status (or the channel's close); "
    "`error.type` is the non-zero exit status, the signal name, `closed` (no status) or the exception class.",
    (ERROR_TYPE,),
)  # fmt: skip

NEBIUS_CALL_DURATION = Metric(
    "stallwatch.nebius.call.duration", "histogram", "s",
    "Nebius API logical calls (authentication and every retry included), by outcome.",
    (RPC_SERVICE, RPC_METHOD, RPC_GRPC_STATUS_CODE), NEBIUS_BUCKETS,
)  # fmt: skip
NEBIUS_CALLS_ACTIVE = Metric(
    "stallwatch.nebius.calls.active",
    "observable_updowncounter",
    "{call}",
    "Nebius API calls in flight.",
    (RPC_SERVICE, RPC_METHOD),
)
CLOUD_RESOURCES_CREATED = Metric(
    "stallwatch.cloud.resources.created", "counter", "{resource}",
    "Create calls the cloud accepted (it returned an operation for a new resource).", (CLOUD_RESOURCE_TYPE,),
)  # fmt: skip
CLOUD_RESOURCES_DELETED = Metric(
    "stallwatch.cloud.resources.deleted", "counter", "{resource}", "Delete calls the cloud accepted.",
    (CLOUD_RESOURCE_TYPE,),
)  # fmt: skip

METRICS: tuple[Metric, ...] = (
    FORK_COUNT,
    FORK_HANDLERS_SKIPPED,
    FORK_WORKERS_DEFERRED,
    EXECUTOR_QUEUE_DURATION,
    EXECUTOR_RUN_DURATION,
    EXECUTOR_PENDING,
    EXECUTOR_OLDEST_PENDING,
    EXECUTOR_RUNNING,
    EXECUTOR_WORKERS,
    EXECUTOR_MAX_WORKERS,
    EXECUTOR_WORKER_DEATHS,
    EXECUTOR_ORPHANED,
    EXECUTOR_ORPHANED_OUTSTANDING,
    EXECUTOR_HEALED,
    WEDGE_DETECTED,
    ASYNC_EXC_INJECTED,
    ASYNC_EXC_DELIVERED,
    ASYNC_EXC_REVOKED,
    ASYNC_EXC_REFUSED,
    EXECUTION_TIMEOUTS,
    EXECUTION_OVERRUN_DURATION,
    EXECUTION_OVERDUE,
    ASYNCIO_TIMEOUTS,
    FREEZE_ACTIVE,
    FREEZE_DURATION,
    FREEZE_HOST_KILLED,
    LOOP_LAG,
    SUBPROCESS_SPAWN_DURATION,
    SUBPROCESS_EXITS,
    SUBPROCESS_ACTIVE,
    SSH_TUNNEL_OPEN_DURATION,
    SSH_TUNNEL_CLOSE_DURATION,
    SSH_TUNNEL_ACTIVE,
    SSH_TUNNEL_FAILURES,
    SSH_CONNECT_DURATION,
    SSH_CONNECTIONS_ACTIVE,
    SSH_CONNECTION_FAILURES,
    SSH_COMMAND_DURATION,
    NEBIUS_CALL_DURATION,
    NEBIUS_CALLS_ACTIVE,
    CLOUD_RESOURCES_CREATED,
    CLOUD_RESOURCES_DELETED,
    CLOUD_RESOURCES_UNCONFIRMED,
    TELEMETRY_DROPPED,
    INSTRUMENTATION_ERRORS,
)

# ---- spans ------------------------------------------------------------------------------------

PROCESS_PID = Attribute("process.pid", "Pid of the child.", type="int")
PROCESS_EXIT_CODE = Attribute(
    "process.exit.code",
    "The child's return code as Python reports it: negative `-N` when signal N killed it.",
    type="int",
)
PROCESS_ARGS_COUNT = Attribute(
    "process.args_count",
    "Number of arguments, the program included; a shell command line counts as one.",
    type="int",
)
PROCESS_COMMAND_ARGS = Attribute(
    "process.command_args", "Scrubbed arguments; recorded only with `STALLWATCH_RECORD_ARGS=true`.", type="string[]"
)
SPAWN_BLOCKED = Attribute(
    "stallwatch.spawn.blocked_seconds", "How long the calling thread was blocked inside the spawn call.", type="double"
)
SPAWN_FALLBACK = Attribute(
    "stallwatch.spawn.fallback",
    "Why a uvloop spawn used uvloop's own fork although `STALLWATCH_UVLOOP_SPAWN=vfork` (e.g. `preexec_fn`).",
)
SUBPROCESS_EXEC = Attribute(
    "stallwatch.subprocess.exec",
    "Whether the child ran its program, from the kernel's forked-never-exec'd flag: `done` (the flag was clear, "
    "or a vfork/posix_spawn child was still running when its spawn call returned), `not_done` (the flag was "
    "set: it died before exec, as in the freeze incident), `unknown` (reaped by someone else before stallwatch "
    "looked).",
    ("done", "not_done", "unknown"),
)
RUNNING_AT_SHUTDOWN = Attribute(
    "stallwatch.subprocess.running_at_shutdown",
    "The child was still running when stallwatch shut down.",
    type="boolean",
)
SERVER_ADDRESS = Attribute("server.address", "SSH destination host (never the user name).")
SERVER_PORT = Attribute("server.port", "SSH destination port (absent when ssh's default applies).", type="int")
SSH_FORWARDS_LOCAL = Attribute("stallwatch.ssh.forwards.local", "Number of local (`-L`) forwards.", type="int")
SSH_FORWARDS_REMOTE = Attribute("stallwatch.ssh.forwards.remote", "Number of remote (`-R`) forwards.", type="int")
SSH_SOCKET_KINDS = Attribute(
    "stallwatch.ssh.socket.kinds", "Kinds of the forwarded sockets, sorted and comma-separated.", ("unix", "tcp")
)
SSH_CONTROL_SOCKET = Attribute(
    "stallwatch.ssh.control_socket", "A control socket (ControlMaster) is in use.", type="boolean"
)
SSH_BACKGROUND = Attribute(
    "stallwatch.ssh.background", "ssh runs in the background (`-f`) after authentication.", type="boolean"
)
SSH_EXIT_STATUS = Attribute(
    "stallwatch.ssh.exit.status",
    "Return code of the last ssh child of the operation (negative: killed by a signal).",
    type="int",
)
SSH_COMMAND_EXIT_STATUS = Attribute(
    "stallwatch.ssh.command.exit_status",
    "Exit status the server reported for a remote command; absent when it reported none (a signal killed "
    "the command, see `stallwatch.exit.signal`, or the channel closed first).",
    type="int",
)


RPC_SYSTEM = Attribute("rpc.system", "Always `grpc` (and `rpc.system.name`, the newer name).", ("grpc",))
RPC_RESPONSE_STATUS_CODE = Attribute(
    "rpc.response.status_code", "gRPC status name of the logical call (`OK`, `NOT_FOUND`, ...), newer conventions."
)
NEBIUS_ATTEMPTS = Attribute("stallwatch.nebius.attempts", "RPC attempts the SDK made (1 + retries).", type="int")
NEBIUS_REQUEST_ID = Attribute("stallwatch.nebius.request_id", "`x-request-id` the Nebius API returned.")
NEBIUS_TRACE_ID = Attribute("stallwatch.nebius.trace_id", "`x-trace-id` the Nebius API returned.")
CLOUD_OPERATION_ID = Attribute("stallwatch.cloud.operation.id", "Id of the operation a create/delete/update started.")
CLOUD_RESOURCE_ID = Attribute("stallwatch.cloud.resource.id", "Id of the resource the operation acts on.")
CLOUD_ACTION = Attribute("stallwatch.cloud.action", "What the ledger record is about.", ("create", "delete"))
CLOUD_STATUS = Attribute("stallwatch.cloud.status", "Outcome of a ledger call: gRPC status name, `timeout`, ...")
CLOUD_RPC = Attribute("stallwatch.cloud.rpc", "`{rpc.service}/{rpc.method}` of a ledger record.")
IDENTIFIERS = frozenset(
    attribute.name for attribute in (NEBIUS_REQUEST_ID, NEBIUS_TRACE_ID, CLOUD_OPERATION_ID, CLOUD_RESOURCE_ID)
)
"""Attributes holding ids a server handed out: random-looking, never secret, and what a postmortem joins on, so the
last check before telemetry leaves the process (`core.scrub.scrub_attributes`) keeps them as they are."""


SpanKindName = Literal["INTERNAL", "CLIENT"]


class Span(Record):
    """One span stallwatch starts: its name, kind, meaning, attributes and events."""

    __slots__ = ("attributes", "description", "events", "kind", "name")
    name: str
    kind: SpanKindName
    description: str
    attributes: tuple[Attribute, ...]
    events: tuple[str, ...]

    def __init__(
        self,
        name: str,
        kind: SpanKindName,
        description: str,
        attributes: tuple[Attribute, ...] = (),
        events: tuple[str, ...] = (),
    ) -> None:
        self._set(name=name, kind=kind, description=description, attributes=attributes, events=events)


SUBPROCESS_SPAN = Span(
    "{process.executable.name}", "CLIENT",
    "One child process, from the spawn call until it is reaped (or stallwatch shuts down). Status ERROR when "
    "the spawn raised, the child exited non-zero or a signal killed it; `error.type` is then the exception "
    "class, the exit code, or the signal name.",
    (PROCESS_EXECUTABLE_NAME, PROCESS_PID, PROCESS_EXIT_CODE, PROCESS_ARGS_COUNT, PROCESS_COMMAND_ARGS, ERROR_TYPE,
     SPAWN_LOOP, SPAWN_METHOD, SPAWN_BLOCKED, SPAWN_FALLBACK, GRPC_ACTIVE, EXIT_SIGNAL, SUBPROCESS_EXEC,
     SIGNALLED_BY_HOST, RUNNING_AT_SHUTDOWN),
    ("`stallwatch.subprocess.host_signal` when the host sent the child a signal, at that time: `signal`, "
     "`seconds` (since the spawn).",
     "`stallwatch.subprocess.early_signal`: a signal the host did not send killed the child, and it had not "
     "exec'd (`stallwatch.subprocess.exec=not_done`: the freeze incident's signature) or it died within 1 s of the "
     "spawn and stallwatch could not tell (`unknown`); attributes `stallwatch.exit.signal`, `seconds`, "
     "`stallwatch.subprocess.exec`.",),
)  # fmt: skip
_TUNNEL_ATTRIBUTES = (
    SERVER_ADDRESS, SERVER_PORT, SSH_FORWARDS_LOCAL, SSH_FORWARDS_REMOTE, SSH_SOCKET_KINDS, SSH_CONTROL_SOCKET,
    SSH_BACKGROUND,
)  # fmt: skip
SSH_OPEN_SPAN = Span(
    "ssh.tunnel.open", "CLIENT", "Opening an SSH tunnel; the `ssh` child spans nest under it.",
    (*_TUNNEL_ATTRIBUTES, SSH_EXIT_STATUS, EXIT_SIGNAL, ERROR_TYPE),
)  # fmt: skip
SSH_CLOSE_SPAN = Span(
    "ssh.tunnel.close", "CLIENT",
    "Closing an SSH tunnel. Status ERROR when close raised or its ssh child failed, even where the tunnel "
    "class only logs it (dstack logs `Failed to close SSH tunnel, exit status: -11`).",
    (*_TUNNEL_ATTRIBUTES, SSH_EXIT_STATUS, EXIT_SIGNAL, ERROR_TYPE),
)  # fmt: skip
SSH_CHECK_SPAN = Span(
    "ssh.tunnel.check", "CLIENT", "A tunnel health check (`ssh -O check`).", (*_TUNNEL_ATTRIBUTES, SSH_EXIT_STATUS)
)
SSH_EXEC_SPAN = Span(
    "ssh.tunnel.exec", "CLIENT", "A command run over the tunnel's master connection.",
    (*_TUNNEL_ATTRIBUTES, SSH_EXIT_STATUS, ERROR_TYPE),
)  # fmt: skip
_PEER_ATTRIBUTES = (SERVER_ADDRESS, SERVER_PORT)
SSH_CONNECTION_SPAN = Span(
    "ssh.connection", "CLIENT",
    "A paramiko SSH connection, from `SSHClient.connect` to `SSHClient.close`. Status ERROR when connect "
    "raised (refused, host key, authentication): the span then ends with it.",
    (*_PEER_ATTRIBUTES, SSH_AUTH, ERROR_TYPE),
    ("`stallwatch.ssh.connected` when connect returned: `seconds` it took.",),
)  # fmt: skip
SSH_COMMAND_SPAN = Span(
    "ssh.command", "CLIENT",
    "A remote command run through paramiko (`exec_command`), from the exec request until the server reports "
    "its exit status or signal, or its channel closes. Status ERROR for a non-zero status, a signal, a close "
    "without status or an exec that raised. The command line is recorded only with `STALLWATCH_RECORD_ARGS=true`, "
    "scrubbed.",
    (*_PEER_ATTRIBUTES, PROCESS_EXECUTABLE_NAME, PROCESS_COMMAND_ARGS, SSH_COMMAND_EXIT_STATUS, EXIT_SIGNAL,
     ERROR_TYPE),
)  # fmt: skip
SSH_SFTP_SPAN = Span(
    "ssh.sftp", "CLIENT", "A paramiko SFTP session, from `open_sftp` until its channel closes.",
    (*_PEER_ATTRIBUTES, ERROR_TYPE),
)  # fmt: skip

NEBIUS_SPAN = Span(
    "{rpc.service}/{rpc.method}", "CLIENT",
    "One Nebius API logical call, from the first await to the result: authentication and every retry. "
    "`error.type` is `timeout` or `cancelled` for the caller's deadline or cancellation, else the gRPC status "
    "name or the exception class. Payloads are never recorded.",
    (RPC_SYSTEM, RPC_SERVICE, RPC_METHOD, RPC_GRPC_STATUS_CODE, RPC_RESPONSE_STATUS_CODE, NEBIUS_ATTEMPTS,
     NEBIUS_REQUEST_ID, NEBIUS_TRACE_ID, CLOUD_OPERATION_ID, CLOUD_RESOURCE_ID, ERROR_TYPE),
    ("`stallwatch.nebius.attempt` per RPC attempt: `attempt`, `rpc.grpc.status_code`, `duration_seconds`, "
     "`backoff_seconds` (wait before it).",),
)  # fmt: skip

INTERRUPTED = Attribute(
    "stallwatch.interrupted", "The span was replayed from a dead process's journal: it never ended.", type="boolean"
)
INTERRUPTED_REASON = Attribute(
    "stallwatch.interrupted.reason",
    "Why it never ended: `host_killed` (killed while frozen, per the watchdog), `frozen` (died frozen), "
    "`shutdown` (still open at shutdown), `process_died`.",
    ("host_killed", "frozen", "shutdown", "process_died"),
)
FREEZE_OUTCOME = Attribute(
    "stallwatch.freeze.outcome", "How a freeze ended: the host went on, or it died frozen.", ("thawed", "host_killed")
)
FREEZE_SPAWN = Attribute(
    "stallwatch.freeze.spawn",
    "The spawn in flight when the host froze: `name (N args)`, N as in its span's `process.args_count`.",
)
FREEZE_HOST_EXIT_SIGNAL = Attribute(
    "stallwatch.freeze.host.exit_signal", "Signal that killed a frozen host, when the watchdog could read it."
)
FREEZE_SPAN = Span(
    "stallwatch.freeze", "INTERNAL",
    "Exported by the watchdog at the thaw (or the host's death): from the last fresh heartbeat to the end, "
    "linked to the frozen spawn's span, with the /proc diagnosis (`stallwatch.freeze.main_thread.*`, "
    "`stallwatch.freeze.child.*`) as attributes.",
    (FREEZE_KIND, FREEZE_CAUSE, FREEZE_OUTCOME, FREEZE_SPAWN, FREEZE_HOST_EXIT_SIGNAL),
)  # fmt: skip
WORK_ITEM_QUEUE_SECONDS = Attribute(
    "stallwatch.executor.queue_seconds", "How long the item waited in the queue.", type="double"
)
WORK_ITEM_RUN_SECONDS = Attribute("stallwatch.executor.run_seconds", "How long a worker ran it.", type="double")
WORK_ITEM_SPAN = Span(
    "{stallwatch.executor.name} work item", "INTERNAL",
    "One executor work item submitted inside a sampled trace, from submission to completion, in the "
    "submitter's trace (its context reaches the worker, where this span is the current one).",
    (EXECUTOR_NAME, WORK_ITEM_QUEUE_SECONDS, WORK_ITEM_RUN_SECONDS),
    ("`stallwatch.wedge` when the item is orphaned: `stallwatch.wedge.kind`, `message`.",),
)  # fmt: skip

REPLAYED_SPAN = Span(
    "(the original span's name)", "INTERNAL",
    "An SSH (tunnel or paramiko) or Nebius span that was open when its process died, replayed at the next "
    "`setup()` from the journal with its original trace/span ids, parent and start; it ends at the last evidence "
    "of life, status ERROR.",
    (INTERRUPTED, INTERRUPTED_REASON),
)  # fmt: skip

SPANS: tuple[Span, ...] = (
    SUBPROCESS_SPAN, SSH_OPEN_SPAN, SSH_CLOSE_SPAN, SSH_CHECK_SPAN, SSH_EXEC_SPAN, SSH_CONNECTION_SPAN,
    SSH_COMMAND_SPAN, SSH_SFTP_SPAN, NEBIUS_SPAN, FREEZE_SPAN, WORK_ITEM_SPAN, REPLAYED_SPAN,
)  # fmt: skip

# ---- Sentry events (`stallwatch.sentry`) ------------------------------------------------------

INCIDENT_KIND = Attribute(
    "stallwatch.kind",
    "Which stallwatch event a Sentry event is (one fingerprint family each).",
    ("freeze", "worker_died", "orphaned_item", "queue_stalled", "execution_overdue", "stale_async_exception",
     "leak_candidate"),
)  # fmt: skip
THREAD_NAME = Attribute("thread.name", "Name of the thread concerned (semantic convention `thread.name`).")
OTEL_TRACE_ID = Attribute(
    "otel.trace_id", "OpenTelemetry trace id of the affected request (also the event's `trace` context)."
)


SentryLevel = Literal["error", "warning"]
SentrySender = Literal["host", "watchdog"]


class SentryEvent(Record):
    """One kind of Sentry event: how it is grouped, what it says and which option turns it off.

    The fingerprint is `["stallwatch", kind, *values of grouping]`, and the title names only
    grouping values, so every event of one Sentry issue has the same title. `context` lists the
    keys of the event's `stallwatch` context (the variable facts: durations, counts, the log line).
    """

    __slots__ = ("context", "description", "grouping", "kind", "level", "option", "sender", "tags", "title")
    kind: str
    level: SentryLevel
    title: str
    grouping: tuple[Attribute, ...]
    tags: tuple[Attribute, ...]
    context: tuple[str, ...]
    option: str  # the `StallwatchIntegration` keyword that turns this kind off
    sender: SentrySender
    description: str

    def __init__(
        self,
        kind: str,
        level: SentryLevel,
        title: str,
        grouping: tuple[Attribute, ...],
        tags: tuple[Attribute, ...],
        context: tuple[str, ...],
        option: str,
        sender: SentrySender,
        description: str,
    ) -> None:
        self._set(kind=kind, level=level, title=title, grouping=grouping, tags=tags, context=context, option=option,
                  sender=sender, description=description)  # fmt: skip


SENTRY_FREEZE = SentryEvent(
    "freeze", "error", "stallwatch: host frozen, {stallwatch.freeze.kind} ({stallwatch.freeze.cause})",
    (FREEZE_KIND, FREEZE_CAUSE), (FREEZE_KIND, FREEZE_CAUSE, FREEZE_SPAWN),
    ("description", "host_pid", "frozen_seconds", "threshold_seconds", "main_thread_state", "main_thread_syscall",
     "main_thread_wchan", "waits_on", "child", "stacks"),
    "freezes", "watchdog",
    "Sent by the watchdog when the freeze is detected, while the host is still frozen; one event per freeze "
    "(the thaw or the host's death is on the `stallwatch.freeze` span).",
)  # fmt: skip
SENTRY_WORKER_DIED = SentryEvent(
    "worker_died", "warning", "stallwatch: executor worker died of {error.type} ({stallwatch.executor.name})",
    (EXECUTOR_NAME, ERROR_TYPE), (EXECUTOR_NAME, ERROR_TYPE, THREAD_NAME), ("description", "cause", "held_an_item"),
    "wedges", "host", "An executor thread ended by an exception (a stale async `SystemExit`: the wedge incident).",
)  # fmt: skip
SENTRY_ORPHANED_ITEM = SentryEvent(
    "orphaned_item", "error", "stallwatch: executor item will never complete ({stallwatch.executor.name})",
    (EXECUTOR_NAME,), (EXECUTOR_NAME, THREAD_NAME),
    ("description", "item_age_seconds", "worker_died_before_running_it", "cause", "healed"),
    "wedges", "host", "A submitted item whose worker died: its awaiter waits forever unless healed.",
)  # fmt: skip
SENTRY_QUEUE_STALLED = SentryEvent(
    "queue_stalled", "error", "stallwatch: executor queue stalled with no live worker ({stallwatch.executor.name})",
    (EXECUTOR_NAME,), (EXECUTOR_NAME,), ("description", "items_waiting", "oldest_wait_seconds", "healed"),
    "wedges", "host", "Items wait while no worker of the executor is alive (once per episode).",
)  # fmt: skip
SENTRY_EXECUTION_OVERDUE = SentryEvent(
    "execution_overdue", "warning",
    "stallwatch: work still running past its execution_timeout ({stallwatch.execution.name})",
    (EXECUTION_NAME,), (EXECUTION_NAME, EXECUTOR_NAME, THREAD_NAME), ("description", "seconds_past_deadline"),
    "wedges", "host", "Guarded thread work still running past its deadline (a timeout cannot stop a thread).",
)  # fmt: skip
SENTRY_STALE_ASYNC_EXCEPTION = SentryEvent(
    "stale_async_exception", "warning", "stallwatch: stale {error.type} aimed at an idle executor worker refused",
    (ERROR_TYPE,), (ERROR_TYPE, THREAD_NAME), ("description",),
    "stale_async_exceptions", "host",
    "A raw `PyThreadState_SetAsyncExc` aimed at an idle worker, refused (it would have killed the worker and "
    "stranded the next item); the trace is the caller's.",
)  # fmt: skip
SENTRY_LEAK_CANDIDATE = SentryEvent(
    "leak_candidate", "warning",
    "stallwatch: cloud resource {stallwatch.cloud.action} unconfirmed ({stallwatch.cloud.resource.type})",
    (CLOUD_ACTION, CLOUD_RESOURCE_TYPE), (CLOUD_ACTION, CLOUD_RESOURCE_TYPE, CLOUD_RPC, CLOUD_RESOURCE_ID),
    ("description", "dead_process_pid", "intent_time"),
    "leak_candidates", "host",
    "Found at `setup()` in a dead process's journal: a create/delete with no recorded outcome (sent when Sentry "
    "was initialised before `setup()`).",
)  # fmt: skip
SENTRY_EVENTS: tuple[SentryEvent, ...] = (
    SENTRY_FREEZE, SENTRY_WORKER_DIED, SENTRY_ORPHANED_ITEM, SENTRY_QUEUE_STALLED, SENTRY_EXECUTION_OVERDUE,
    SENTRY_STALE_ASYNC_EXCEPTION, SENTRY_LEAK_CANDIDATE,
)  # fmt: skip

INSTRUMENTATION_SCOPE = "stallwatch"


def reference_markdown() -> str:
    """Render the telemetry tables of docs/telemetry.md."""
    lines = [
        "| Metric (OTel name) | Prometheus series | Kind | Unit | Attributes | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for metric in METRICS:
        attrs = ", ".join(f"`{a.name}`" for a in metric.attributes) or "-"
        lines.append(
            f"| `{metric.name}` | `{metric.prometheus_name}` | {metric.kind} | `{metric.unit}` "
            f"| {attrs} | {metric.description} |"
        )
    lines += ["", "| Span | Kind | Attributes | Meaning |", "|---|---|---|---|"]
    for span in SPANS:
        events = "".join(f" Event {event}" for event in span.events)
        attrs = ", ".join(f"`{a.name}`" for a in span.attributes)
        lines.append(f"| `{span.name}` | {span.kind} | {attrs} | {span.description}{events} |")
    groups: list[Metric | Span] = [*METRICS, *SPANS]
    attributes = {a.name: a for group in groups for a in group.attributes}
    lines += ["", "| Attribute | Values | Meaning |", "|---|---|---|"]
    for attr in [*attributes.values(), *RESOURCE_ATTRIBUTES]:
        values = ", ".join(f"`{v}`" for v in attr.values) or attr.type
        kind = " (resource)" if attr in RESOURCE_ATTRIBUTES else ""
        lines.append(f"| `{attr.name}`{kind} | {values} | {attr.description} |")
    return "\n".join(lines) + "\n"


def sentry_markdown() -> str:
    """Render the table of Sentry events in docs/telemetry.md."""
    lines = [
        "| `stallwatch.kind` | Sent by | Level | Title | Fingerprint | Tags | `stallwatch` context | Meaning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for event in SENTRY_EVENTS:
        fingerprint = ", ".join(["`stallwatch`", f"`{event.kind}`", *(f"`{{{a.name}}}`" for a in event.grouping)])
        tags = ", ".join(f"`{a.name}`" for a in (INCIDENT_KIND, *event.tags, OTEL_TRACE_ID))
        context = ", ".join(f"`{key}`" for key in event.context)
        lines.append(
            f"| `{event.kind}` | {event.sender} | {event.level} | {event.title} | {fingerprint} | {tags} | {context} "
            f"| {event.description} Off: `{event.option}=False`. |"
        )
    return "\n".join(lines) + "\n"
