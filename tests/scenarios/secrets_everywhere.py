"""Scenario: a uvloop server runs every instrumented operation with secrets from tests/secrets_corpus.py.

Usage: python secrets_everywhere.py SNAPSHOT_DIR USER HOST PORT IDENTITY HTTP_PORT SOCK_DIR
(with tests/ on PYTHONPATH). Settings come from the environment: the test points the file exporter and
the journal at their defaults under XDG_STATE_HOME, and OTLP at its receiver; arguments are recorded,
the trace context goes to children, the stallwatch loggers log at DEBUG and the watchdog runs.
Does: spawns on every path (Popen, shell, posix_spawn, uvloop exec and shell) with secret argv, shell
strings and environments; a real dstack SSH tunnel with secret `-o` options and a secret-named key;
Nebius calls with an IAM token and secrets in the payloads; executor items with secret arguments; a
0.8 s block of the event loop, a freeze the watchdog reports. With STALLWATCH_FAULTHANDLER on (the
test turns it on) that block, a sleep while the other threads wait, is the only one meant to pass the
threshold, so the only stacks written: the sync spawns run before the loop does, `nebius.sdk` is
imported before it too (not on it at first use), and the executor items never hold the loop while a
pool's thread starts or exits. Before shutdown it
copies the heartbeat file and its `.stacks` companion into SNAPSHOT_DIR (shutdown removes them) and
prints one JSON line with their modes.
With SECRETS_EXTRA_CASES naming a JSON file of generated cases ({"argv": [[...]], "tokens": [...]}), each argv
is also spawned on the sync paths (as argv and as a shell line, never run), the first few on the loop (exec,
and a shell really running `true` with the quoted words), and the tokens are given to executor items.
"""

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import stallwatch

snapshots, user, host, port, identity, http_port, sock_dir = sys.argv[1:]
logging.getLogger("stallwatch").setLevel(logging.DEBUG)
session = stallwatch.setup()
assert session.error is None, session.error

import nebius.sdk  # imported here: an import on the loop is Python code that blocks it
import uvloop
from dstack._internal.core.services.ssh import tunnel as tunnel_module
from nebius.aio.service_error import RequestError
from nebius.api.nebius.common.v1 import ResourceMetadata
from nebius.api.nebius.compute.v1 import (
    CreateInstanceRequest,
    DeleteInstanceRequest,
    GetInstanceRequest,
    InstanceServiceClient,
    InstanceSpec,
    ResourcesSpec,
)
from opentelemetry import trace

from secrets_corpus import (
    CORPUS,
    ENVIRONMENT,
    EXECUTOR_ARGS,
    NEBIUS_PAYLOAD,
    NEBIUS_TOKEN,
    SSH_OPTIONS,
    TOKENS,
    URLS,
)
from stallwatch.detect import heartbeat
from support.fake_nebius import FakeNebius, sdk_for
from support.ssh_tunnels import get_through, loopback_tunnel

tracer = trace.get_tracer("secrets-everywhere")
secret_env = {**os.environ, **ENVIRONMENT}
argv_lines = [[str(word) for word in argv] for argv, _, _ in CORPUS if all(isinstance(w, str) for w in argv)]
shell_lines = [
    " ".join(f"{name}={shlex.quote(value)}" for name, value in ENVIRONMENT.items()) + " true",
    "true " + " ".join(shlex.quote(url) for url, _ in URLS),
    *(argv[0] for argv in argv_lines if len(argv) == 1),  # command strings from the corpus
]
extra_path = os.environ.get("SECRETS_EXTRA_CASES")
extra = json.loads(Path(extra_path).read_text()) if extra_path else {"argv": [], "tokens": []}
result: dict[str, object] = {}


def spawn_everything() -> None:
    codes = []
    for argv in argv_lines:  # each corpus command line as argv of /bin/true: recorded, never really run
        codes.append(subprocess.run(argv, executable="/bin/true", env=secret_env).returncode)
    for line in shell_lines:
        codes.append(subprocess.run(line, shell=True, executable="/bin/true", env=secret_env).returncode)
    codes.append(subprocess.run(["curl", *(url for url, _ in URLS), *TOKENS], executable="/bin/true").returncode)
    pid = os.posix_spawn("/bin/true", ["curl", "-u", "admin:CurlPw-8830", URLS[0][0]], secret_env)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    result["sync_spawns"] = [len(codes), sorted(set(codes))]
    codes = []
    for argv in extra["argv"]:
        codes.append(subprocess.run(argv, executable="/bin/true", env=secret_env).returncode)
        codes.append(subprocess.run(shlex.join(argv), shell=True, executable="/bin/true").returncode)
    for argv in extra["argv"][:3]:
        pid = os.posix_spawn("/bin/true", argv, secret_env)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    result["extra_sync_spawns"] = [len(codes), sorted(set(codes))]


