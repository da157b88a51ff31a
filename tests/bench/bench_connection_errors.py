"""Connection errors under a burst: 300 concurrent requests against a fresh uvicorn, with and without stallwatch.

Run from the repository root (about fifteen minutes; one load at a time on a shared machine)::

    nice -n 19 .venvs/main/bin/python tests/bench/bench_connection_errors.py

Options: ``--runs N`` runs per arm (default 50), ``--requests R`` concurrent requests per run
(default 300), ``--arms`` (default ``with,with-fork,without``), ``--stallwatch-src DIR`` (the
stallwatch arms import stallwatch from DIR, e.g. an older commit's ``src``, for a before/after),
``--mix spawn-read`` (every request reads a file in the thread pool or spawns ``uname``, the
two endpoints that open descriptors, instead of all six in turn), ``--quick`` (3 runs per arm,
summary in a temporary directory), ``--out DIR`` (default ``tests/bench/results``). Writes
``connection_errors.md``, keeping a hand-written section from its ``## Findings`` heading on; the
raw per-run records go to a ``.jsonl`` in a temporary directory, named in the summary, and are not
committed.

Each run starts a fresh ``uvicorn app:app --loop uvloop`` on a free loopback port, from a directory
holding the app a new user would write (FastAPI: a JSON endpoint, a path parameter, a POST, a sync
endpoint that reads a file in the thread pool, one that hashes in the default executor and one that
runs ``uname`` with asyncio). The stallwatch arms' app is the same file with ``import stallwatch.auto``
as its first line, at default settings (``with``: uvloop spawns by vfork) or with
``STALLWATCH_UVLOOP_SPAWN=fork`` (``with-fork``: uvloop's own fork), its state directory in a
temporary ``XDG_STATE_HOME``. The arms alternate.

As soon as uvicorn logs that it listens, an ``httpx.AsyncClient()`` (default limits and timeouts)
sends the burst, every request tagged ``?n=<index>``. Then uvicorn gets SIGINT and its access log
(stdout) is read: for each failed request, whether its tag reached the log; its stderr is searched
for errors naming a bad file descriptor. Around each burst the kernel's TcpExt counters
(``/proc/net/netstat``: listen overflows and drops, aborts) are read, so an accept-queue overflow or
a reset the server sent shows. They are machine-wide: other loads on the machine count too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _machine import clean_env, machine_info

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
VERSIONED = ("uvicorn", "uvloop", "fastapi", "starlette", "httpx", "httpcore", "anyio", "h11", "stallwatch")
NETSTAT_COUNTERS = (
    "ListenOverflows",
    "ListenDrops",
    "TCPBacklogDrop",
    "TCPReqQFullDrop",
    "TCPAbortOnData",
    "TCPAbortOnClose",
    "TCPAbortOnTimeout",
    "TCPAbortFailed",
)
ARMS: dict[str, dict[str, str]] = {  # arm: its stallwatch settings ("without": the app without the import)
    "with": {},
    "with-fork": {"STALLWATCH_UVLOOP_SPAWN": "fork"},
    "without": {},
}
MIXES = {  # which endpoints the requests of a burst go to, in turn
    "all": ("root", "item", "create", "report", "digest", "version"),
    "spawn-read": ("report", "version"),  # only the two endpoints that open descriptors
}
FINDINGS = "## Findings"  # a hand-written section from this heading on is kept when the summary is rewritten
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0

APP = """\
import asyncio
import hashlib
import json
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI()


class Item(BaseModel):
    name: str
    quantity: int = 1


@app.get("/")
async def root() -> dict:
    return {"status": "ok"}


@app.get("/items/{item_id}")
async def read_item(item_id: int) -> dict:
    return {"item_id": item_id, "name": f"item-{item_id}"}


@app.post("/items")
async def create_item(item: Item) -> dict:
    return {"created": item.name, "quantity": item.quantity}


@app.get("/report")
def report() -> dict:
    # Blocking file I/O: FastAPI runs this endpoint in its thread pool.
    rows = json.loads((Path(__file__).parent / "rows.json").read_text())
    return {"rows": len(rows)}


@app.get("/digest")
async def digest() -> dict:
    loop = asyncio.get_running_loop()
    value = await loop.run_in_executor(None, lambda: hashlib.sha256(b"x" * 200_000).hexdigest())
    return {"sha256": value}


@app.get("/version")
async def version() -> dict:
    process = await asyncio.create_subprocess_exec(
        "uname", "-r", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    return {"kernel": out.decode().strip(), "returncode": process.returncode}
"""

ACCESS_LINE = re.compile(r'"(GET|POST) (\S+) HTTP/1\.1" (\d+)')
TAG = re.compile(r"[?&]n=(\d+)")


def netstat() -> dict[str, int]:
    """The TcpExt counters of this network namespace."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return {
                k: int(v) for k, v in zip(names.split()[1:], values.split()[1:], strict=True) if k in NETSTAT_COUNTERS
            }
    return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_apps(root: Path) -> dict[str, Path]:
    dirs = {"with": root / "with", "without": root / "without"}
    for arm, directory in dirs.items():
        directory.mkdir()
        (directory / "app.py").write_text(("import stallwatch.auto\n" if arm == "with" else "") + APP)
        (directory / "rows.json").write_text(json.dumps([{"id": i, "name": f"row-{i}"} for i in range(100)]))
    return dirs


