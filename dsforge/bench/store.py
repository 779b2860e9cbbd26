"""Bench results in SQLite: one row per cell and repeat, written when that repeat ends.

Each row is committed in its own transaction (WAL journal, synchronous=FULL), so a crash of
the bench loses at most the cell in flight, and a re-run finds every finished row.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def status(self, study: str, cell: str, repeat: int) -> str | None:
        row = self.db.execute("SELECT status FROM results WHERE study=? AND cell=? AND repeat=?",
                              (study, cell, repeat)).fetchone()
        return row[0] if row else None

    def write(self, row: Row) -> None:
        with self.db:  # one transaction per row
            self.db.execute(
                "INSERT OR REPLACE INTO results VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (row.study, row.cell, row.repeat, json.dumps(row.axes), row.status, row.reason,
                 time.time(), row.seconds, row.recipe, _json(row.manifest), _json(row.figures),
                 _json(row.prediction)))

    def rows(self, study: str | None = None) -> list[Row]:
        query = "SELECT study, cell, repeat, axes, status, reason, seconds, recipe, manifest, " \
                "figures, prediction FROM results"
        args: tuple = ()
        if study:
            query, args = query + " WHERE study=?", (study,)
        return [Row(study=r[0], cell=r[1], repeat=r[2], axes=json.loads(r[3]), status=r[4],
                    reason=r[5], seconds=r[6], recipe=r[7], manifest=_load(r[8]),
                    figures=_load(r[9]), prediction=_load(r[10]))
                for r in self.db.execute(query + " ORDER BY rowid", args)]


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)
