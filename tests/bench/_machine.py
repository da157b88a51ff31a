"""What the benchmarks share: the machine description written next to every result, and a clean
environment for the fresh interpreters they start."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
if str(TESTS) not in sys.path:  # the benchmarks share the tests' `support` package (the fake Nebius server)
    sys.path.append(str(TESTS))


def raw_path(out: Path, name: str) -> Path:
    """Where a benchmark writes its raw numbers: `raw/NAME` under its output directory.

    Only the Markdown summaries are committed; git ignores `tests/bench/results/raw/`."""
    (out / "raw").mkdir(parents=True, exist_ok=True)
    return out / "raw" / name


def clean_env() -> dict[str, str]:
    """This environment without OTEL_/STALLWATCH_/GRPC_ variables, so every worker starts alike; the
    tests' `support` package importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STALLWATCH_", "GRPC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def machine_info(versioned: tuple[str, ...]) -> dict[str, Any]:
    """Where and with what a benchmark ran: for the results file."""
    versions = {}
    for name in versioned:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "kernel": platform.release(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=HERE,
        ).stdout.strip(),
        "git_dirty": bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", ":/src"],
                capture_output=True,
                text=True,
                check=False,
                cwd=HERE,
            ).stdout.strip()
        ),
        "versions": versions,
    }
