"""The generated dashboards (dashboards/json/*.json) are valid against the Grafana Foundation SDK's
dashboard JSON schema for the pinned release's Grafana 11.6 flavour. The schema is vendored in
dashboards/schema/ (see its README for where it comes from)."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (the test extras)")

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "dashboards" / "schema" / "dashboard.jsonschema.json"
# grafana/grafana-foundation-sdk jsonschema/dashboard.jsonschema.json @ ed3c39a6 (11.6 branch)
SCHEMA_SHA256 = "183fdeac0a3327ca74a69eef088f9b7f3423529768c9e96d8703f8f78be70e8e"
DASHBOARD_FILES = sorted((ROOT / "dashboards" / "json").glob("*.json"))


@pytest.fixture(scope="module")
def validator() -> Any:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _leaves(error: Any) -> Iterator[Any]:
    """The innermost errors: an anyOf failure (Panel or RowPanel) carries the real reasons in its context."""
    if not error.context:
        yield error
    for sub in error.context:
        yield from _leaves(sub)


def _errors(validator: Any, document: dict) -> list[str]:
    errors = sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    lines = []
    for error in errors:
        lines.append(f"/{'/'.join(map(str, error.absolute_path))}: {error.message[:300]}")
        if error.context:
            lines += [f"    /{'/'.join(map(str, leaf.absolute_path))}: {leaf.message[:300]}" for leaf in _leaves(error)]
    return lines


def test_vendored_schema_is_the_pinned_11_6_flavour() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256, (
        "dashboards/schema/dashboard.jsonschema.json changed: update its README and SCHEMA_SHA256"
    )
    definitions = json.loads(SCHEMA.read_text(encoding="utf-8"))["definitions"]
    assert definitions["Dashboard"]["properties"]["schemaVersion"]["default"] == 41
    assert "preload" in definitions["Dashboard"]["properties"]
    assert "quick_ranges" in definitions["TimePickerConfig"]["properties"]
    assert "expr" in definitions["AnnotationQuery"]["properties"]
    assert "allowCustomValue" in definitions["VariableModel"]["properties"]


def test_there_are_dashboards_to_validate() -> None:
    assert {path.name for path in DASHBOARD_FILES} >= {"freezes.json", "wedges.json", "cloud-calls.json"}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda path: path.name)
def test_dashboard_matches_schema(validator: Any, path: Path) -> None:
    dashboard = json.loads(path.read_text(encoding="utf-8"))
    assert dashboard.get("panels"), f"{path.name} has no panels"
    errors = _errors(validator, dashboard)
    assert not errors, f"{path.name}: {len(errors)} schema errors:\n" + "\n".join(errors)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda path: path.name)
def test_schema_rejects_broken_copies(validator: Any, path: Path) -> None:
    """The validation is not vacuous: broken copies of each dashboard fail, at the broken place."""
    dashboard = json.loads(path.read_text(encoding="utf-8"))

    bad_grid = copy.deepcopy(dashboard)
    bad_grid["panels"][0]["gridPos"] = "x"
    leaves = [leaf for error in validator.iter_errors(bad_grid) for leaf in _leaves(error)]
    assert any(list(leaf.absolute_path) == ["panels", 0, "gridPos"] for leaf in leaves), _errors(validator, bad_grid)

    unknown_field = copy.deepcopy(dashboard)
    unknown_field["panels"][-1]["notAPanelField"] = True
    assert _errors(validator, unknown_field)

    bad_variable = copy.deepcopy(dashboard)
    bad_variable["templating"]["list"].append({"type": "not-a-variable-type", "name": "x"})
    assert _errors(validator, bad_variable)

    no_annotations = copy.deepcopy(dashboard)
    del no_annotations["annotations"]
    assert any("'annotations' is a required property" in line for line in _errors(validator, no_annotations))
