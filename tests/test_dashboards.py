"""Dashboards as code (dashboards/): the committed files are what the generator makes from
stallwatch.telemetry, the alert rules pass promtool's unit tests, the provisioning config is valid,
and every panel query and alert works on a real Prometheus scraping real scenarios."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from conftest import SCENARIOS, clean_env
from stallwatch import telemetry

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
needs_promtool = pytest.mark.skipif(
    not os.access(PROMTOOL, os.X_OK), reason="needs promtool: apt-get install prometheus"
)
needs_prometheus = pytest.mark.skipif(
    not os.access(PROMETHEUS, os.X_OK), reason="needs prometheus: apt-get install prometheus"
)
UIDS = {"stallwatch-freezes", "stallwatch-wedges", "stallwatch-cloud-calls"}
ALERT_NAMES = {
    "FreezeActive",
    "SpawnBlockedHigh",
    "ChildKilledBySignal",
    "ExecutorWorkerDied",
    "ExecutorOrphanedItem",
    "ExecutorQueueStalled",
    "ExecutorQueueWaitHigh",
    "ExecutionOverdue",
    "WedgeDetected",
    "UnconfirmedCloudResource",
}


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    pytest.importorskip("grafana_foundation_sdk", reason="needs grafana-foundation-sdk (the test extras)")
    spec = importlib.util.spec_from_file_location("stallwatch_dashboards_generate", DASHBOARDS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted((DASHBOARDS / "json").glob("*.json"))}


def alert_rules() -> list[dict]:
    (group,) = yaml.safe_load((DASHBOARDS / "alerts.yaml").read_text())["groups"]
    return group["rules"]


def targets(dashboard: dict, kind: str) -> Iterator[tuple[str, str]]:
    """(panel title, query) of every target of data-source type `kind`."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target["datasource"]["type"] == kind:
                yield panel["title"], target.get("expr") or target.get("query")


def promql() -> Iterator[tuple[str, str]]:
    """(where, expression) of every PromQL expression: panels, annotations, alerts."""
    for name, dashboard in dashboards().items():
        for title, expr in targets(dashboard, "prometheus"):
            yield f"{name}: {title}", expr
        for annotation in dashboard["annotations"]["list"]:
            yield f"{name}: annotation {annotation['name']}", annotation["expr"]
    for rule in alert_rules():
        yield f"alert {rule['alert']}", rule["expr"]


# ---- generated files and static checks ----------------------------------------------------------


def test_committed_files_are_what_the_generator_makes(generator):
    rendered = generator.render()
    stale = [str(path.relative_to(ROOT)) for path, text in rendered.items() if path.read_text() != text]
    assert not stale, f"run `python dashboards/generate.py` and commit: {stale}"
    assert set((DASHBOARDS / "json").glob("*.json")) == {p for p in rendered if p.suffix == ".json"}


def test_the_generator_takes_every_metric_name_from_telemetry():
    source = (DASHBOARDS / "generate.py").read_text()
    for metric in telemetry.METRICS:
        assert metric.name not in source and metric.prometheus_name not in source, metric.name


def test_every_name_in_the_expressions_is_in_the_telemetry_contract():
    series, labels = {"up", "target_info"}, {"job", "instance", "le", "service_name"}
    for metric in telemetry.METRICS:
        base = metric.prometheus_name
        series |= {base, f"{base}_bucket", f"{base}_sum", f"{base}_count"} if metric.kind == "histogram" else {base}
        labels |= {a.name.replace(".", "_").replace("-", "_") for a in metric.attributes}
    keywords = {"sum", "max", "by", "rate", "increase", "histogram_quantile", "unless", "offset", "or", "and"}
    keywords |= {"last_over_time"}
    for where, expr in promql():
        bare = re.sub(r'"[^"]*"|\$__rate_interval|\b\d+(\.\d+)?[smhd]?\b', " ", expr)
        for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", bare):
            assert word in series | labels | keywords, (where, word, expr)