def request_for(n: int, mix: str) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, json body) of request number n: the mix's endpoints in turn."""
    kind = MIXES[mix][n % len(MIXES[mix])]
    if kind == "root":
        return "GET", f"/?n={n}", None
    if kind == "item":
        return "GET", f"/items/{n}?n={n}", None
    if kind == "create":
        return "POST", f"/items?n={n}", {"name": f"thing-{n}", "quantity": n}
    if kind == "report":
        return "GET", f"/report?n={n}", None
    if kind == "digest":
        return "GET", f"/digest?n={n}", None
    return "GET", f"/version?n={n}", None


def describe(exc: BaseException) -> str:
    """The exception and its causes, outermost first: `ReadError<-BrokenResourceError<-ConnectionResetError`."""
    names = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names.append(type(current).__name__)
        current = current.__cause__ or current.__context__
    return "<-".join(names)


async def burst(port: int, count: int, mix: str) -> list[dict[str, Any]]:
    import httpx

    results: list[dict[str, Any]] = [{} for _ in range(count)]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

        async def one(n: int) -> None:
            method, path, body = request_for(n, mix)
            start = time.monotonic()
            try:
                response = await client.request(method, path, json=body)
                results[n] = {"n": n, "path": path.split("?")[0], "status": response.status_code}
            except Exception as exc:
                results[n] = {"n": n, "path": path.split("?")[0], "error": describe(exc), "message": str(exc)[:200]}
            results[n]["seconds"] = round(time.monotonic() - start, 4)

        await asyncio.gather(*(one(n) for n in range(count)))
    return results


def start_server(
    directory: Path, port: int, env: dict[str, str]
) -> tuple[subprocess.Popen[str], list[str], threading.Event]:
    """uvicorn, started as a user would; returns it, its stderr lines so far (kept filling) and an
    event set once it listens."""
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app:app", "--loop", "uvloop", "--host", "127.0.0.1", "--port", str(port)],
        cwd=directory,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    listening = threading.Event()

    def read_stderr() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            lines.append(line)
            if "Uvicorn running on" in line:
                listening.set()
        listening.set()  # exited: the caller sees it from poll()

    threading.Thread(target=read_stderr, daemon=True).start()
    return server, lines, listening


def one_run(arm: str, directory: Path, env: dict[str, str], count: int, mix: str) -> dict[str, Any]:
    port = free_port()
    server, stderr_lines, listening = start_server(directory, port, env)
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.extend(server.stdout or ()), daemon=True)
    reader.start()
    record: dict[str, Any] = {"arm": arm, "port": port, "pid": server.pid}
    try:
        if not listening.wait(READY_TIMEOUT) or server.poll() is not None:
            record["startup_failed"] = "".join(stderr_lines)[-2000:]
            return record
        before = netstat()
        started = time.monotonic()
        results = asyncio.run(burst(port, count, mix))
        record["burst_seconds"] = round(time.monotonic() - started, 3)
        after = netstat()
        record["netstat"] = {k: after.get(k, 0) - before.get(k, 0) for k in NETSTAT_COUNTERS}
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            server.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(STOP_TIMEOUT)
    logged: dict[int, int] = {}
    for line in stdout:
        access = ACCESS_LINE.search(line)
        tag = TAG.search(access.group(2)) if access else None
        if access and tag:
            logged[int(tag.group(1))] = int(access.group(3))
    failed = [r for r in results if "error" in r or r.get("status") != 200]
    for r in failed:
        r["in_access_log"] = r["n"] in logged
    record.update(
        returncode=server.returncode,
        ok=sum(1 for r in results if r.get("status") == 200),
        failed=failed,
        access_log_lines=len(logged),
        server_errors=[line for line in stderr_lines if "Traceback" in line or "ERROR" in line or "Exception" in line],
        bad_fd_errors=sum("Bad file descriptor" in line for line in stderr_lines),
        stderr_tail="".join(stderr_lines)[-3000:] if failed else "",
    )
    return record


