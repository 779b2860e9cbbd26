"""Issue 25 item 2: the exit-2 refusals of `dsforge bench`, `dsforge report` and `dsforge data`
have the project's form: where (the argument or field the user wrote, and its value), what is
wrong, and `Fix:` with something to do.

One test walks them. Its scope, honestly:
- every branch of the bench store's error translation (bench/store.py `Store.errors_as_refusals`,
  `unusable`), for each thing the store does (create, open, read, write) and as both commands
  open the database (bench: OUT/results.db, written; report: RESULTS, only read): sqlite's
  "not a database", a SQLite file without dsforge's table, sqlite's other errors, and an
  OSError for each errno the store tells apart plus one it does not;
- end to end through the command line, every exit-2 path of `dsforge bench` and
  `dsforge report` that needs no job: a results.db that is not a database, a folder or a file
  in the way of OUT or of the results database, OUT on a read-only file system (mkdir made to
  fail with EROFS: a test cannot mount one), OUT/cells blocked (bench/run.py's own
  BenchError), RESULTS that is garbage, an empty file or another program's SQLite file,
  report --out blocked, on a read-only file system, or with report.md a folder;
- a sample of study refusals (dsforge/problems.py Problems: missing base recipe, unknown axis,
  bad measure) and of `dsforge data prepare` / `data inspect` refusals (DataError), which have
  their own full tests in test_bench.py and test_data_prepare.py.
It does not walk: click's own usage errors (also exit 2: a missing argument, a STUDY or RESULTS
path that does not exist, a bad option value), whose wording is click's and has no `Fix:`;
refusals that need a job or a GPU; permission errors as such (these tests run as root, who may
write anything: the errno branch is walked directly instead); and exit statuses other than 2
(a locked database is 75 and says to run again, checked here only to be 75).
"""

from __future__ import annotations

import errno
import json
import pathlib
import re
import sqlite3

import pytest
from click.testing import CliRunner

from dsforge.bench import run as bench_run
from dsforge.bench.store import EXIT_TRY_AGAIN, Row, Store, StoreError, StoreLocked
from dsforge.cli import main
from dsforge.problems import EXIT_INVALID
from tests.conftest import REPO, TEMPEST

# `where='value': what. Fix: something` (DataError's and BenchError's form) or
# `[RULE] where=value: what. Fix: something` (a Problem's).
FORM = re.compile(r"(?P<where>[\w./-]+)=(?P<value>.+?): .+?\. Fix: \S.{8,}")


def _form_problem(text: str, where: str, value: str) -> str | None:
    """Why `text` lacks the form for `where` and `value` (a path the user wrote), or None."""
    for line in text.splitlines():
        match = FORM.search(line)
        if match and match["where"] == where and value in match["value"]:
            return None
    return f"no line of the form {where}={value!r}: ... Fix: ... in:\n{text}"


def _study(folder: pathlib.Path, axes: str = "{zero.stage: [0]}", steps: int = 2) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "tiny.yaml"
    recipe.write_text((REPO / "recipes" / "tiny.yaml").read_text())
    study = folder / "s.yaml"
    study.write_text(f"name: s\nrecipe: {recipe}\nworld_size: 2\nset: {{parallel.dp: 2}}\n"
                     f"measure: {{warmup_steps: 1, steps: {steps}}}\naxes: {axes}\n")
    return study


def _results(path: pathlib.Path) -> pathlib.Path:
    store = Store(path)
    store.write(Row(study="s", cell="c", repeat=0, axes={"zero.stage": 0}, status="crashed",
                    reason="x"))
    store.close()
    return path


def _read_only_below(monkeypatch, root: pathlib.Path) -> None:
    """Path.mkdir below `root` fails as on a read-only file system."""
    mkdir = pathlib.Path.mkdir

    def refuse(self, *args, **kwargs):
        if self == root or root in self.parents:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)


def _store_branches(tmp_path) -> list[tuple[str, str, int, str, str]]:
    """(case, message, exit code, where, value) for every branch of Store.errors_as_refusals."""
    raised = {"not a database": sqlite3.DatabaseError("file is not a database"),
              "another program's file": sqlite3.OperationalError("no such table: results"),
              "sqlite cannot open": sqlite3.OperationalError("unable to open database file"),
              "sqlite I/O": sqlite3.OperationalError("disk I/O error"),
              **{f"OSError {errno.errorcode[code]}": OSError(code, f"strerror {code}")
                 for code in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC,
                              errno.ENOTDIR, errno.EISDIR, errno.EIO)}}
    cases = []
    for argument, read_only in (("OUT/results.db", False), ("RESULTS", True)):
        store = Store(_results(tmp_path / f"{argument.replace('/', '-')}.db"), argument=argument,
                      read_only=read_only)
        for doing in ("cannot create the results database", "cannot open the results database",
                      "cannot read the results database", "cannot write to the results database"):
            for name, exc in raised.items():
                with pytest.raises(StoreError) as info, store.errors_as_refusals(doing):
                    raise exc
                cases.append((f"store as {argument}, {doing}, {name}", str(info.value),
                              info.value.exit_code, argument, str(store.path)))
        with pytest.raises(StoreLocked) as locked, store.errors_as_refusals("x"):
            raise sqlite3.OperationalError("database is locked")
        assert locked.value.exit_code == EXIT_TRY_AGAIN  # not exit 2: run again later
        store.close()
    return cases


