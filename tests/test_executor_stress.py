"""incident 002's race, randomised and seeded (tests/scenarios/executor_stress.py): EOF or RST,
inject before or after the peer goes away. The incident's semantics wedge most trials; the
guard (default) and interrupt_thread() wedge none."""

from __future__ import annotations

import pytest

from conftest import clean_env, run_scenario

pytestmark = pytest.mark.matrix


def test_the_incident_semantics_wedge_the_pool():
    counts = run_scenario("executor_stress.py", "naive", "20", "1234", timeout=120)

    assert counts["wedged"] >= 5  # the control: the race is real on this interpreter
    assert counts["worker_died"] == counts["wedged"]


@pytest.mark.parametrize("run", ["replicated", "stock"])  # see worker._STOCK_RUN
@pytest.mark.parametrize("mode", ["guard", "api"])
def test_no_wedge_in_200_randomised_trials(mode, run):
    env = clean_env(STOCK_RUN="1" if run == "stock" else "0")
    counts = run_scenario("executor_stress.py", mode, "200", "1234", env=env, timeout=300)

    assert counts["rst_trials"] > 40 and counts["kill_first_trials"] > 40  # both orders, both closes
    assert counts["wedged"] == 0
    assert counts["worker_died"] == 0
