"""The `stallwatch` command: `run`, `doctor`, `demo`, `postmortem` and `leaks`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import stallwatch

RUN_EXAMPLES = """\
examples:
  stallwatch run -- dstack server --port 3000
  stallwatch run -- uvicorn app:app --loop stallwatch:uvicorn_loop
  stallwatch run -m http.server 8000       (same as: stallwatch run -- python -m http.server 8000)
  STALLWATCH_PROVIDERS=host DSTACK_OTEL_TRACES_ENABLED=1 stallwatch run -- dstack server

The command runs as itself (exec): same argv, exit status and signals. Its Python process imports
stallwatch before anything else and runs setup() from the OTEL_* and STALLWATCH_* variables. Python
processes the command starts in turn do not load stallwatch; forked workers keep its session. A
command that cannot be found exits with status 127, one that cannot be executed with 126."""


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
    try:
        os.execvp(arguments[0], arguments)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            print(f"stallwatch run: {arguments[0]}: command not found", file=sys.stderr)
            return 127
        print(f"stallwatch run: {arguments[0]}: cannot execute: {error.strerror or error}", file=sys.stderr)
        return 126


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import Sandbox

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


def _postmortem(args: argparse.Namespace) -> int:
    from . import postmortem

    try:
        now = time.time_ns()
        since = postmortem.parse_time(args.since, now) if args.since else None
        until = postmortem.parse_time(args.until, now) if args.until else None
        directory = Path(args.dir) if args.dir else (None if args.files or args.journal else Path(args.default_dir))
        journal = Path(args.journal) if args.journal else None
        result = postmortem.timeline(
            directory, [Path(f) for f in args.files], since, until, journal, args.service, args.pid, args.all_processes
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
    from . import journal
    from .config import ConfigError, Settings

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
    parser = argparse.ArgumentParser(prog="stallwatch", description=stallwatch.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"stallwatch {stallwatch.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run",
        help="run a command with stallwatch started first in its Python process",
        description="Run COMMAND (a console script such as `dstack server`, or `python ...`) with stallwatch "
        "imported and set up before the command's own imports, as opentelemetry-instrument and ddtrace-run do.",
        usage="stallwatch run [-h] (-m MODULE [ARGS...] | -- COMMAND [ARGS...])",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module with this Python, as python -m")
    run.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    run.set_defaults(run=lambda args: _run(["-m", args.module, *args.command] if args.module else args.command))

    doctor = commands.add_parser(
        "doctor", help="report fork hazards; exit status 1 while one remains", description=stallwatch.doctor.__doc__
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import your server's module first, so the report covers what it registers (repeatable)",
    )
    doctor.add_argument(
        "--setup",
        action="store_true",
        help="run stallwatch.setup() from the environment first (journal, telemetry and heartbeat files in a "
        "temporary directory, removed at the end)",
    )
    doctor.add_argument("--no-probe", action="store_true", help="skip the test fork that counts thread starts")
    doctor.set_defaults(run=_doctor)

    demo = commands.add_parser("demo", help="run the incident-000 scenario locally and show what was recorded")
    demo.add_argument(
        "--out", default="stallwatch-demo", help="directory for the telemetry files (default: %(default)s)"
    )
    demo.add_argument("--probes", type=int, default=20, help="health probes to serve (default: %(default)s)")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.set_defaults(run=_demo)

    from .config import Settings

    post = commands.add_parser(
        "postmortem",
        help="print an incident timeline from the telemetry files",
        description="Freezes, spawns around them, SSH failures, Nebius calls and leak candidates, executor "
        "wedges and timeouts, in time order, from the file exporter's OTLP/JSON files or OTLP/JSON files "
        "exported from a trace backend.",
    )
    post.add_argument("--dir", help="the file exporter's directory (default: STALLWATCH_FILE_DIR's default)")
    post.add_argument(
        "--file", dest="files", action="append", default=[], metavar="FILE",
        help="an OTLP/JSON file (JSON lines or one document, e.g. exported from Tempo); repeatable",
    )  # fmt: skip
    post.add_argument(
        "--journal", help="a journal directory (STALLWATCH_JOURNAL_DIR): what dead processes left in flight"
    )
    post.add_argument("--service", help="the process group of this service.name (default: the newest host's)")
    post.add_argument("--pid", type=int, help="the process group of the host with this pid and its watchdog")
    post.add_argument(
        "--all-processes", action="store_true", help="every process in the inputs, not one host and its watchdog"
    )
    post.add_argument("--since", help="start of the window: ISO time or a duration back from now (90s, 15m, 2h)")
    post.add_argument("--until", help="end of the window, same forms as --since")
    post.add_argument("--format", choices=("text", "json", "html"), default="text", help="default: %(default)s")
    post.add_argument("--out", help="write the report to this file instead of standard output")
    post.set_defaults(run=_postmortem, default_dir=str(Settings().file_dir))

    leaks = commands.add_parser(
        "leaks",
        help="list the leak candidates (unconfirmed creates) of a journal directory, or confirm them",
        description="Creates a dead process asked the cloud for and never saw answered. Each stays open, and "
        "stallwatch.cloud.resources.unconfirmed (the UnconfirmedCloudResource alert) counts it, until it is "
        "confirmed: reconcile it against the cloud (find the resource by the time and trace id, adopt or "
        "delete it), then confirm its key.",
    )
    leaks.add_argument(
        "--journal-dir", help=f"the journal directory (default: STALLWATCH_JOURNAL_DIR, else {Settings().journal_dir})"
    )
    leaks.add_argument(
        "--confirm", nargs="+", metavar="KEY", help="close these candidates: they were reconciled against the cloud"
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
