"""The README's configuration table, telemetry reference and Sentry events are generated from
`config.OPTIONS` and `telemetry.py`; this test fails when they drift. Regenerate with
`UPDATE_README=1 python -m pytest tests/test_readme.py`."""

from __future__ import annotations

import os
import re
from dataclasses import fields
from pathlib import Path

import pytest

from stallwatch import config, telemetry

README = Path(__file__).parent.parent / "README.md"
SECTIONS = {
    "settings": config.reference_markdown,
    "telemetry": telemetry.reference_markdown,
    "sentry": telemetry.sentry_markdown,
}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_readme_section_matches_its_source(section):
    text = README.read_text()
    pattern = re.compile(rf"(<!-- BEGIN {section} -->\n)(.*?)(<!-- END {section} -->)", re.S)
    match = pattern.search(text)
    assert match, f"README.md has no <!-- BEGIN {section} --> ... <!-- END {section} --> block"
    expected = SECTIONS[section]()
    if os.environ.get("UPDATE_README") == "1":
        README.write_text(pattern.sub(lambda m: m.group(1) + expected + m.group(3), text))
        return
    assert match.group(2) == expected, "README is stale: run UPDATE_README=1 python -m pytest tests/test_readme.py"


def test_every_setting_field_is_documented():
    documented = {option.keyword for option in config.OPTIONS if option.keyword}
    settable = set(config.KEYWORDS) - {"signal_protocols"}
    assert set(config.KEYWORDS) == {f.name for f in fields(config.Settings)} - {"problems"}
    assert settable == documented


def test_readme_shows_the_two_setup_commands_and_ci_runs_the_test_command():
    text = README.read_text()
    assert "stallwatch demo" in text
    assert "bash tests/run.sh" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash tests/run.sh" in ci
