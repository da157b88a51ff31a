"""`stallwatch --help` and each command's `--help`, as a user reads them from the installed command:
every command has a description and examples, in user terms, not the Python API's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stallwatch import cli

STALLWATCH = str(Path(sys.executable).parent / "stallwatch")  # the console script next to the interpreter
COMMANDS = sorted(next(a for a in cli.build_parser()._actions if a.dest == "command").choices)


def _help(*command: str) -> str:
    proc = subprocess.run([STALLWATCH, *command, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _description(text: str) -> str:
    """The paragraph(s) between the usage lines and the first option list."""
    after_usage = text.split("\n\n", 1)[1]
    return re.split(r"^(?:options|positional arguments):$", after_usage, maxsplit=1, flags=re.M)[0].strip()


def test_the_commands_are_the_five_a_user_is_told_about():
    assert COMMANDS == ["demo", "doctor", "leaks", "postmortem", "run"]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_has_a_description_and_examples_of_that_command(command):
    text = _help(command)
    assert len(_description(text).split()) >= 15, text
    examples = text.split("\nexamples:\n", 1)
    assert len(examples) == 2, f"stallwatch {command} --help has no examples section"
    assert re.search(rf"^  (\S+=\S+ )*stallwatch {command}\b", examples[1], re.M), examples[1]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_each_command_is_described(command):
    parser = next(a for a in cli.build_parser()._actions if a.dest == "command").choices[command]
    undescribed = [a.option_strings for a in parser._actions if a.help is None and a.option_strings]
    assert not undescribed


def test_the_top_level_help_says_the_demo_replays_both_incidents_and_shows_an_example_per_command():
    text = _help()
    demo_line = re.search(r"^    demo\s+(.+(?:\n\s{6,}.+)*)", text, re.M)
    assert demo_line and "both incidents" in " ".join(demo_line.group(1).split())
    assert "incident-000" not in text
    for command in COMMANDS:
        assert re.search(rf"^  stallwatch {command}\b", text, re.M), f"no example of stallwatch {command}"


def test_the_doctor_help_speaks_of_the_command_not_of_the_python_function():
    text = _help("doctor")
    for api_wording in ("probe=", "journal`", "check_journal", "()", "`"):
        assert api_wording not in _description(text), api_wording