def test_dashboards_have_variables_titles_descriptions_units_and_annotations():
    found = dashboards()
    assert {d["uid"] for d in found.values()} == UIDS
    for name, dashboard in found.items():
        assert "__inputs" not in dashboard, name  # file provisioning cannot fill __inputs
        assert dashboard["title"] and dashboard["description"], name
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert set(variables) == {"prometheus", "tempo", "loki", "job", "service", "instance"}, name
        for kind in ("prometheus", "tempo", "loki"):
            assert (variables[kind]["type"], variables[kind]["query"]) == ("datasource", kind)
        for variable in ("job", "service", "instance"):
            assert variables[variable]["datasource"] == {"type": "prometheus", "uid": "${prometheus}"}
        assert [a["name"] for a in dashboard["annotations"]["list"]] == ["Freezes", "Wedges"]
        titles = [panel["title"] for panel in dashboard["panels"]]
        assert len(titles) == len(set(titles)), name
        for panel in dashboard["panels"]:
            assert panel["title"] and panel["description"] and panel["fieldConfig"]["defaults"]["unit"], panel
            kind = panel["datasource"]["type"]
            assert panel["datasource"]["uid"] == f"${{{kind}}}"
            assert panel["targets"] and all(t["datasource"] == panel["datasource"] for t in panel["targets"])
        for title, expr in targets(dashboard, "prometheus"):
            assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr, title
            assert all(window == "$__rate_interval" for window in re.findall(r"\[([^\]]+)\]", expr)), title
        for title, query in [*targets(dashboard, "tempo"), *targets(dashboard, "loki")]:
            assert "${service:regex}" in query, title


def test_the_freeze_wedge_and_cloud_dashboards_each_end_with_a_loki_panel_of_records_linking_to_tempo():
    datasources = yaml.safe_load((DASHBOARDS / "provisioning" / "grafana" / "datasources.yaml").read_text())
    (loki,) = [d for d in datasources["datasources"] if d["type"] == "loki"]
    derived = {field["name"]: field for field in loki["jsonData"]["derivedFields"]}
    assert derived["trace_id"]["matcherType"] == "label" and derived["trace_id"]["datasourceUid"] == "tempo"
    for name, dashboard in dashboards().items():
        panel = dashboard["panels"][-1]
        assert (panel["type"], panel["datasource"]["type"]) == ("logs", "loki"), name
        assert panel["title"].endswith("→ traces") and panel["options"]["enableLogDetails"], name
        below = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"][:-1])
        assert panel["gridPos"] == {"h": 10, "w": 24, "x": 0, "y": below}, name  # full width, under the rest
        (target,) = panel["targets"]
        assert target["expr"].startswith('{service_name=~"${service:regex}"} | '), name
        (link,) = panel["fieldConfig"]["defaults"]["links"]
        panes = json.loads(urllib.parse.unquote(link["url"].split("panes=", 1)[1]))
        (query,) = panes["trace"]["queries"]
        assert query["datasource"] == {"type": "tempo", "uid": "${tempo}"}, name
        assert (query["queryType"], query["query"]) == ("traceql", "${__data.fields.trace_id}"), name
    exprs = {name: d["panels"][-1]["targets"][0]["expr"] for name, d in dashboards().items()}
    assert 'scope_name = "stallwatch.watchdog" | trace_id != ""' in exprs["freezes.json"]
    assert f"{telemetry.WEDGE_KIND.name.replace('.', '_')} != " in exprs["wedges.json"]
    assert 'scope_name = "stallwatch.cloud"' in exprs["cloud-calls.json"]


