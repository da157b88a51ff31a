"""The `stallwatch` command: `run`, `doctor`, `demo`, `postmortem` and `leaks`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import stallwatch

from . import journal
from .checkup import Sandbox
from .config import ConfigError, Settings

OVERVIEW = """\
Keep an async Python server from freezing silently or wedging unseen: start stallwatch in it,
check it for fork hazards, replay both incidents stallwatch is built around, and read what it
recorded after an incident.

examples:
  stallwatch run -- uvicorn app:app --loop asyncio   start your server with stallwatch set up first
  stallwatch doctor --import myserver.app            check your server for fork hazards
  stallwatch demo                                    replay both incidents (a freeze, a wedge) here
  stallwatch postmortem --since 2h                   the incident timeline of the last two hours
  stallwatch leaks                                   cloud resources a killed server may have leaked

Settings come from OTEL_* and STALLWATCH_* variables. `stallwatch COMMAND --help` says more."""

RUN_DESCRIPTION = """\
Run COMMAND (a console script such as `dstack server` or `uvicorn`, or `python ...`) with
stallwatch imported and set up before any of the command's own imports, without changing its
code, as opentelemetry-instrument and ddtrace-run do. Settings come from the OTEL_* and
STALLWATCH_* variables, e.g. OTEL_SERVICE_NAME and OTEL_EXPORTER_OTLP_ENDPOINT."""

RUN_EXAMPLES = """\
examples:
  stallwatch run -- dstack server --port 3000
  stallwatch run -- uvicorn app:app --loop asyncio
  stallwatch run -m http.server 8000       (same as: stallwatch run -- python -m http.server 8000)
  OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318 stallwatch run -- python worker.py
  STALLWATCH_PROVIDERS=host DSTACK_OTEL_TRACES_ENABLED=1 stallwatch run -- dstack server

The command runs as itself (exec): same argv, exit status and signals. COMMAND is looked up on
PATH, then beside this Python (the environment stallwatch is installed in, as `venv/bin/stallwatch
run -- dstack server` expects). Other Python programs the command starts do not load stallwatch;
its workers do: forked ones keep its session, and the fresh interpreters multiprocessing starts
(`uvicorn --workers`, spawn and forkserver pools) import stallwatch.auto first. A command that
cannot be found exits with status 127, one that cannot be executed with 126."""

DOCTOR_DESCRIPTION = """\
Check this machine, and your server when you name its module, for the fork hazards behind the
freeze incident. The report lists the installed versions, the event loop uvicorn would pick,
gRPC's fork state and GRPC_* variables, every at-fork handler with the threads it starts in a
real test child, Sentry's fork safety, whether the journal directory is usable and whether the
freeze watchdog runs, then a verdict with what to change. Nothing of the servers already running
on the machine is touched."""

DOCTOR_EXAMPLES = """\
examples:
  stallwatch doctor                                   this machine and its installed packages
  stallwatch doctor --import myserver.app             also what your server's module registers
  stallwatch doctor --import myserver.app --setup     also with stallwatch set up as your server runs it
  stallwatch doctor --json > doctor.json              for a script or a ticket

exit status: 0 when no fork hazard remains, 1 while one does, 2 when an --import fails."""

DEMO_DESCRIPTION = """\
Replay both incidents stallwatch is built around, on this machine and on local files (no
collector or cloud account needed; about 15 s), and show what stallwatch recorded:
  1. health probes spawn children on a uvloop server: no thread starts in the children;
  2. a spawn held before exec freezes a host, and the watchdog reports it while it is frozen;
  3. a Nebius create (against a fake server) is in flight when the host is killed: a leak candidate;
  4. a stale SystemExit is aimed at an executor worker: refused, then (guard off) the dead worker
     is found and the stranded request healed;
  5. `stallwatch postmortem` runs over all of it and writes postmortem.html into the output
     directory."""

DEMO_EXAMPLES = """\
examples:
  stallwatch demo                          files and report in ./stallwatch-demo
  stallwatch demo --out /tmp/sw-demo       elsewhere
  stallwatch demo --json                   the summary as JSON