def summarize(
    records: list[dict[str, Any]],
    arms: list[str],
    options: argparse.Namespace,
    info: dict[str, Any],
    raw: Path,
    wall: float,
) -> str:
    rows = []
    errors: dict[str, collections.Counter[str]] = {arm: collections.Counter() for arm in arms}
    for arm in arms:
        mine = [r for r in records if r["arm"] == arm]
        ran = [r for r in mine if "failed" in r]
        failures = [f for r in ran for f in r["failed"]]
        for f in failures:
            errors[arm][f.get("error", f"HTTP {f.get('status')}")] += 1
        resets = [
            f for f in failures if f.get("error", "").startswith(("ReadError", "WriteError", "RemoteProtocolError"))
        ]
        overflow_runs = sum(1 for r in ran if r["netstat"]["ListenOverflows"] or r["netstat"]["ListenDrops"])
        aborts = sum(r["netstat"]["TCPAbortOnData"] + r["netstat"]["TCPAbortOnClose"] for r in ran)
        bad_fd = sum(r["bad_fd_errors"] for r in ran)
        bursts = sorted(r["burst_seconds"] for r in ran) or [0.0]
        rows.append(
            f"| {arm} | {len(ran)} | {len(mine) - len(ran)} | {sum(1 for r in ran if r['failed'])} | {len(failures)} | "
            f"{len(resets)} ({sum(1 for r in ran if any(f in resets for f in r['failed']))}) | "
            f"{sum(1 for f in failures if f['in_access_log'])} | {bad_fd} | {overflow_runs} | {aborts} | "
            f"{bursts[len(bursts) // 2]:.2f} / {bursts[-1]:.2f} |"
        )
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    source = f"stallwatch from `{options.stallwatch_src}`" if options.stallwatch_src else "stallwatch from this tree"
    lines = [
        "# Connection errors under a burst of concurrent requests, with and without stallwatch",
        "",
        f"Generated by `nice -n 19 .venvs/main/bin/python tests/bench/bench_connection_errors.py"
        f"{' --arms ' + ','.join(arms) if arms != list(ARMS) else ''}"
        f"{' --mix ' + options.mix if options.mix != 'all' else ''}` ({source}). Machine: "
        f"{info['nproc']} CPUs, Python {info['python']}, kernel {info['kernel']}; {versions}; commit "
        f"{info['git_commit']}{' (src dirty)' if info['git_dirty'] else ''}; {info['date']}; {wall / 60:.0f} min.",
        "",
        f"Each run: a fresh `uvicorn app:app --loop uvloop`, then {options.requests} concurrent requests from one "
        "`httpx.AsyncClient()` (defaults: 100 connections, 5 s timeouts) sent as soon as uvicorn listens. "
        f"Arms interleaved ({', '.join(arms)}, ...). Raw per-run records (not committed): `{raw}`.",
        "",
        "| arm | runs | runs not started | runs with a failed request | failed requests | of them connection "
        "errors (runs) | of them in the access log | server errors naming a bad file descriptor | runs with "
        "listen overflows/drops | TCP aborts (on data/close) | burst s p50 / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Failed requests by error (the exception and its causes, outermost first):",
        "",
    ]
    for arm in arms:
        listed = ", ".join(f"`{name}` {n}" for name, n in errors[arm].most_common()) or "none"
        lines.append(f"- {arm}: {listed}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--stallwatch-src", type=Path, help="run the stallwatch arms with this source tree")
    parser.add_argument("--mix", choices=MIXES, default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    options = parser.parse_args()
    arms = options.arms.split(",")
    if set(arms) - set(ARMS):
        parser.error(f"unknown arm in {options.arms}")
    runs = 3 if options.quick else options.runs
    info = machine_info(VERSIONED)
    work = Path(tempfile.mkdtemp(prefix="stallwatch-connerr-"))
    dirs = write_apps(work)
    env = clean_env()
    env["XDG_STATE_HOME"] = str(work / "state")
    env["PYTHONUNBUFFERED"] = "1"  # the access log reaches the pipe line by line
    raw = work / "connection_errors.jsonl"
    records = []
    started = time.monotonic()
    with raw.open("w") as out:
        for index in range(runs):
            for arm in arms:
                arm_env = {**env, **ARMS[arm]}
                if options.stallwatch_src and arm != "without":
                    arm_env["PYTHONPATH"] = str(options.stallwatch_src.resolve())
                directory = dirs["without" if arm == "without" else "with"]
                record = one_run(arm, directory, arm_env, options.requests, options.mix)
                record["index"] = index
                records.append(record)
                out.write(json.dumps(record) + "\n")
                out.flush()
                failed = record.get("failed", [])
                print(
                    f"{index:3d} {arm:10s} ok={record.get('ok')} failed={len(failed)} "
                    f"errors={dict(collections.Counter(f.get('error', f.get('status')) for f in failed))} "
                    f"bad_fd={record.get('bad_fd_errors')} "
                    f"netstat={ {k: v for k, v in record.get('netstat', {}).items() if v} }",
                    flush=True,
                )
    summary = summarize(records, arms, options, info, raw, time.monotonic() - started)
    target = (work if options.quick else options.out) / "connection_errors.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    kept = ""
    if target.exists() and FINDINGS in target.read_text():
        kept = "\n" + target.read_text()[target.read_text().index(FINDINGS) :]
    target.write_text(summary + kept)
    print(summary)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