def test_every_exit_2_refusal_names_where_and_a_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_run, "launch_cell", lambda *a, **k: pytest.fail("no job may start"))
    runner = CliRunner()
    cases = _store_branches(tmp_path)

    def command(case, args, where, value):
        result = runner.invoke(main, [str(a) for a in args])
        cases.append((case, result.output, result.exit_code, where, str(value)))

    # dsforge bench
    study = _study(tmp_path)
    garbage = tmp_path / "garbage" / "results.db"
    garbage.parent.mkdir()
    garbage.write_bytes(b"not sqlite " * 100)
    command("bench: OUT/results.db is not a database", ["bench", study, "--out", garbage.parent],
            "OUT/results.db", garbage)
    folder_db = tmp_path / "folder" / "results.db"
    folder_db.mkdir(parents=True)
    command("bench: OUT/results.db is a folder", ["bench", study, "--out", folder_db.parent],
            "OUT/results.db", folder_db)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be\n")
    command("bench: a file in the way of OUT", ["bench", study, "--out", blocker / "out"],
            "OUT/results.db", blocker / "out")
    cells = tmp_path / "cells-blocked"
    cells.mkdir()
    (cells / "cells").write_text("a file where the cells' folder should be\n")
    command("bench: OUT/cells blocked (bench/run.py)", ["bench", study, "--out", cells], "--out",
            cells)
    read_only = tmp_path / "read-only"
    with monkeypatch.context() as patch:
        _read_only_below(patch, read_only)
        command("bench: OUT on a read-only file system", ["bench", study, "--out", read_only / "o"],
                "OUT/results.db", read_only / "o")
    missing_recipe = _study(tmp_path / "missing-recipe")
    (missing_recipe.parent / "tiny.yaml").unlink()
    command("bench: study whose base recipe is missing", ["bench", missing_recipe, "--out",
            tmp_path / "never"], "recipe", missing_recipe.parent / "tiny.yaml")
    command("bench: study with an unknown axis", ["bench", _study(tmp_path / "axis", axes="{zero.stag: [0]}"),
            "--out", tmp_path / "never"], "zero.stag", "0")
    command("bench: study measuring no step", ["bench", _study(tmp_path / "steps", steps=0),
            "--out", tmp_path / "never"], "measure.steps", "0")

    # dsforge report
    command("report: RESULTS is not a database", ["report", garbage], "RESULTS", garbage)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    command("report: RESULTS is an empty file", ["report", empty], "RESULTS", empty)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE notes (x)").connection.close()
    command("report: RESULTS is another program's SQLite file", ["report", other], "RESULTS", other)
    results = _results(tmp_path / "results" / "results.db")
    command("report: a file in the way of --out", ["report", results, "--out", blocker / "rep"],
            "--out", blocker / "rep")
    report_md = tmp_path / "md-folder"
    (report_md / "report.md").mkdir(parents=True)
    command("report: report.md is a folder", ["report", results, "--out", report_md], "--out",
            report_md)
    with monkeypatch.context() as patch:
        _read_only_below(patch, read_only)
        command("report: --out on a read-only file system",
                ["report", results, "--out", read_only / "rep"], "--out", read_only / "rep")

    # dsforge data (DataError; fully tested in test_data_prepare.py)
    corpus = tmp_path / "d.jsonl"
    corpus.write_text(json.dumps({"text": "a"}) + "\n")
    command("data prepare: missing tokenizer",
            ["data", "prepare", corpus, "--tokenizer", tmp_path / "tok.json", "--output",
             tmp_path / "p"], "--tokenizer", tmp_path / "tok.json")
    command("data prepare: missing input",
            ["data", "prepare", tmp_path / "none.jsonl", "--tokenizer", "bytes", "--output",
             tmp_path / "p"], "INPUT", tmp_path / "none.jsonl")
    runner.invoke(main, ["data", "prepare", str(TEMPEST), "--tokenizer", "bytes", "--output",
                         str(tmp_path / "p")])
    command("data prepare: output exists",
            ["data", "prepare", TEMPEST, "--tokenizer", "bytes", "--output", tmp_path / "p"],
            "--output", tmp_path / "p")
    command("data inspect: missing prefix", ["data", "inspect", tmp_path / "nope"], "PREFIX",
            tmp_path / "nope")

    failures = []
    for case, text, code, where, value in cases:
        if code != EXIT_INVALID:
            failures.append(f"{case}: exit {code}, not {EXIT_INVALID}:\n{text}")
        elif problem := _form_problem(text, where, value):
            failures.append(f"{case}: {problem}")
    assert not failures, f"{len(failures)} of {len(cases)} refusals lack the form:\n\n" + \
        "\n\n".join(failures)
    assert len(cases) > 80  # the walk ran (store branches x 2 openers x 4 actions, and commands)