exit status: 0 when every stage showed what it should, 1 when one did not, 2 when the output
directory cannot be created."""

POSTMORTEM_DESCRIPTION = """\
Turn what stallwatch exported into an incident timeline: first what happened (freezes with their
cause and the spawn that froze, executor wedges), then in time order the notable spawns, SSH
failures, Nebius calls, wedges and timeouts, each with its trace id, the span trees of each
freeze, wedge or leak, and the leak candidates. Reads the file exporter's directory, or OTLP/JSON
files exported from a trace backend such as Tempo. When several servers share a directory, the
report covers the newest one and its watchdog unless --service, --pid or --all-processes says
otherwise."""

POSTMORTEM_EXAMPLES = """\
examples:
  stallwatch postmortem                                       the default telemetry directory
  stallwatch postmortem ./telemetry                           a directory the file exporter wrote
  stallwatch postmortem --dir /var/lib/app/telemetry --since 2h
  stallwatch postmortem --file tempo-trace.json --format html --out incident.html
  stallwatch postmortem --journal ~/.local/state/stallwatch/journal   what dead processes left open
  stallwatch postmortem --service control-plane --since 2026-12-06T07:00 --until 2026-12-06T08:00

exit status: 0 with a report, 2 when an input is missing or unreadable or --out cannot be written."""

LEAKS_DESCRIPTION = """\
List the leak candidates of a journal directory: cloud resources (Nebius creates) that a server
asked for and died before it saw the answer, so the cloud may hold resources nothing tracks.
Each stays open, counted by stallwatch.cloud.resources.unconfirmed (the UnconfirmedCloudResource
alert), until you confirm it: find the resource in the cloud by its time and trace id, adopt or
delete it, then confirm its key."""

LEAKS_EXAMPLES = """\
examples:
  stallwatch leaks                                     list the candidates, one line each with its KEY
  stallwatch leaks --journal-dir /var/lib/app/journal  another server's journal directory
  stallwatch leaks --confirm KEY                       close a candidate once reconciled

