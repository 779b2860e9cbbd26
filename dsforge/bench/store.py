"""Bench results in SQLite: one row per cell and repeat, written when that repeat ends.

Each row is committed in its own transaction (WAL journal, synchronous=FULL), so a crash of
the bench loses at most the cell in flight, and a re-run finds every finished row. While
another process holds the write lock, a write waits up to DB_TIMEOUT_S and then raises
StoreLocked (the bench keeps each result in its cell directory first, bench/run.py). A file
that is not a results database, or one that cannot be created or written, is a StoreError
naming the path.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.problems import EXIT_INVALID

# How long a read or write waits for another process's lock on the database, in seconds.
DB_TIMEOUT_S = 60.0
# The exit status for "nothing is lost, run it again later" (BSD EX_TEMPFAIL).
EXIT_TRY_AGAIN = 75


class BenchError(Exception):
    """A results database or output directory that cannot be used; the message names it."""

    exit_code = EXIT_INVALID


class StoreError(BenchError):
    pass


class StoreLocked(StoreError):
    """Another process held the database's lock for longer than the timeout."""

    exit_code = EXIT_TRY_AGAIN

SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    study TEXT NOT NULL,
    cell TEXT NOT NULL,           -- Cell.key
    repeat INTEGER NOT NULL,
    axes TEXT NOT NULL,           -- JSON: the cell's axis values
    status TEXT NOT NULL,         -- ok | oom | timeout | crashed | rejected
    reason TEXT,                  -- why, for anything but ok
    finished REAL NOT NULL,       -- unix time
    seconds REAL,                 -- wall time of the repeat
    recipe TEXT,                  -- resolved recipe (YAML)
    manifest TEXT,                -- JSON: versions, git commit, device, layout
    figures TEXT,                 -- JSON: measured figures (see bench/run.py)
    prediction TEXT,              -- JSON: dsforge plan's memory and bubble for the cell
    PRIMARY KEY (study, cell, repeat)
)
"""

FAILED = ("oom", "timeout", "crashed")


@dataclass(frozen=True, kw_only=True)
class Row:
    study: str
    cell: str
    repeat: int
    axes: dict[str, Any]
    status: str
    reason: str | None = None
    seconds: float | None = None
    recipe: str | None = None
    manifest: dict | None = None
    figures: dict | None = None
    prediction: dict | None = None
    finished: float | None = None  # unix time the repeat ended; the store's write time if None


_COLUMNS = "study, cell, repeat, axes, status, reason, seconds, recipe, manifest, figures, " \
           "prediction, finished"


class Store:
    def __init__(self, path: str | Path, *, timeout_s: float | None = None):
        self.path = Path(path)
        self.timeout_s = DB_TIMEOUT_S if timeout_s is None else timeout_s
        with self._errors("cannot create"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._errors("cannot open"):
            self.db = sqlite3.connect(self.path, timeout=self.timeout_s)
        try:
            with self._errors("cannot open"):
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=FULL")
                with self.db:
                    self.db.execute(SCHEMA)
        except StoreError:
            self.db.close()
            raise

    def close(self) -> None:
        self.db.close()

    def status(self, study: str, cell: str, repeat: int) -> str | None:
        row = self.get(study, cell, repeat)
        return row.status if row else None

    def get(self, study: str, cell: str, repeat: int) -> Row | None:
        with self._errors("cannot read"):
            found = self.db.execute(f"SELECT {_COLUMNS} FROM results WHERE study=? AND cell=? "
                                    "AND repeat=?", (study, cell, repeat)).fetchone()
        return _row(found) if found else None

    def write(self, row: Row) -> None:
        """Commit `row` in its own transaction; waits up to `timeout_s` for another process's
        lock (sqlite's busy wait, then retries until the same deadline), then StoreLocked."""
        values = (row.study, row.cell, row.repeat, json.dumps(row.axes), row.status, row.reason,
                  row.finished or time.time(), row.seconds, row.recipe, _json(row.manifest),
                  _json(row.figures), _json(row.prediction))
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                with self._errors("cannot write to"), self.db:  # one transaction per row
                    self.db.execute("INSERT OR REPLACE INTO results VALUES "
                                    "(?,?,?,?,?,?,?,?,?,?,?,?)", values)
                return
            except StoreLocked:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def rows(self, study: str | None = None) -> list[Row]:
        query, args = f"SELECT {_COLUMNS} FROM results", ()
        if study:
            query, args = query + " WHERE study=?", (study,)
        with self._errors("cannot read"):
            return [_row(r) for r in self.db.execute(query + " ORDER BY rowid", args).fetchall()]

    @contextlib.contextmanager
    def _errors(self, doing: str):
        """sqlite's and the file system's errors as StoreError naming the database."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreLocked(f"{self.path}: another process held the database's lock for "
                                  f"more than {self.timeout_s:g}s ({exc})") from None
            raise StoreError(f"{self.path}: {doing} the results database: {exc}") from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: not a usable results database ({exc}); move it "
                             "away or choose another --out") from None
        except OSError as exc:
            raise StoreError(f"{self.path}: {doing} the results database: "
                             f"{exc.strerror or exc}") from None


def _row(r: tuple) -> Row:
    return Row(study=r[0], cell=r[1], repeat=r[2], axes=json.loads(r[3]), status=r[4],
               reason=r[5], seconds=r[6], recipe=r[7], manifest=_load(r[8]),
               figures=_load(r[9]), prediction=_load(r[10]), finished=r[11])


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)
