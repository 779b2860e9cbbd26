"""Hostfile parsing (rules H1-H3) and forwarded variable names (H4)."""

from __future__ import annotations

import pytest

from dsforge.job.word import check_names
from dsforge.problems import RecipeError, print_problems
from dsforge.recipe.hostfile import parse_hostfile, read_hostfile
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


def test_a_non_utf8_hostfile_is_an_error_naming_it(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"node-1 slots=8\nn\xf6de-2 slots=8\n")
    with pytest.raises(RecipeError) as info:
        read_hostfile(path)
    (problem,) = info.value.problems
    assert problem.rule == "H3" and problem.fields == {"hostfile": str(path)}
    assert "not UTF-8 text (byte 0xf6 on line 2)" in problem.message


def test_a_directory_is_not_a_hostfile(tmp_path):
    with pytest.raises(RecipeError, match="is a directory"):
        read_hostfile(tmp_path)


@pytest.mark.parametrize("slots", ["1" + "0" * 5000, "65537", "99999999999"])
def test_slots_beyond_the_limit_are_rejected(slots):
    with pytest.raises(RecipeError) as info:
        parse_hostfile([f"node-1 slots={slots}"])
    assert rule_ids(info.value) == {"H1"} and "from 1 to 65,536" in str(info.value)


def test_ten_thousand_bad_lines_print_twenty_problems_and_a_count(capsys):
    with pytest.raises(RecipeError) as info:
        parse_hostfile(["bad line"] * 10_000)
    assert len(info.value.problems) == 10_000
    assert str(info.value).splitlines()[-1] == "... and 9980 more"
    print_problems("hosts", info.value.problems)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "hosts: 10000 errors" and lines[-1] == "  ... and 9980 more"
    assert len(lines) == 22
