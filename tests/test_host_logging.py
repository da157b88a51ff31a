"""The host's logging is untouched: its stderr is byte-identical with and without stallwatch (apart from
stallwatch's own lines), whether it configures logging before `setup()`, after it (as dstack does) or
through uvicorn's log config; no handler is ever put on the root logger, and each host record is
exported once."""

from __future__ import annotations

import re
import signal
import sys

import httpx
import pytest

from conftest import clean_env, otlp_items, run_python
from support.served import SCENARIOS, Served

_RECORDS = """
log = logging.getLogger("host.module")
log.warning("host warning %d", 1)
log.info("host info")
try:
    raise KeyError("boom")
except KeyError:
    log.exception("host error with its traceback")
logging.getLogger().error("root error")
"""

_CONFIGURED_BEFORE = (
    """
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
if os.environ["WITH_STALLWATCH"] == "1":
    import stallwatch
    stallwatch.setup(watchdog=False)
"""
    + _RECORDS
)

_CONFIGURED_AFTER = (
    """
import logging, os, sys
if os.environ["WITH_STALLWATCH"] == "1":
    import stallwatch
    stallwatch.setup(watchdog=False)
logging.getLogger("host.early").warning("before the host configured logging")
logging.getLogger().addHandler(logging.StreamHandler())  # as dstack does once its settings are read
logging.getLogger().setLevel(logging.INFO)
"""
    + _RECORDS
)

_NEVER_CONFIGURED = (
    """
import logging, os, sys
if os.environ["WITH_STALLWATCH"] == "1":
    import stallwatch
    stallwatch.setup(watchdog=False)
"""
    + _RECORDS
)


def _stderr_of(code: str, with_stallwatch: bool, tmp_path) -> str:
    result = run_python(
        code,
        env=clean_env(WITH_STALLWATCH="1" if with_stallwatch else "0", STALLWATCH_FILE_DIR=str(tmp_path / "telemetry")),
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def _without_stallwatchs_lines(stderr: str) -> str:
    return "".join(line for line in stderr.splitlines(keepends=True) if "stallwatch" not in line)


@pytest.mark.parametrize(
    "code", [_CONFIGURED_BEFORE, _CONFIGURED_AFTER, _NEVER_CONFIGURED], ids=["before", "after", "never"]
)
def test_the_hosts_stderr_is_byte_identical_with_and_without_stallwatch(tmp_path, code):
    bare = _stderr_of(code, False, tmp_path / "bare")
    instrumented = _stderr_of(code, True, tmp_path / "instrumented")

    assert "host error with its traceback" in bare and "KeyError: 'boom'" in bare
    assert _without_stallwatchs_lines(instrumented) == bare


def test_each_host_record_is_exported_once(tmp_path):
    _stderr_of(_CONFIGURED_AFTER, True, tmp_path)

    bodies = [record["body"]["stringValue"] for record in otlp_items(tmp_path / "telemetry" / "logs.jsonl", "logs")]
    # WARNING and above (STALLWATCH_LOG_LEVEL), each once; INFO is below the export level.
    assert sorted(bodies) == sorted(
        ["before the host configured logging", "host warning 1", "host error with its traceback", "root error"]
    )


def test_stallwatchs_own_warning_reaches_stderr_once_whatever_the_host_configured(tmp_path):
    code = """
        import logging, os
        import stallwatch
        stallwatch.setup(watchdog=False, file_dir=os.environ["TELEMETRY"])
        logging.getLogger("stallwatch").warning("stallwatch: first")
        logging.basicConfig(format="%(message)s")
        logging.getLogger("stallwatch").warning("stallwatch: second")
        """
    result = run_python(code, env=clean_env(TELEMETRY=str(tmp_path / "telemetry")))

    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["stallwatch: first", "stallwatch: second"]


def test_no_handler_is_ever_put_on_the_root_logger(tmp_path):
    result = run_python(
        """
        import logging, os
        import stallwatch
        session = stallwatch.setup(watchdog=False, file_dir=os.environ["TELEMETRY"])
        assert session.files["logs"]
        print(logging.getLogger().handlers)
        """,
        env=clean_env(TELEMETRY=str(tmp_path / "telemetry")),
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


def test_records_of_a_logger_that_does_not_propagate_are_not_exported(tmp_path):
    result = run_python(
        """
        import logging, os
        import stallwatch
        stallwatch.setup(watchdog=False, file_dir=os.environ["TELEMETRY"])
        private = logging.getLogger("host.private")
        private.propagate = False
        private.addHandler(logging.NullHandler())
        private.error("kept to itself")
        logging.getLogger("host.public").error("shared")
        stallwatch.shutdown()
        """,
        env=clean_env(TELEMETRY=str(tmp_path / "telemetry")),
    )

    assert result.returncode == 0, result.stderr
    bodies = [record["body"]["stringValue"] for record in otlp_items(tmp_path / "telemetry" / "logs.jsonl", "logs")]
    assert bodies == ["shared"]


def _uvicorn_stderr(tmp_path, with_stallwatch: bool) -> str:
    env = clean_env(SERVED_APP_STALLWATCH="1" if with_stallwatch else "0", STALLWATCH_FILE_DIR=str(tmp_path))
    command = [sys.executable, "-m", "uvicorn", "served_app:app", "--port", "0", "--loop", "uvloop"]
    host = Served(command, env, cwd=SCENARIOS)
    try:
        port = int(host.wait_for(r"Uvicorn running on http://127\.0\.0\.1:(\d+)").group(1))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for number in range(3):
                assert client.get(f"/spawn/{number}").status_code == 200
        host.process.send_signal(signal.SIGINT)
        assert host.finish() == 0, host.stderr()
    finally:
        host.kill()
    return re.sub(r"\d+", "N", host.stderr())  # pids and ports


def test_uvicorns_own_log_config_prints_the_same_lines_with_and_without_stallwatch(tmp_path):
    bare = _uvicorn_stderr(tmp_path / "bare", False)
    instrumented = _uvicorn_stderr(tmp_path / "instrumented", True)

    assert "served app started" in bare and "Application startup complete" in bare
    assert _without_stallwatchs_lines(instrumented) == bare
