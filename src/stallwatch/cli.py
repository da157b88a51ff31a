"""The `stallwatch` command: `doctor` and `demo`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import stallwatch


def _doctor(args: argparse.Namespace) -> int:
    for module in args.imports:
        importlib.import_module(module)
    if args.setup:
        stallwatch.setup()
    report = stallwatch.doctor(probe=not args.no_probe)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_text())
    return 0 if report.ok else 1


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    result = demo.run(Path(args.out), probes=args.probes)
    print(demo.to_json(result) if args.json else demo.format_text(result))
    healthy = (
        result.probes_answered == args.probes
        and result.stallwatch_thread_starts_per_child == 0
        and result.forked_worker_span_exported
    )
    return 0 if healthy else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallwatch", description=stallwatch.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"stallwatch {stallwatch.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

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
    doctor.add_argument("--setup", action="store_true", help="run stallwatch.setup() from the environment first")
    doctor.add_argument("--no-probe", action="store_true", help="skip the test fork that counts thread starts")
    doctor.set_defaults(run=_doctor)

    demo = commands.add_parser("demo", help="run the incident-000 scenario locally and show what was recorded")
    demo.add_argument(
        "--out", default="stallwatch-demo", help="directory for the telemetry files (default: %(default)s)"
    )
    demo.add_argument("--probes", type=int, default=20, help="health probes to serve (default: %(default)s)")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "probes", 1) < 1:
        build_parser().error("--probes must be at least 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
