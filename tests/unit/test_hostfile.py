"""Hostfile parsing (rules H1-H3) and forwarded variable names (H4)."""

from __future__ import annotations

import pytest

from dsforge.launch.env import check_names
from dsforge.launch.hostfile import parse_hostfile, read_hostfile
from dsforge.problems import RecipeError
from tests.conftest import HOSTFILES, rule_ids


def test_parses_hosts_slots_and_comments():
    hf = parse_hostfile(["# cluster", "", "node-1 slots=8  # first", "10.0.0.2 slots=4"])
    assert hf.hosts == (("node-1", 8), ("10.0.0.2", 4))
    assert hf.total_slots == 12 and hf.node_slots == (8, 4)


@pytest.mark.parametrize("line, rule", [
    ("node-1", "H1"),
    ("node-1 slots=", "H1"),
    ("node-1 slots=0", "H1"),
    ("node-1 slots=two", "H1"),
    ("node-1 slots=\u00b2", "H1"),
    ("node-1 slots=8 extra", "H1"),
    ("node-1 gpus=8", "H1"),
    ("-oProxyCommand=evil slots=8", "H2"),
    ("node;rm slots=8", "H2"),
    ("$(whoami) slots=8", "H2"),
    ("`id` slots=8", "H2"),
])
def test_bad_lines_are_rejected(line, rule):
    with pytest.raises(RecipeError) as info:
        parse_hostfile([line])
    assert rule_ids(info.value) == {rule} and "<hostfile>:1" in str(info.value)


def test_duplicates_and_every_bad_line_reported_together():
    with pytest.raises(RecipeError) as info:
        parse_hostfile(["a slots=2", "bad", "a slots=2", "-x slots=1"])
    assert [p.rule for p in info.value.problems] == ["H1", "H1", "H2"]
    assert "duplicate host (first on line 1)" in str(info.value)


def test_empty_hostfile_is_an_error():
    with pytest.raises(RecipeError, match="no hosts"):
        parse_hostfile(["# nothing here"])


def test_missing_hostfile_is_an_error_not_a_local_fallback(tmp_path):
    with pytest.raises(RecipeError) as info:
        read_hostfile(tmp_path / "missing")
    assert rule_ids(info.value) == {"H3"} and "never falls back" in str(info.value)


@pytest.mark.parametrize("path", HOSTFILES, ids=[p.name for p in HOSTFILES])
def test_shipped_hostfiles_parse(path):
    assert read_hostfile(path).total_slots >= 1


@pytest.mark.parametrize("name", ["1A", "A-B", "A B", "A;id", ""])
def test_invalid_variable_names_are_rejected(name):
    with pytest.raises(RecipeError) as info:
        check_names({name: "x"})
    assert rule_ids(info.value) == {"H4"}