async def spawn_on_the_loop() -> None:
    codes = []
    for argv in argv_lines[:10]:
        proc = await asyncio.create_subprocess_exec(*argv, executable="/bin/true", env=secret_env)
        codes.append(await proc.wait())
    for line in shell_lines[:2]:
        proc = await asyncio.create_subprocess_shell(line, env=secret_env)
        codes.append(await proc.wait())
    result["loop_spawns"] = [len(codes), sorted(set(codes))]
    codes = []
    for argv in extra["argv"][:5]:
        proc = await asyncio.create_subprocess_exec(*argv, executable="/bin/true", env=secret_env)
        codes.append(await proc.wait())
    for argv in extra["argv"][:3]:
        proc = await asyncio.create_subprocess_shell("true " + shlex.join(argv[1:]), env=secret_env)
        codes.append(await proc.wait())
    result["extra_loop_spawns"] = [len(codes), sorted(set(codes))]


async def tunnel() -> None:
    sock = Path(sock_dir) / "http.sock"
    options = {**tunnel_module.SSH_DEFAULT_OPTIONS, **SSH_OPTIONS}
    tunnel = loopback_tunnel(user, host, port, identity, http_port, sock, options=options)
    await tunnel.aopen()
    result["tunnel_body"] = await get_through(sock)
    await tunnel.aclose()


async def nebius_calls() -> None:
    with FakeNebius() as fake:
        async with sdk_for(fake.address, credentials=NEBIUS_TOKEN) as sdk:
            instances = InstanceServiceClient(sdk)
            request = CreateInstanceRequest(
                metadata=ResourceMetadata(
                    name=NEBIUS_PAYLOAD["name"],
                    parent_id="project-e00test",
                    labels={"api_token": NEBIUS_PAYLOAD["label"]},
                ),
                spec=InstanceSpec(
                    resources=ResourcesSpec(platform="gpu-h200-sxm", preset="1gpu-16vcpu-200gb"),
                    cloud_init_user_data=NEBIUS_PAYLOAD["cloud_init"],
                ),
            )
            operation = await instances.create(request, timeout=5)
            await operation.wait(interval=0.02, timeout=5)
            await instances.get(GetInstanceRequest(id=operation.resource_id), timeout=5)
            with contextlib.suppress(RequestError):
                await instances.get(GetInstanceRequest(id="computeinstance-missing"), timeout=5)
            await instances.delete(DeleteInstanceRequest(id=operation.resource_id), timeout=5)
        result["nebius_token_sent"] = any(
            call.metadata.get("authorization") == f"Bearer {NEBIUS_TOKEN}" for call in fake.calls
        )


def work(*args: object, **kwargs: object) -> int:
    if kwargs.get("fail"):
        raise ValueError(f"refused {args}")
    return len(args) + len(kwargs)


async def executor_items() -> None:
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="secrets-pool")
    results: list[object] = [await asyncio.wrap_future(pool.submit(work, *EXECUTOR_ARGS, password=EXECUTOR_ARGS[0]))]
    failed = asyncio.wrap_future(pool.submit(work, *EXECUTOR_ARGS, fail=True))
    await asyncio.wait([failed])
    results.append(type(failed.exception()).__name__)  # retrieved: asyncio would log it, secrets and all
    await asyncio.to_thread(pool.shutdown)  # its thread exits while the loop runs on
    results.append(await loop.run_in_executor(None, work, *EXECUTOR_ARGS))
    results.append(await asyncio.to_thread(work, *EXECUTOR_ARGS, token=EXECUTOR_ARGS[1]))
    if extra["tokens"]:
        await loop.run_in_executor(None, work, *extra["tokens"])
    result["executor"] = results


async def main() -> None:
    with tracer.start_as_current_span("request"):  # a sampled parent: executor items get spans too
        await spawn_on_the_loop()
        await tunnel()
        await nebius_calls()
        await executor_items()
        proc = await asyncio.create_subprocess_shell(shell_lines[0], env=secret_env)  # the last spawn on the loop
        await proc.wait()
    assert await asyncio.to_thread(session.wait_for_watchdog, 30)
    time.sleep(0.8)  # block the loop: a freeze
    traces = session.files["traces"]
    deadline = time.monotonic() + 20
    while b'"stallwatch.freeze"' not in traces.read_bytes() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the watchdog exports the freeze's span at the thaw


with tracer.start_as_current_span("request"):
    spawn_everything()  # before the loop runs: a loop of sync calls is Python code that blocks it
uvloop.run(main())
files = {}
area = heartbeat.AREA
for path in (area.path, heartbeat.stacks_path(area.path)):
    if path.exists():
        files[path.suffix] = stat.S_IMODE(path.stat().st_mode)
        shutil.copyfile(path, Path(snapshots) / path.name)
result["heartbeat_files"] = files
stallwatch.shutdown(10)
print(json.dumps(result))
