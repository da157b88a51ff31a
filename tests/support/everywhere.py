"""Runs tests/scenarios/secrets_everywhere.py (every instrumentation, with secrets) and gathers everything
stallwatch wrote: the file exporters' output, the journal, the heartbeat file and its companions, the OTLP
receiver's payloads, stdout and stderr."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import SCENARIOS, clean_env
from secrets_corpus import SSH_IDENTITY_DIR, SSH_IDENTITY_NAME

TESTS = Path(__file__).parent.parent


@dataclass
class Run:
    proc: subprocess.CompletedProcess[bytes]
    result: dict[str, Any]  # the scenario's last stdout line
    state: Path  # XDG_STATE_HOME: stallwatch/{telemetry,journal}
    outputs: dict[str, bytes]  # everything stallwatch wrote, by where


def run_everywhere(sshd: Any, http_server: Any, receiver: Any, work: Path, extra: dict[str, Any] | None = None) -> Run:
    """Run the scenario in `work` (a fresh directory), with `extra` generated cases if given."""
    state, snapshots, runtime = work / "state", work / "snapshots", work / "runtime"
    snapshots.mkdir(parents=True)
    runtime.mkdir(mode=0o700)
    key = work / SSH_IDENTITY_DIR / SSH_IDENTITY_NAME  # a key whose path is a secret too
    key.parent.mkdir()
    shutil.copyfile(sshd.identity, key)
    key.chmod(0o600)
    env = clean_env(
        XDG_STATE_HOME=str(state),  # stallwatch creates state/stallwatch/{telemetry,journal}
        XDG_RUNTIME_DIR=str(runtime),  # the heartbeat file and its companions
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_TRACES_EXPORTER="otlp,file",
        OTEL_METRICS_EXPORTER="otlp,file",
        OTEL_LOGS_EXPORTER="otlp,file",
        OTEL_METRIC_EXPORT_INTERVAL="3600000",
        STALLWATCH_RECORD_ARGS="true",
        STALLWATCH_PROPAGATE_TO_CHILDREN="true",
        STALLWATCH_LOG_LEVEL="DEBUG",
        STALLWATCH_FREEZE_THRESHOLD="0.3",
        STALLWATCH_FAULTHANDLER="true",
    )
    del env["STALLWATCH_JOURNAL_DIR"], env["STALLWATCH_FILE_DIR"]  # the defaults, under XDG_STATE_HOME
    if extra is not None:
        cases = work / "cases.json"
        cases.write_text(json.dumps(extra))
        env["SECRETS_EXTRA_CASES"] = str(cases)
    first_request = len(receiver.requests)
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:  # short: unix socket paths are limited
        proc = subprocess.run(
            [sys.executable, str(SCENARIOS / "secrets_everywhere.py"), str(snapshots), sshd.user, sshd.host,
             str(sshd.port), str(key), str(http_server), sock_dir],
            env=env, capture_output=True, timeout=180,
        )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr.decode(errors='replace')}"
    result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    outputs = {path.relative_to(work).as_posix(): path.read_bytes() for path in state.rglob("*") if path.is_file()}
    outputs |= {f"snapshot {path.name}": path.read_bytes() for path in snapshots.iterdir()}
    requests = list(receiver.requests)[first_request:]
    outputs |= {f"OTLP {path} #{n}": body for n, (path, body) in enumerate(requests, first_request)}
    outputs |= {"stdout": proc.stdout, "stderr": proc.stderr}
    return Run(proc, result, state, outputs)
