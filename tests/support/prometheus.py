"""A real Prometheus scraping real dash_<name>.py scenario processes, for tests of the dashboards and alerts.

`Prometheus.shipped()` runs the configuration a user deploys: dashboards/provisioning/prometheus/prometheus.yml
(its scrape and evaluation intervals, per-job timeouts, file-based discovery) and dashboards/alerts.yaml (its `for`
values) unchanged but for the directory discovery reads, which lists the scenarios' ports or is the one the hosts
register in. Tests shorten their scenarios, never the config.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from conftest import SCENARIOS, clean_env
from support.loopback import free_port, prometheus_env

DASHBOARDS = Path(__file__).resolve().parent.parent.parent / "dashboards"
SHIPPED_CONFIG = DASHBOARDS / "provisioning" / "prometheus" / "prometheus.yml"
SHIPPED_RULES = DASHBOARDS / "alerts.yaml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
HAVE_PROMETHEUS = os.access(PROMETHEUS, os.X_OK)
HOST_JOB, WATCHDOG_JOB = "stallwatch", "stallwatch-watchdog"


def rate_interval(scrape_interval: float) -> str:
    """What Grafana makes of $__rate_interval over a short range: four scrape intervals."""
    return f"{round(4 * scrape_interval)}s"


class Scenario:
    """One tests/scenarios/dash_<name>.py process serving Prometheus metrics, and its watchdog's with `watchdog`.

    The host and its watchdog carry one identity, service.instance.id `dash-<name>-1`, under service.name
    `dash-<name>`. The protocol (dash_common.py): JSON "ready" line, "go" on stdin, JSON "done" line, serve
    until stdin closes; a JSON "holding" line names a state held until `release()`.
    """

    def __init__(self, name: str, *args: str, watchdog: bool = False, env: Mapping[str, str] | None = None) -> None:
        self.name, self.args, self.extra_env = name, args, dict(env or {})
        self.port, self.watchdog_port = free_port(), free_port() if watchdog else None
        self.lines: list[dict[str, Any]] = []
        self.errors: list[str] = []  # stderr, read as it comes: a full pipe would block the scenario (or its watchdog)
        self.started = self.done = 0.0
        self.proc: subprocess.Popen[str] | None = None
        self.release_dir = Path(tempfile.mkdtemp(prefix=f"dash-release-{name}-"))
        self.killed = False
        self.held: dict[str, float] = {}  # what the scenario holds, and when the test read that it does
        self.released: dict[str, float] = {}

    @property
    def service(self) -> str:
        return f"dash-{self.name}"

    @property
    def identity(self) -> str:
        """The service.instance.id of the host and its watchdog: what the dashboards' Instance selects."""
        return f"dash-{self.name}-1"

    @property
    def host_target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def watchdog_target(self) -> str | None:
        return None if self.watchdog_port is None else f"127.0.0.1:{self.watchdog_port}"

    @property
    def watchdog_pid(self) -> int | None:
        """The freeze watchdog's pid, from the "ready" line of a scenario that has one (None before it)."""
        ready = self.line("ready")
        return ready.get("watchdog_pid") if ready else None

    @property
    def targets(self) -> list[str]:
        return [t for t in (self.host_target, self.watchdog_target) if t is not None]

    def start(self) -> None:
        env = clean_env(
            OTEL_SERVICE_NAME=self.service,
            OTEL_RESOURCE_ATTRIBUTES=f"service.instance.id={self.identity}",
            **prometheus_env(self.port, self.watchdog_port or free_port()),
            OTEL_TRACES_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
            DASH_RELEASE_DIR=str(self.release_dir),
            **self.extra_env,
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(SCENARIOS / f"dash_{self.name}.py"), *self.args],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        self._errors_reader = threading.Thread(target=self._read_errors, daemon=True)
        self._errors_reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))
                if self.lines[-1].get("done"):
                    self.done = time.time()
                if self.lines[-1].get("holding"):
                    self.held[self.lines[-1]["holding"]] = time.time()

    def _read_errors(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.errors.append(line)

    @property
    def stderr(self) -> str:
        """What the scenario (and its watchdog, which inherits the stream) wrote to stderr so far."""
        return "".join(self.errors)

    def line(self, key: str) -> dict[str, Any] | None:
        """The first JSON line the scenario printed with `key` set, if any yet."""
        return next((line for line in self.lines if line.get(key)), None)

    def wait_for(self, key: str, timeout: float) -> dict[str, Any]:
        """The first JSON line with `key` set; kills the scenario and fails with its stderr if none comes."""
        deadline = time.monotonic() + timeout
        while (found := self.line(key)) is None:
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait(30)
                raise AssertionError(f"dash_{self.name}.py: no {key!r} line:\n{self.stderr[-3000:]}")
            time.sleep(0.05)
        return found

    def go(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.started = time.time()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def release(self, name: str) -> None:
        """End the state the scenario holds under `name`."""
        (self.release_dir / name).touch()
        self.released[name] = time.time()

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Signal the host process (its watchdog sees it die, as in production)."""
        assert self.proc is not None
        self.proc.send_signal(signum)
        self.killed = True

    def stop(self) -> str:
        """Close stdin and wait for a clean exit; a problem description unless it exited 0 or was killed on purpose."""
        assert self.proc is not None and self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._errors_reader.join(10)  # to the end of the stream
        return (
            ""
            if self.proc.returncode in (0, -signal.SIGKILL)
            else f"dash_{self.name}.py exited {self.proc.returncode}:\n{self.stderr}"
        )

    def ensure_dead(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        shutil.rmtree(self.release_dir, ignore_errors=True)


class Prometheus:
    """A Prometheus server on a free loopback port with its data in `workdir`, ready when constructed."""

    def __init__(
        self, workdir: Path, config: dict[str, Any], rules: str | None = None, features: Sequence[str] = ()
    ) -> None:
        """`config` is a prometheus.yml as a dict; `rules`, when given, the text of its one rule file;
        `features`, the `--enable-feature` flags (e.g. exemplar-storage)."""
        self.workdir = workdir
        self.port = free_port()
        self.config = config
        if rules is not None:
            (workdir / "alerts.yaml").write_text(rules)
            config["rule_files"] = ["alerts.yaml"]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
             *(f"--enable-feature={feature}" for feature in features)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.1)

    @classmethod
    def scraping(
        cls, workdir: Path, jobs: Mapping[str, Sequence[str]], interval: str, features: Sequence[str] = ()
    ) -> Prometheus:
        """A config of its own: `jobs` (job name -> targets) scraped and evaluated every `interval`."""
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(t)}]} for job, t in jobs.items()],
        }
        return cls(workdir, config, features=features)

    @classmethod
    def shipped(
        cls, workdir: Path, targets: Mapping[str, Sequence[str]] | None = None, discovered: Path | None = None
    ) -> Prometheus:
        """The shipped prometheus.yml and alerts.yaml, unchanged but for the directory its file-based discovery
        reads: `discovered` (the STALLWATCH_PROMETHEUS_TARGETS_DIR the hosts register in), else one of its own
        in `workdir` holding each job's `targets` (job name -> targets) in a file of the job's pattern.

        A job with no targets scrapes nothing; a job name the shipped config lacks is an error.
        """
        config = yaml.safe_load(SHIPPED_CONFIG.read_text())
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        targets = targets or {}
        assert set(targets) <= set(jobs), (set(targets) - set(jobs), "not in the shipped config")
        directory = discovered or workdir / "targets"
        directory.mkdir(exist_ok=True)
        for name, job in jobs.items():
            (discovery,) = job["file_sd_configs"]
            (pattern,) = discovery["files"]
            discovery["files"] = [str(directory / Path(pattern).name)]
            if name in targets:
                listed = [{"targets": list(targets[name]), "labels": {}}]
                (directory / Path(pattern).name.replace("*", "listed")).write_text(json.dumps(listed))
        return cls(workdir, config, SHIPPED_RULES.read_text())

    @property
    def scrape_interval(self) -> float:
        return _seconds(self.config["global"]["scrape_interval"])

    @property
    def evaluation_interval(self) -> float:
        return _seconds(self.config["global"]["evaluation_interval"])

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str | float) -> dict[str, Any]:
        """The JSON answer of /api/v1/<path>, errors included (status "error")."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            return json.loads(error.read())

    def query(self, expr: str, **params: str | float) -> list[dict[str, Any]]:
        answer = self.api("query", query=expr, **params)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        answer = self.api("query_range", query=expr, start=start, end=end, step=step)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def wait_until_up(self, targets: int, timeout: float = 60) -> None:
        """Until `targets` targets have answered a scrape (`up == 1`): the first scrape comes within an interval."""
        deadline = time.monotonic() + timeout
        while len(self.query("up == 1")) < targets:
            assert time.monotonic() < deadline, self.query("up")
            time.sleep(0.2)

    def last_scrapes(self) -> dict[str, float]:
        """Scrape URL's host:port -> when its last scrape started (Unix time; 0 before the first)."""
        answer = self.api("targets", state="active")
        assert answer["status"] == "success", answer
        return {
            target["discoveredLabels"]["__address__"]: _unix_time(target["lastScrape"])
            for target in answer["data"]["activeTargets"]
        }

    def target_health(self) -> dict[str, str]:
        """Scrape URL's host:port -> its last scrape's health, and error if any (what a stuck test reports)."""
        answer = self.api("targets", state="active")
        assert answer["status"] == "success", answer
        return {
            target["discoveredLabels"]["__address__"]: f"{target['health']} {target.get('lastError', '')}".strip()
            for target in answer["data"]["activeTargets"]
        }

    def wait_scraped_after(self, targets: Sequence[str], after: float, timeout: float = 60) -> None:
        """Until each of `targets` has had a scrape start after `after` (answered or not)."""
        deadline = time.monotonic() + timeout
        while any(self.last_scrapes().get(target, 0.0) <= after for target in targets):
            assert time.monotonic() < deadline, (targets, after, self.last_scrapes())
            time.sleep(0.5)

    def wait_evaluated_after(self, after: float, timeout: float = 60) -> None:
        """Until every rule group has been evaluated after `after`."""
        deadline = time.monotonic() + timeout
        while True:
            answer = self.api("rules")
            assert answer["status"] == "success", answer
            if all(_unix_time(group["lastEvaluation"]) > after for group in answer["data"]["groups"]):
                return
            assert time.monotonic() < deadline, answer
            time.sleep(0.5)

    def alerts(self, name: str | None = None, **labels: str) -> list[dict[str, Any]]:
        """Alerts pending or firing now (/api/v1/alerts), optionally of one name and with these labels."""
        answer = self.api("alerts")
        assert answer["status"] == "success", answer
        return [
            alert
            for alert in answer["data"]["alerts"]
            if (name is None or alert["labels"]["alertname"] == name)
            and all(alert["labels"].get(key) == value for key, value in labels.items())
        ]

    def wait_for_alert(self, name: str, state: str = "firing", timeout: float = 120, **labels: str) -> dict[str, Any]:
        """The first alert `name` with these labels in `state` ("pending" also accepts "firing")."""
        accepted = {"pending", "firing"} if state == "pending" else {state}
        deadline = time.monotonic() + timeout
        while True:
            found = [alert for alert in self.alerts(name, **labels) if alert["state"] in accepted]
            if found:
                return found[0]
            assert time.monotonic() < deadline, (name, state, labels, self.alerts())
            time.sleep(0.5)

    def alert_history(self, name: str, start: float, end: float, **labels: str) -> dict[str, list[float]]:
        """From the ALERTS series: alertstate ("pending", "firing") -> the times it held between start and end."""
        selector = ", ".join([f'alertname="{name}"', *(f'{key}="{value}"' for key, value in labels.items())])
        history: dict[str, list[float]] = {}
        for series in self.query_range(f"ALERTS{{{selector}}}", start, end):
            history.setdefault(series["metric"]["alertstate"], []).extend(float(t) for t, _ in series["values"])
        return history

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def _unix_time(rfc3339: str) -> float:
    """Prometheus's RFC 3339 times (nanoseconds, Z) as Unix time; year 1 (never) as 0."""
    if rfc3339.startswith("0001-"):
        return 0.0
    whole, _, fraction = rfc3339.rstrip("Z").partition(".")
    stamp = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc).timestamp()
    return stamp + float(f"0.{fraction or 0}")


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in sorted(units, key=len, reverse=True):
        if duration.endswith(unit):
            return float(duration.removesuffix(unit)) * units[unit]
    raise ValueError(duration)


def concrete(expr: str, scenario: Scenario, scrape_interval: float) -> str:
    """The expression as Grafana sends it with this scenario's Service and Instance selected: one value
    each, for the host and its watchdog together."""
    expr = expr.replace("$__rate_interval", rate_interval(scrape_interval)).replace("$service", scenario.service)
    return expr.replace("$instance", scenario.identity)