exit status: 0, or 2 when a key to confirm is unknown or the journal setting is invalid."""


def _run(arguments: list[str]) -> int:
    """Exec the command with the bootstrap first on its PYTHONPATH; returns only when the exec failed."""
    if arguments[:1] == ["--"]:
        arguments = arguments[1:]
    elif arguments[:1] == ["-m"]:
        arguments = [sys.executable, *arguments]
    if not arguments or arguments == [sys.executable, "-m"]:
        print("usage: stallwatch run (-m MODULE [ARGS...] | -- COMMAND [ARGS...]); see stallwatch run --help",
              file=sys.stderr)  # fmt: skip
        return 2
    saved = os.environ.get("PYTHONPATH")
    os.environ["STALLWATCH_RUN_PYTHONPATH"] = saved or ""  # restored by the bootstrap
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).with_name("_bootstrap")), *([saved] if saved else [])]
    )
    program = arguments[0]
    if os.sep not in program and shutil.which(program) is None:
        beside = Path(sys.executable).with_name(program)  # the console scripts of stallwatch's own environment
        if os.access(beside, os.X_OK) and beside.is_file():
            program = str(beside)
    try:
        os.execvp(program, arguments)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            print(f"stallwatch run: {arguments[0]}: command not found", file=sys.stderr)
            return 127
        print(f"stallwatch run: {arguments[0]}: cannot execute: {error.strerror or error}", file=sys.stderr)
        return 126


def _doctor(args: argparse.Namespace) -> int:
    with Sandbox() as sandbox:  # the doctor's setup() and the imported modules' leave the host's files alone
        if args.imports and not {"", ".", os.getcwd()} & set(sys.path):
            sys.path.insert(0, os.getcwd())  # as `python -m` and uvicorn (`--app-dir .`) find the app
        for module in args.imports:
            try:
                importlib.import_module(module)
            except Exception as error:
                if not (isinstance(error, ModuleNotFoundError) and error.name == module):
                    traceback.print_exc()  # the module itself failed: its traceback is what to fix
                print(f"stallwatch doctor: --import {module} failed: {type(error).__name__}: {error}", file=sys.stderr)
                return 2
        if args.setup:
            stallwatch.setup()
        report = stallwatch.doctor(probe=not args.no_probe, journal=sandbox.host_journal())
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text())
    return 0 if report.ok else 1


def _demo(args: argparse.Namespace) -> int:
    # footprint: loaded only by the command that runs it
    from . import demo

    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"stallwatch demo: --out {args.out} cannot be created: {error.strerror or error}", file=sys.stderr)
        return 2
    started = time.monotonic()
    result = demo.run(
        Path(args.out),
        probes=args.probes,
        progress=lambda line: print(f"{line} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True),
    )
    print(demo.to_json(result) if args.json else demo.format_text(result))
    return 0 if demo.healthy(result, args.probes) else 1


def _postmortem_paths(args: argparse.Namespace) -> tuple[Path | None, list[Path]]:
    """The telemetry directory and the files to read: `--dir` and `--file`, and each PATH given as it
    is, a directory as `--dir` and anything else as `--file`. One directory at most."""
    # footprint: loaded only by the command that runs it
    from .postmortem import InputError

    directories = [Path(args.dir)] if args.dir else []
    files = [Path(f) for f in args.files]
    for path in map(Path, args.paths):
        (directories if path.is_dir() else files).append(path)
    if len(directories) > 1:
        raise InputError(f"one telemetry directory at a time, not {' and '.join(map(str, directories))}")
    return (directories[0] if directories else None), files


def _postmortem(args: argparse.Namespace) -> int:
    # footprint: loaded only by the command that runs it
    from . import postmortem

    try:
        now = time.time_ns()
        since = postmortem.parse_time(args.since, now) if args.since else None
        until = postmortem.parse_time(args.until, now) if args.until else None
        named_dir, files = _postmortem_paths(args)
        directory = named_dir or (None if files or args.journal else Path(args.default_dir))
        journal = Path(args.journal) if args.journal else None
        result = postmortem.timeline(
            directory, files, since, until, journal, args.service, args.pid, args.all_processes
        )
    except postmortem.InputError as error:
        print(f"stallwatch postmortem: {error}", file=sys.stderr)
        return 2
    render = {"text": postmortem.format_text, "json": postmortem.format_json, "html": postmortem.format_html}
    output = render[args.format](result)
    if args.out:
        try:
            postmortem.write_report(Path(args.out), output)
        except OSError as error:
            print(f"stallwatch postmortem: cannot write {args.out}: {error.strerror or error}", file=sys.stderr)
            return 2
        print(f"stallwatch postmortem: {len(result.events)} events; report written to {args.out}")
    else:
        sys.stdout.write(output)
    return 0


def _leaks(args: argparse.Namespace) -> int:

    try:
        directory = Path(args.journal_dir) if args.journal_dir else Settings.load().journal_dir
    except ConfigError as error:
        print(f"stallwatch leaks: {error}; or pass --journal-dir", file=sys.stderr)
        return 2
    if args.confirm:
        unknown = [key for key in args.confirm if not journal.confirm(directory, key)]
        for key in args.confirm:
            if key not in unknown:
                print(f"confirmed {key}")
        for key in unknown:
            print(f"stallwatch leaks: no leak candidate {key!r} in {directory}", file=sys.stderr)
        return 2 if unknown else 0
    found = journal.candidates(directory)
    if not found:
        print(f"no leak candidates in {directory}")
    for candidate in found:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(candidate.intent_ns / 1e9))
        resource = f" resource {candidate.resource_id}" if candidate.resource_id else ""
        print(
            f"{candidate.key}  {when}  create {candidate.resource_type} ({candidate.rpc}){resource}  "
            f"trace {candidate.trace_id} span {candidate.span_id}  pid {candidate.pid}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="stallwatch", description=OVERVIEW, formatter_class=raw)
    parser.add_argument("--version", action="version", version=f"stallwatch {stallwatch.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="start a command (your server) with stallwatch set up first in its Python process",
        description=RUN_DESCRIPTION,
        usage="stallwatch run [-h] (-m MODULE [ARGS...] | -- COMMAND [ARGS...])",
        epilog=RUN_EXAMPLES,
        formatter_class=raw,
    )
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a Python module, as python -m MODULE does")
    run.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    run.set_defaults(run=lambda args: _run(["-m", args.module, *args.command] if args.module else args.command))

    doctor = commands.add_parser(
        "doctor",
        help="check this machine and your server for fork hazards; exit status 1 while one remains",
        description=DOCTOR_DESCRIPTION,
        epilog=DOCTOR_EXAMPLES,
        formatter_class=raw,
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import your server's module first (found from the current directory, as uvicorn finds it), so "
        "the report covers the handlers and threads it adds; repeatable",
    )
    doctor.add_argument(
        "--setup",
        action="store_true",
        help="set stallwatch up from the OTEL_* and STALLWATCH_* variables first, as your server would; its "
        "files go to a temporary directory removed at the end",
    )
    doctor.add_argument(
        "--no-probe",
        action="store_true",
        help="do not fork a test child to count the threads each at-fork handler starts (quicker, less precise)",
    )
    doctor.set_defaults(run=_doctor)

    demo = commands.add_parser(
        "demo",
        help="replay both incidents (a freeze and a wedge) on this machine and show what was recorded",
        description=DEMO_DESCRIPTION,
        epilog=DEMO_EXAMPLES,
        formatter_class=raw,
    )
    demo.add_argument(
        "--out",
        default="stallwatch-demo",
        metavar="DIR",
        help="directory for the telemetry files and the report, created if missing (default: %(default)s)",
    )
    demo.add_argument(
        "--probes",
        type=int,
        default=20,
        metavar="N",
        help="health probes the demo server answers in stage 1, each spawning a child (default: %(default)s)",
    )
    demo.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    demo.set_defaults(run=_demo)

    post = commands.add_parser(
        "postmortem",
        help="print the incident timeline of what stallwatch recorded",
        description=POSTMORTEM_DESCRIPTION,
        epilog=POSTMORTEM_EXAMPLES,
        formatter_class=raw,
    )
    post.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="a telemetry directory (as --dir) or an OTLP/JSON file (as --file)",
    )
    post.add_argument(
        "--dir",
        metavar="DIR",
        help=f"the telemetry directory your server wrote (STALLWATCH_FILE_DIR; default: {Settings().file_dir})",
    )
    post.add_argument(
        "--file", dest="files", action="append", default=[], metavar="FILE",
        help="an OTLP/JSON file, as JSON lines or one document (e.g. a trace exported from Tempo); repeatable",
    )  # fmt: skip
    post.add_argument(
        "--journal",
        metavar="DIR",
        help="also read this journal directory (STALLWATCH_JOURNAL_DIR) as it is, without replaying it: what "
        "dead processes left open, their unconfirmed creates and the watchdog's freeze records",
    )
    post.add_argument("--service", metavar="NAME", help="report on the server with this OTEL_SERVICE_NAME")
    post.add_argument("--pid", type=int, metavar="PID", help="report on the server with this process id")
    post.add_argument("--all-processes", action="store_true", help="report on every process in the inputs together")
    post.add_argument(
        "--since",
        metavar="WHEN",
        help="start of the window: an ISO time (UTC unless it names a zone), or a duration back from now "
        "(90s, 15m, 2h, 1d)",
    )
    post.add_argument("--until", metavar="WHEN", help="end of the window, in the same forms as --since")
    post.add_argument(
        "--format",
        choices=("text", "json", "html"),
        default="text",
        help="text (default) or json carry the same facts; html is one offline file with an SVG timeline, for --out",
    )
    post.add_argument("--out", metavar="FILE", help="write the report to FILE (mode 0600) instead of the terminal")
    post.set_defaults(run=_postmortem, default_dir=str(Settings().file_dir))

    leaks = commands.add_parser(
        "leaks",
        help="list the cloud resources killed servers may have leaked, or confirm them once reconciled",
        description=LEAKS_DESCRIPTION,
        epilog=LEAKS_EXAMPLES,
        formatter_class=raw,
    )
    leaks.add_argument(
        "--journal-dir",
        metavar="DIR",
        help=f"the journal directory (default: STALLWATCH_JOURNAL_DIR, else {Settings().journal_dir})",
    )
    leaks.add_argument(
        "--confirm", nargs="+", metavar="KEY", help="close these candidates: each was reconciled against the cloud"
    )
    leaks.set_defaults(run=_leaks)
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["run"] and arguments[1:2] not in ([], ["-h"], ["--help"]):
        return _run(arguments[1:])  # the command's own options are never ours
    args = build_parser().parse_args(argv)
    if getattr(args, "probes", 1) < 1:
        build_parser().error("--probes must be at least 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