def test_alert_rules_point_at_a_dashboard_panel_and_the_postmortem():
    panels = {d["uid"]: {p["title"] for p in d["panels"]} for d in dashboards().values()}
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} == ALERT_NAMES
    for rule in rules:
        notes = rule["annotations"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert notes["summary"] and notes["description"], rule["alert"]
        assert notes["panel"] in panels[notes["dashboard_uid"]], rule["alert"]
        assert notes["dashboard_uid"] in notes["runbook"] and notes["panel"] in notes["runbook"]
        assert "stallwatch postmortem" in notes["runbook"]
        assert "$job" not in rule["expr"] and "$instance" not in rule["expr"]


@needs_promtool
def test_promtool_checks_and_unit_tests_the_alert_rules():
    checked = subprocess.run(
        [PROMTOOL, "check", "rules", "alerts.yaml"], cwd=DASHBOARDS, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=DASHBOARDS / "tests", capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tests = yaml.safe_load((DASHBOARDS / "tests" / "alerts_test.yaml").read_text())["tests"]
    assert {test["name"].split(": ")[0] for test in tests} == ALERT_NAMES
    for name in ALERT_NAMES:  # each alert is tested through scrape gaps: stale markers, then no samples
        gapped = [test for test in tests if test["name"].startswith(f"{name}: ")]
        assert any("stale" in series["values"] for test in gapped for series in test["input_series"]), name


# Each duration histogram the issue names, and where its buckets must be fine: its threshold or shortest call.
FINE_DURATIONS = (
    (telemetry.FREEZE_DURATION, 1.0),
    (telemetry.SUBPROCESS_SPAWN_DURATION, 0.1),
    (telemetry.SSH_TUNNEL_OPEN_DURATION, 0.1),
    (telemetry.SSH_TUNNEL_CLOSE_DURATION, 0.1),
    (telemetry.NEBIUS_CALL_DURATION, 0.01),
)


@needs_promtool
@pytest.mark.parametrize(("metric", "fine_from"), FINE_DURATIONS, ids=lambda value: getattr(value, "name", ""))
def test_histogram_quantile_reads_one_duration_within_20_percent_from_where_the_buckets_turn_fine(
    metric, fine_from, tmp_path
):
    """A single observation (one freeze, one spawn held 30 s) through Prometheus's own
    `histogram_quantile(0.99, rate(...))`, evaluated by promtool: within 20 % of what was recorded."""
    bounds = metric.buckets
    assert bounds is not None and bounds[-1] == 600.0
    values = [v for v in (0.0105, 0.031, 0.105, 0.33, 1.05, 2.95, 30.1, 59.9, 121.0, 299.0, 590.0) if v > fine_from]
    bucket = f"{metric.prometheus_name}_bucket"
    rules, series = [], []
    for case, value in enumerate(values):
        quantile = f'histogram_quantile(0.99, sum by (le, case) (rate({bucket}{{case="{case}"}}[2m])))'
        rules.append({"alert": f"Within{case}", "expr": f"abs({quantile} - {value}) / {value} <= 0.2"})
        for le in [*map(str, bounds), "+Inf"]:
            count = 1 if le == "+Inf" or value <= float(le) else 0
            series.append({"series": f'{bucket}{{case="{case}", le="{le}"}}', "values": f"0 {count} {count}"})
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    checks = [
        {"eval_time": "2m", "alertname": f"Within{case}", "exp_alerts": [{"exp_labels": {"case": str(case)}}]}
        for case in range(len(values))
    ]
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}]}  # fmt: skip
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    tested = subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert tested.returncode == 0, f"values {values}:\n{tested.stdout}{tested.stderr}"


