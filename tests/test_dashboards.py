"""Dashboards as code (dashboards/): the committed files are what the generator makes from
stallwatch.telemetry, the alert rules pass promtool's unit tests, the provisioning config is valid,
and every panel query and alert works on a real Prometheus scraping real scenarios."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from stallwatch import telemetry
from support.loopback import scrape
from support.processes import is_gone
from support.prometheus import HAVE_PROMETHEUS, HOST_JOB, WATCHDOG_JOB, Prometheus, Scenario, concrete

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
needs_promtool = pytest.mark.skipif(
    not os.access(PROMTOOL, os.X_OK), reason="needs promtool: apt-get install prometheus"
)
needs_prometheus = pytest.mark.skipif(not HAVE_PROMETHEUS, reason="needs prometheus: apt-get install prometheus")
UIDS = {"stallwatch-freezes", "stallwatch-wedges", "stallwatch-cloud-calls"}
ALERT_NAMES = {
    "FreezeActive",
    "FrozenHostKilled",
    "HostDown",
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
    series, labels = {"up", "target_info"}, {"job", "instance", "le", "service_name", "service_instance_id"}
    for metric in telemetry.METRICS:
        base = metric.prometheus_name
        series |= {base, f"{base}_bucket", f"{base}_sum", f"{base}_count"} if metric.kind == "histogram" else {base}
        labels |= {a.name.replace(".", "_").replace("-", "_") for a in metric.attributes}
    keywords = {"sum", "max", "by", "rate", "increase", "histogram_quantile", "unless", "offset", "or", "and"}
    keywords |= {"last_over_time", "max_over_time", "on", "group_left", "ignoring"}
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
        assert set(variables) == {"prometheus", "tempo", "loki", "service", "instance"}, name
        for kind in ("prometheus", "tempo", "loki"):
            assert (variables[kind]["type"], variables[kind]["query"]) == ("datasource", kind)
        for variable in ("service", "instance"):
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
            assert 'service_name=~"$service"' in expr and 'service_instance_id=~"$instance"' in expr, title
            assert "$job" not in expr and 'instance=~"' not in expr.replace("service_instance_id", ""), title
            # Rates over Grafana's interval; a target's identity from its target_info of the last hour.
            rated = re.sub(r"target_info\{[^}]*\}\[1h\]", "", expr)
            assert all(window == "$__rate_interval" for window in re.findall(r"\[([^\]]+)\]", rated)), title
        for title, query in [*targets(dashboard, "tempo"), *targets(dashboard, "loki")]:
            assert "${service:regex}" in query, title


def test_every_panel_has_a_description_fits_the_grid_and_shows_a_state_by_name_and_colour():
    for name, dashboard in dashboards().items():
        taken: set[tuple[int, int]] = set()
        for panel in dashboard["panels"]:
            where = (name, panel["title"])
            assert panel.get("description", "").strip(), where
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, (where, grid)
            cells = {
                (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
            }
            assert not cells & taken, (where, "overlaps another panel")
            taken |= cells
            defaults = panel["fieldConfig"]["defaults"]
            if panel["type"] == "state-timeline" or defaults["unit"] == "bool_yes_no":
                (mapping,) = defaults.get("mappings", [None])
                assert mapping and mapping["type"] == "value", where
                shown = {value: (result["text"], result["color"]) for value, result in mapping["options"].items()}
                assert set(shown) == {"0", "1"} and all(text and color for text, color in shown.values()), where
                steps = defaults["thresholds"]["steps"]
                assert [step["color"] for step in steps] == [shown["0"][1], shown["1"][1]], where
                assert defaults["color"]["mode"] == "thresholds", where
    panels = {p["title"]: p for p in dashboards()["freezes.json"]["panels"]}
    frozen = panels["Frozen now"]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert (frozen["0"]["text"], frozen["1"]["text"], frozen["1"]["color"]) == ("No", "Yes", "red")
    up = panels["Scrapes answered (up)"]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert (up["0"]["text"], up["0"]["color"], up["1"]["text"]) == ("Down", "red", "Up")


def test_the_panel_of_an_alert_that_fires_over_a_level_draws_that_level_as_a_red_line():
    panels = {d["uid"]: {p["title"]: p for p in d["panels"]} for d in dashboards().values()}
    drawn = 0
    for rule in alert_rules():
        # over a level, or (an event alert) observations over a bucket bound
        level = re.search(r"> ([0-9.]+)$", rule["expr"]) or re.search(r'le="([0-9.]+)"', rule["expr"])
        if level is None or float(level.group(1)) == 0:
            continue  # an event or a state: its panel counts, or maps 0/1 to names and colours
        panel = panels[rule["annotations"]["dashboard_uid"]][rule["annotations"]["panel"]]
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults["thresholds"]["steps"][-1] == {"value": float(level.group(1)), "color": "red"}, rule["alert"]
        assert defaults["custom"]["thresholdsStyle"]["mode"] == "line", rule["alert"]
        drawn += 1
    assert drawn == 2  # SpawnBlockedHigh, ExecutorQueueWaitHigh


def test_a_freeze_shorter_than_a_scrape_interval_shows_afterwards_and_the_runbook_says_what_freezeactive_sees():
    freeze_count = f"{telemetry.FREEZE_DURATION.prometheus_name}_count"
    for name, dashboard in dashboards().items():
        (freezes,) = [a["expr"] for a in dashboard["annotations"]["list"] if a["name"] == "Freezes"]
        assert telemetry.FREEZE_ACTIVE.prometheus_name in freezes and freeze_count in freezes, name
    panels = {p["title"]: p for p in dashboards()["freezes.json"]["panels"]}
    assert all(freeze_count in t["expr"] for t in panels["Freezes by kind and cause"]["targets"])
    (active,) = [rule for rule in alert_rules() if rule["alert"] == "FreezeActive"]
    for text in (active["annotations"]["description"], panels["Frozen now"]["description"]):
        assert "scrape interval" in text and "shorter" in text and "count and duration" in text, text
    interval = yaml.safe_load((DASHBOARDS / "provisioning" / "prometheus" / "prometheus.yml").read_text())["global"]
    readme = (DASHBOARDS / "README.md").read_text()
    assert "What FreezeActive can see depends on the scrape interval" in readme
    assert f"({interval['scrape_interval'].removesuffix('s')} s in the shipped" in readme


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
        assert "$service" not in rule["expr"] and "$instance" not in rule["expr"]


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
    # Each alert is tested through scrape gaps (stale markers, then no samples), but HostDown: its `up` has a
    # sample at every scrape, answered or not.
    for name in ALERT_NAMES - {"HostDown"}:
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

# Which scenario (tests/scenarios/dash_<name>.py) makes each panel and annotation show data.
PANEL_SCENARIOS = {
    "Frozen now": "freeze",
    "Scrapes answered (up)": "freeze",
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
    "Executor pending, running and workers vs max": "wedge_held",
    "Oldest pending age": "wedge_held",
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
    "Hosts killed while frozen": "killed",
    "annotation Wedges": "wedge",
}
# The scenario in which each alert must fire with its shipped `for`, or at least be pending where that `for`
# outlasts the test; the 1-minute ones fire because their state is held.
ALERT_SCENARIOS = {
    "FreezeActive": ("freeze", "firing"),
    "SpawnBlockedHigh": ("freeze", "firing"),
    "ChildKilledBySignal": ("freeze", "firing"),
    "ExecutorWorkerDied": ("wedge", "firing"),
    "ExecutorOrphanedItem": ("wedge_held", "firing"),
    "ExecutorQueueStalled": ("wedge_held", "firing"),
    "ExecutorQueueWaitHigh": ("wedge_held", "pending"),
    "ExecutionOverdue": ("wedge", "firing"),
    "WedgeDetected": ("wedge", "firing"),
    "UnconfirmedCloudResource": ("cloud", "firing"),
    "FrozenHostKilled": ("killed", "firing"),
    "HostDown": ("killed", "firing"),
}
# What a scenario holds (dash_common.hold) until each of its targets has been scraped since and these alerts
# of its identity are in these states: a state at least as long as the shipped scrape interval and `for`.
# Then the test releases it, or for KILLED, SIGKILLs the host while it is held (and then releases the
# held child, an orphan).
HOLDS = {
    ("freeze", "freeze"): {"FreezeActive": "firing"},
    ("killed", "freeze"): {"FreezeActive": "firing"},
    ("wedge_held", "wedge"): {
        "ExecutorOrphanedItem": "firing",
        "ExecutorQueueStalled": "firing",
        "ExecutorQueueWaitHigh": "pending",
    },
    ("wedge", "overrun"): {"ExecutionOverdue": "firing"},
    ("ssh", "tunnel"): {},
    ("cloud", "call"): {},
}
KILLED = {("killed", "freeze")}
FREEZE_KIND = telemetry.FREEZE_KIND.name.replace(".", "_")
SHORT_FREEZE = ("loop_blocked", 3.0)  # dash_freeze.py's event-loop block, shorter than a scrape interval
STEP = 5.0  # seconds between the points of the range queries, as a Grafana panel a few minutes wide asks


def _numbers(result: list[dict]) -> list[float]:
    return [float(value) for series in result for _, value in series["values"]]


def _finite(values: list[float]) -> list[float]:
    return [value for value in values if math.isfinite(value)]


def _reached(
    prometheus: Prometheus, alert: str, scenarios: dict[str, Scenario], start: float, end: float | None = None
) -> bool:
    """Whether `alert` was in its wanted state (ALERT_SCENARIOS) for its scenario's identity, from the ALERTS
    series between start and end (now)."""
    scenario_name, wanted = ALERT_SCENARIOS[alert]
    scenario = scenarios[scenario_name]
    # HostDown reads `up`, which has the target's labels only.
    labels = {"instance": scenario.host_target} if alert == "HostDown" else {"service_instance_id": scenario.identity}
    states = prometheus.alert_history(alert, start, end or time.time(), **labels)
    return bool(states.get("firing") if wanted == "firing" else states)


def _release_what_prometheus_has_seen(prometheus: Prometheus, scenarios: dict[str, Scenario]) -> bool:
    """Release each held state whose scenario's targets were scraped since and whose alerts are in their
    states; whether everything is done and released."""
    finished = True
    for scenario in scenarios.values():
        for name, since in list(scenario.held.items()):
            if name in scenario.released:
                continue
            scraped = prometheus.last_scrapes()
            states = {
                alert: {a["state"] for a in prometheus.alerts(alert, service_instance_id=scenario.identity)}
                for alert in HOLDS[(scenario.name, name)]
            }
            if all(scraped.get(target, 0.0) > since for target in scenario.targets) and all(
                states[alert] & ({"pending", "firing"} if wanted == "pending" else {"firing"})
                for alert, wanted in HOLDS[(scenario.name, name)].items()
            ):
                if (scenario.name, name) in KILLED:
                    scenario.kill()
                scenario.release(name)
        finished &= bool(scenario.done or scenario.killed) and set(scenario.held) <= set(scenario.released)
    return finished


def _frozen_series(scraped: str) -> str:
    """The freeze-active series at 1 in a scrape of a freeze watchdog, "none" if it answered without
    one, else why it did not answer."""
    if scraped.startswith("no answer"):
        return scraped
    active = telemetry.FREEZE_ACTIVE.prometheus_name
    frozen = [line for line in scraped.splitlines() if line.startswith(active) and line.split()[-1] != "0.0"]
    return "; ".join(frozen) or f"no {active} series at 1"


def _stuck(prometheus: Prometheus, scenarios: dict[str, Scenario]) -> str:
    """What a run that never released everything shows: each scenario's holds, the alerts its unreleased
    holds wait for, its targets' last scrape, and the end of its stderr."""
    health = prometheus.target_health()
    lines = []
    for scenario in scenarios.values():
        lines.append(f"{scenario.name}: held {scenario.held}, released {scenario.released}, done {scenario.done}")
        for name in set(scenario.held) - set(scenario.released):
            for alert in HOLDS[(scenario.name, name)]:
                states = [a["state"] for a in prometheus.alerts(alert, service_instance_id=scenario.identity)]
                lines.append(f"  waits for {alert}: {states or 'inactive'}")
            lines += [f"  target {target}: {health.get(target, 'unknown')}" for target in scenario.targets]
            if scenario.watchdog_port is not None:  # what the watchdog says now: has it seen the freeze?
                lines.append(f"  its watchdog now: {_frozen_series(scrape(scenario.watchdog_port))}")
            lines.append(f"  stderr: {scenario.stderr[-2000:]}")
    return "\n".join(lines)


