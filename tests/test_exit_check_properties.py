"""Property tests of the exit check (hypothesis, which the matrix environments lack; the end-to-end and
corpus tests of the exit check are in test_exit_check.py, matrix-marked): a random token in a string a
careless wrapper recorded is caught, by the scrubber's detector and through a host's own providers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.core.scrub import scrub_attributes, scrub_value
from support.host_providers import by_scope, run_host_providers
from support.tokens import command_lines


@settings(max_examples=300, deadline=None)
@given(command_lines())
def test_a_random_token_in_a_recorded_string_is_caught_at_the_exit(case):
    argv, shell, token = case
    for value in (shell, " ".join(argv[1:]), f"spawn failed: {shell}"):
        assert token not in scrub_value(value), value
    assert token not in str(scrub_attributes({"stallwatch.args": argv})["stallwatch.args"])


@settings(max_examples=3, deadline=None)
@given(st.lists(command_lines(), min_size=40, max_size=40))
def test_with_the_hosts_providers_random_tokens_in_recorded_strings_are_caught_at_the_exit(tmp_path_factory, batch):
    cases = [(shell, argv) for argv, shell, _ in batch]
    exported = run_host_providers(tmp_path_factory.mktemp("host"), cases)
    ours, theirs = by_scope(exported)
    assert [token for _, _, token in batch if token in ours] == []
    assert [token for _, _, token in batch if token not in theirs] == []