@needs_promtool
def test_provisioned_prometheus_config_is_valid():
    config = DASHBOARDS / "provisioning" / "prometheus" / "prometheus.yml"
    checked = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in checked.stdout + checked.stderr  # it loads alerts.yaml
    jobs = {job["job_name"] for job in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs == {"stallwatch", "stallwatch-watchdog"}


def test_provisioned_data_sources_link_metrics_traces_and_logs():
    sources = yaml.safe_load((DASHBOARDS / "provisioning" / "grafana" / "datasources.yaml").read_text())
    by_type = {source["type"]: source for source in sources["datasources"]}
    assert set(by_type) == {"prometheus", "tempo", "loki"}
    uids = {kind: source["uid"] for kind, source in by_type.items()}
    assert by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == uids["tempo"]
    assert by_type["tempo"]["jsonData"]["tracesToLogsV2"]["datasourceUid"] == uids["loki"]
    assert by_type["loki"]["jsonData"]["derivedFields"][0]["datasourceUid"] == uids["tempo"]
    provider = yaml.safe_load((DASHBOARDS / "provisioning" / "grafana" / "dashboards.yaml").read_text())
    assert provider["providers"][0]["type"] == "file"
    collector = yaml.safe_load((DASHBOARDS / "provisioning" / "otelcol" / "config.yaml").read_text())
    pipelines = collector["service"]["pipelines"]
    assert {name: p["receivers"] for name, p in pipelines.items()} == {
        k: ["otlp"] for k in ("metrics", "traces", "logs")
    }
    exporters = {name: p["exporters"] for name, p in pipelines.items()}
    assert exporters == {"metrics": ["prometheusremotewrite"], "traces": ["otlp/tempo"], "logs": ["otlphttp/loki"]}


# ---- proof on a real Prometheus -----------------------------------------------------------------

# Which scenario (tests/scenarios/dash_<name>.py) makes each panel, annotation and alert show data or fire.
PANEL_SCENARIOS = {
    "Frozen now": "freeze",
    "Scrape gaps (up == 0)": "freeze",
    "Freezes by kind and cause": "freeze",
    "Freeze duration p50/p99 by kind and cause": "freeze",
    "Event-loop lag p50/p99": "freeze",
    "Spawn blocked time p50/p99 by loop and method": "freeze",
    "Forks by kind and gRPC activity": "freeze",
    "Child deaths by signal": "freeze",
    "SSH tunnel open/close latency p50/p99": "ssh",
    "SSH tunnel failures by phase and exit signal": "ssh",
    "Active SSH tunnels": "ssh",
    "Telemetry dropped by signal and reason": "ssh",
    "Executor pending, running and workers vs max": "wedge",
    "Oldest pending age": "wedge",
    "Queue wait and run time p99": "wedge",
    "Worker deaths and orphaned items": "wedge_held",
    "Healed items": "wedge",
    "Async exceptions: injected, delivered, revoked, refused": "wedge",
    "Execution timeouts": "wedge",
    "Overrun past the deadline p50/p99": "wedge",
    "Overdue work now": "wedge",
    "Wedges detected by kind": "wedge",
    "Nebius call rate by method": "cloud",
    "Nebius errors by status code": "cloud",
    "Nebius latency p50/p99 by method": "cloud",
    "Nebius calls in flight": "cloud",
    "Cloud resources created and deleted": "cloud",
    "Unconfirmed cloud resources (leak candidates)": "cloud",
    "annotation Freezes": "freeze",
    "annotation Wedges": "wedge",
}
ALERT_SCENARIOS = {
    "FreezeActive": "freeze",
    "SpawnBlockedHigh": "freeze",
    "ChildKilledBySignal": "freeze",
    "ExecutorWorkerDied": "wedge",
    "ExecutorOrphanedItem": "wedge_held",
    "ExecutorQueueStalled": "wedge_held",
    "ExecutorQueueWaitHigh": "wedge_held",
    "ExecutionOverdue": "wedge",
    "WedgeDetected": "wedge",
    "UnconfirmedCloudResource": "cloud",
}
ZERO_IS_DATA = {"Scrape gaps (up == 0)"}  # every other panel must show a non-zero value in its scenario
SCRAPE = "1s"
RATE_INTERVAL = "4s"  # what Grafana makes of $__rate_interval for a 1 s scrape interval
JOBS = "stallwatch|stallwatch-watchdog"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Scenario:
    """One dash_<name>.py process serving Prometheus metrics (and its watchdog's, for `freeze`)."""

    def __init__(self, name: str, *args: str, watchdog: bool = False) -> None:
        self.name, self.args = name, args
        self.port, self.watchdog_port = _free_port(), _free_port() if watchdog else None
        self.lines: list[dict] = []
        self.started = self.done = 0.0
        self.proc: subprocess.Popen | None = None

    @property
    def instances(self) -> list[str]:
        ports = [self.port] if self.watchdog_port is None else [self.port, self.watchdog_port]
        return [f"127.0.0.1:{port}" for port in ports]

    def start(self) -> None:
        env = clean_env(
            OTEL_SERVICE_NAME=f"dash-{self.name}",
            OTEL_METRICS_EXPORTER="prometheus",
            OTEL_TRACES_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
            OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(self.port),
            STALLWATCH_WATCHDOG_PROMETHEUS_PORT=str(self.watchdog_port or _free_port()),
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(SCENARIOS / f"dash_{self.name}.py"), *self.args],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))
                if self.lines[-1].get("done"):
                    self.done = time.time()

    def wait_for(self, key: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.get(key) for line in self.lines):
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"dash_{self.name}.py: no {key!r} line:\n{self.proc.stderr.read()[-3000:]}")
            time.sleep(0.05)

    def go(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.started = time.time()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> str:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        stderr = self.proc.stderr.read() if self.proc.stderr else ""
        return "" if self.proc.returncode == 0 else f"dash_{self.name}.py exited {self.proc.returncode}:\n{stderr}"


class Prometheus:
    def __init__(self, workdir: Path, scenarios: list[Scenario]) -> None:
        self.port = _free_port()
        rules = yaml.safe_load((DASHBOARDS / "alerts.yaml").read_text())
        for rule in rules["groups"][0]["rules"]:
            rule.pop("for", None)  # fire within seconds; `for` itself is covered by promtool's unit tests
        (workdir / "alerts.yaml").write_text(yaml.safe_dump(rules))
        hosts = [s.instances[0] for s in scenarios]
        watchdogs = [s.instances[1] for s in scenarios if s.watchdog_port is not None]
        config = {
            "global": {"scrape_interval": SCRAPE, "scrape_timeout": "900ms", "evaluation_interval": SCRAPE},
            "rule_files": ["alerts.yaml"],
            "scrape_configs": [
                {"job_name": "stallwatch", "static_configs": [{"targets": hosts}]},
                {"job_name": "stallwatch-watchdog", "static_configs": [{"targets": watchdogs}]},
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, (workdir / "prometheus.log").read_text()
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1).status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str | float) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            return json.loads(error.read())

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        answer = self.api("query_range", query=expr, start=start, end=end, step="1s")
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def concrete(expr: str, scenario: Scenario) -> str:
    """The expression as Grafana sends it with this scenario's job and instances selected."""
    instances = "|".join(scenario.instances)  # a regex, as Grafana renders a multi-value variable
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$job", JOBS).replace("$instance", instances)


@needs_prometheus
def test_every_panel_query_and_alert_works_on_a_real_prometheus(sshd, http_server, tmp_path):
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:  # short: unix socket paths are limited
        scenarios = {
            "freeze": Scenario("freeze", "4", watchdog=True),
            "wedge": Scenario("wedge"),
            "wedge_held": Scenario("wedge_held"),
            "cloud": Scenario("cloud"),
            "ssh": Scenario("ssh", sshd.user, sshd.host, str(sshd.port), str(sshd.identity), str(http_server),
                            sock_dir),
        }  # fmt: skip
        prometheus = Prometheus(tmp_path, list(scenarios.values()))
        problems: list[str] = []
        try:
            for scenario in scenarios.values():
                scenario.start()
            for scenario in scenarios.values():
                scenario.wait_for("ready", 60)
            expected = sum(len(s.instances) for s in scenarios.values())
            deadline = time.monotonic() + 20
            while len(prometheus.api("query", query="up == 1")["data"]["result"]) < expected:
                assert time.monotonic() < deadline, prometheus.api("query", query="up")
                time.sleep(0.2)
            for scenario in scenarios.values():
                scenario.go()
            for scenario in scenarios.values():
                scenario.wait_for("done", 90)
            time.sleep(2.5)  # the last scrapes and rule evaluations
            end = time.time()
            problems += [p for p in (s.stop() for s in scenarios.values()) if p]

            checked = set()
            for where, expr in promql():
                parsed = prometheus.api("query", query=concrete(expr, scenarios["freeze"]))
                if parsed["status"] != "success":
                    problems.append(f"{where}: does not parse: {parsed.get('error')}\n  {expr}")
                    continue
                key = where.split(": ", 1)[-1]
                if key.startswith("alert "):
                    name = key.removeprefix("alert ")
                    scenario = scenarios[ALERT_SCENARIOS[name]]
                    selector = f'alertname="{name}", alertstate="firing", instance=~"{concrete("$instance", scenario)}"'
                    firing = prometheus.query_range(f"ALERTS{{{selector}}}", scenario.started, end)
                    if not firing:
                        problems.append(f"{where}: did not fire in dash_{scenario.name}.py")
                else:
                    scenario = scenarios[PANEL_SCENARIOS[key]]
                    values = [
                        float(value)
                        for result in prometheus.query_range(concrete(expr, scenario), scenario.started, end)
                        for _, value in result["values"]
                    ]
                    if not any(values) and not (values and key in ZERO_IS_DATA):
                        problems.append(f"{where}: no data from dash_{scenario.name}.py\n  {concrete(expr, scenario)}")
                checked.add(key)
            assert checked == set(PANEL_SCENARIOS) | {f"alert {name}" for name in ALERT_SCENARIOS}
            services = prometheus.query_range(f'target_info{{job=~"{JOBS}"}}', scenarios["freeze"].started, end)
            assert {s["metric"]["service_name"] for s in services} == {f"dash-{name}" for name in scenarios}
        finally:
            for scenario in scenarios.values():
                if scenario.proc is not None and scenario.proc.poll() is None:
                    scenario.proc.kill()
            prometheus.stop()
        assert not problems, "\n".join(problems)