@needs_prometheus
def test_every_panel_shows_numbers_and_every_alert_fires_on_a_real_prometheus_with_the_shipped_settings(
    sshd, http_server, tmp_path
):
    """The shipped prometheus.yml (15 s scrapes and rule evaluation) and alerts.yaml (its `for` values),
    scraping the dash_*.py scenarios; each panel read as Grafana asks with one Instance value selected,
    which shows a host and its freeze watchdog together."""
    with tempfile.TemporaryDirectory(prefix="sw-") as sock_dir:  # short: unix socket paths are limited
        scenarios = {
            "freeze": Scenario("freeze", watchdog=True),
            "killed": Scenario("killed", watchdog=True),
            "wedge": Scenario("wedge"),
            "wedge_held": Scenario("wedge_held"),
            "cloud": Scenario("cloud"),
            "ssh": Scenario("ssh", sshd.user, sshd.host, str(sshd.port), str(sshd.identity), str(http_server),
                            sock_dir),
        }  # fmt: skip
        targets = {
            HOST_JOB: [s.host_target for s in scenarios.values()],
            WATCHDOG_JOB: [s.watchdog_target for s in scenarios.values() if s.watchdog_target],
        }
        prometheus = Prometheus.shipped(tmp_path, targets)
        assert (prometheus.scrape_interval, prometheus.evaluation_interval) == (15.0, 15.0)
        problems: list[str] = []
        try:
            for scenario in scenarios.values():
                scenario.start()
            for scenario in scenarios.values():
                scenario.wait_for("ready", 60)
            # A scrape before anything happens: the series stallwatch makes at zero, for rate() and increase().
            prometheus.wait_scraped_after([t for ts in targets.values() for t in ts], time.time(), timeout=60)
            for scenario in scenarios.values():
                scenario.go()
            start = min(s.started for s in scenarios.values()) - 60
            deadline = time.monotonic() + 300
            while not _release_what_prometheus_has_seen(prometheus, scenarios):
                for scenario in scenarios.values():
                    assert scenario.proc is not None
                    if scenario.proc.poll() is not None and not scenario.killed:
                        raise AssertionError(f"dash_{scenario.name}.py exited early:\n{scenario.stop()}")
                    watchdog = scenario.watchdog_pid
                    if watchdog and not scenario.killed and is_gone(watchdog):  # no alert of its can fire now
                        raise AssertionError(f"dash_{scenario.name}.py's freeze watchdog (pid {watchdog}) left "
                                             f"while its host runs:\n{scenario.stderr[-3000:]}")  # fmt: skip
                assert time.monotonic() < deadline, _stuck(prometheus, scenarios)
                time.sleep(0.5)
            # The last scrapes (what happened at the end) and the rule evaluations after them.
            last = max(max([s.done, *s.released.values()]) for s in scenarios.values())
            prometheus.wait_scraped_after([t for ts in targets.values() for t in ts], last, timeout=60)
            prometheus.wait_evaluated_after(time.time(), timeout=60)
            while not all(_reached(prometheus, name, scenarios, start) for name in ALERT_SCENARIOS):
                if time.monotonic() > deadline:
                    break  # reported below, alert by alert
                time.sleep(1)  # SpawnBlockedHigh: the spawn's duration is recorded when the freeze ends
            end = time.time()
            # Range queries evaluate at start + k * STEP <= end: with `start` on end's grid, the last point is
            # `end`, after the last scrapes. Off the grid, the last point could fall between the scrape that
            # carries the final values (an overrun recorded at the end) and `end`, and no point would see them.
            start = end - STEP * math.ceil((end - start) / STEP)
            problems += [p for p in (s.stop() for s in scenarios.values()) if p]

            checked: set[str] = set()
            positive: dict[str, bool] = {}
            for where, expr in promql():
                parsed = prometheus.api("query", query=concrete(expr, scenarios["freeze"], prometheus.scrape_interval))
                if parsed["status"] != "success":
                    problems.append(f"{where}: does not parse: {parsed.get('error')}\n  {expr}")
                    continue
                key = where.split(": ", 1)[-1]
                checked.add(key)
                if key.startswith("alert "):
                    name = key.removeprefix("alert ")
                    if not _reached(prometheus, name, scenarios, start, end):
                        problems.append(f"{where}: not {ALERT_SCENARIOS[name][1]} in its scenario")
                    continue
                scenario = scenarios[PANEL_SCENARIOS[key]]
                query = concrete(expr, scenario, prometheus.scrape_interval)
                result = prometheus.query_range(query, start, end, step=STEP)
                if key == "Scrapes answered (up)":
                    by_job = {series["metric"]["job"]: dict(series["values"]) for series in result}
                    host, watchdog = by_job.get(HOST_JOB, {}), by_job.get(WATCHDOG_JOB, {})
                    down = {at for at, value in host.items() if value == "0"}
                    if "1" not in host.values() or not any(watchdog.get(at) == "1" for at in down):
                        problems.append(f"{where}: no frozen host Down beside its watchdog Up, nor Up: {by_job}")
                elif not _finite(_numbers(result)):
                    problems.append(f"{where}: no number in dash_{scenario.name}.py: {result}\n  {query}")
                positive[key] = positive.get(key, False) or any(value > 0 for value in _finite(_numbers(result)))
                if key in ("Freezes by kind and cause", "Freeze duration p50/p99 by kind and cause",
                           "annotation Freezes"):  # fmt: skip
                    short = [s for s in result if s["metric"].get(FREEZE_KIND) == SHORT_FREEZE[0]]
                    if not any(value > 0 for value in _finite(_numbers(short))):
                        problems.append(f"{where}: the {SHORT_FREEZE[1]} s {SHORT_FREEZE[0]} freeze is missing")
            assert checked == set(PANEL_SCENARIOS) | {f"alert {name}" for name in ALERT_SCENARIOS}
            problems += [f"{key}: only zeros in dash_{PANEL_SCENARIOS[key]}.py" for key, seen in positive.items()
                         if not seen]  # fmt: skip
            problems += _durations_read_back(prometheus, scenarios["freeze"], start, end)

            services = prometheus.query_range("target_info", start, end)
            assert {s["metric"]["service_name"] for s in services} == {f"dash-{name}" for name in scenarios}
            freeze = scenarios["freeze"]
            watched = {(s["metric"]["job"], s["metric"]["service_instance_id"]) for s in services
                       if s["metric"]["service_name"] == "dash-freeze"}  # fmt: skip
            assert watched == {(HOST_JOB, freeze.identity), (WATCHDOG_JOB, freeze.identity)}
        finally:
            for scenario in scenarios.values():
                scenario.ensure_dead()
            prometheus.stop()
        assert not problems, "\n".join(problems)


def _durations_read_back(prometheus: Prometheus, freeze: Scenario, start: float, end: float) -> list[str]:
    """The freeze duration panel's p99 reads the length of the held GIL freeze (from when the test read that
    it was held to when it released it) and of the short loop block, from 20 % under to 30 % over: the p99
    of one observation reads near the upper bound of its bucket (at most 20 % wide), and the held time is
    measured from outside the host."""
    (expr,) = [e for where, e in promql() if where.endswith(": Freeze duration p50/p99 by kind and cause")][1:2]
    result = prometheus.query_range(concrete(expr, freeze, prometheus.scrape_interval), start, end, step=STEP)
    held = freeze.released["freeze"] - freeze.held["freeze"]
    problems = []
    for kind, seconds in (("gil_held", held), SHORT_FREEZE):
        read = _finite(_numbers([s for s in result if s["metric"].get(FREEZE_KIND) == kind]))
        if not read or not 0.8 * seconds <= max(read) <= 1.3 * seconds:
            problems.append(f"freeze duration p99 of the {seconds:.1f} s {kind} freeze reads {read[-3:]}")
    return problems
