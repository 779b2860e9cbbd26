"""Bench results in SQLite: one row per cell and repeat, written when that repeat ends.

Each row is committed in its own transaction (WAL journal, synchronous=FULL), so a crash of
the bench loses at most the cell in flight, and a re-run finds every finished row. While
another process holds the database's lock, every read and write waits for it up to the store's
timeout (DB_TIMEOUT_S unless told: dsforge bench waits as long as its study's cells may run, or
--db-timeout, bench/run.py), telling `waiting` when the wait starts, every WAIT_NOTICE_S and
when the lock goes; then it raises StoreLocked, exit 75 (the bench keeps each result in its
cell directory first, bench/run.py). A file that is not a results database, or one that cannot
be created or written, is a StoreError in the form of every dsforge refusal: what the user
named and its value (OUT/results.db or RESULTS, the path), what is wrong, and `Fix:` (a file or
folder in the way, a read-only file system, permissions and a full disk each have their own).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsforge.problems import EXIT_INVALID

# How long a read or write waits for another process's lock on the database, in seconds, unless
# the store is given its own timeout.
DB_TIMEOUT_S = 60.0
# While waiting for the lock, the store says so at once and again every WAIT_NOTICE_S seconds.
WAIT_NOTICE_S = 30.0
# sqlite's own busy wait per try; the store tries again until its timeout has passed.
BUSY_SLICE_S = 0.1
# The exit status for "nothing is lost, run it again later" (BSD EX_TEMPFAIL).
EXIT_TRY_AGAIN = 75


class BenchError(Exception):
    """A results database or output directory that cannot be used, as every dsforge refusal:
    `argument` what the user named (RESULTS, --out, OUT/results.db), `value` its path,
    `message` what is wrong, `fix` what to do. A message alone (its text names the path) gets
    GENERIC_FIX."""

    exit_code = EXIT_INVALID
    GENERIC_FIX = ("check that the path is a folder this user can write, on a writable file "
                   "system with free space, or give another --out")

    def __init__(self, message: str, *, argument: str | None = None, value=None,
                 fix: str | None = None):
        self.argument, self.value, self.message = argument, value, message
        self.fix = self.GENERIC_FIX if fix is None else fix
        text = f"{argument}={str(value)!r}: {message}" if argument else message
        super().__init__(f"{text}. Fix: {self.fix}" if self.fix else text)


class StoreError(BenchError):
    pass


class StoreLocked(StoreError):
    """Another process held the database's lock for longer than the store's timeout; the
    database is fine and the command can run again later (EXIT_TRY_AGAIN)."""

    exit_code = EXIT_TRY_AGAIN


def unusable(argument: str, path: Path, doing: str, exc: BaseException, *, elsewhere: str,
             writable_elsewhere: str | None = None, folder: bool = False, reading: bool = False,
             cls: type[BenchError] = BenchError) -> BenchError:
    """`path` (a file, or with `folder` a folder, that the user named as `argument`) cannot be
    used: `doing` failed with `exc` (an OSError or sqlite's error). The fix follows the cause:
    a file or folder in the way, a read-only file system, permissions (to read, with
    `reading`), a full disk; else `elsewhere` (e.g. "give another --out") with what to check.
    `writable_elsewhere`: the fix for a read-only file system [`elsewhere` on a writable one]."""
    detail = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
    if isinstance(exc, OSError) and exc.filename and Path(exc.filename) != path:
        detail += f" ({exc.filename})"
    code = exc.errno if isinstance(exc, OSError) else None
    blocker = None if reading else _in_the_way(path, folder=folder)
    if blocker is None and code == errno.EISDIR and exc.filename:  # a folder where a file goes
        blocker = Path(exc.filename)
    existing = _nearest_existing(path)
    if blocker is not None:
        reason = f"{'a folder' if blocker.is_dir() else 'a file'} is in the way: {blocker}"
        fix = f"move {blocker} away, or {elsewhere}"
    elif reading and not os.access(existing, os.R_OK):
        reason = f"this user may not read {existing}"
        fix = f"make {existing} readable for this user (chmod u+r), or {elsewhere}"
    elif code == errno.EROFS or _read_only_fs(existing):
        reason = None if code == errno.EROFS else f"{existing} is on a read-only file system"
        fix = writable_elsewhere or f"{elsewhere} on a writable file system"
    elif code in (errno.EACCES, errno.EPERM) or (code is None and not os.access(existing, os.W_OK)):
        reason = f"this user may not write {existing}"
        fix = f"make {existing} writable for this user (chmod u+w), or {elsewhere}"
    elif code in (errno.ENOSPC, errno.EDQUOT):
        reason = f"the file system of {existing} is full"
        fix = f"free space there, or {elsewhere}"
    else:
        reason = None
        fix = (f"check that {existing} can be {'read' if reading else 'written'} (permissions"
               f"{'' if reading else ', free space'}), or {elsewhere}")
    return cls(f"{doing}: {detail}" + (f"; {reason}" if reason else ""), argument=argument,
               value=path, fix=fix)


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path("/")


def _in_the_way(path: Path, *, folder: bool) -> Path | None:
    """What blocks creating `path`: a file where one of its folders should be, or at `path`
    a folder where a file should be (or a file where a folder should be)."""
    for parent in reversed(path.parents):
        if os.path.lexists(parent) and not parent.is_dir():
            return parent
    if os.path.lexists(path) and path.is_dir() != folder:
        return path
    return None


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    study TEXT NOT NULL,
    cell TEXT NOT NULL,           -- Cell.key
    repeat INTEGER NOT NULL,
    axes TEXT NOT NULL,           -- JSON: the cell's axis values
    status TEXT NOT NULL,         -- ok | oom | timeout | crashed | diverged | rejected
    reason TEXT,                  -- why, for anything but ok
    finished REAL NOT NULL,       -- unix time
    seconds REAL,                 -- wall time of the repeat
    recipe TEXT,                  -- resolved recipe (YAML)
    manifest TEXT,                -- JSON: versions, git commit, device, layout
    figures TEXT,                 -- JSON: measured figures (see bench/run.py)
    prediction TEXT,              -- JSON: the planner's memory, bubble, FLOPs, step time
    PRIMARY KEY (study, cell, repeat)
)
"""

FAILED = ("oom", "timeout", "crashed", "diverged")


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
    """`argument`: what the user named the database as, for refusals (bench: OUT/results.db;
    report: RESULTS). `read_only` (report): opened without writing anything, and a database
    without dsforge's results table is refused. `timeout_s`: how long each read or write waits
    for another process's lock; `waiting` hears one line when a wait starts, every
    WAIT_NOTICE_S while it lasts, and when the lock goes."""

    def __init__(self, path: str | Path, *, timeout_s: float | None = None,
                 argument: str = "OUT/results.db", read_only: bool = False,
                 waiting: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.timeout_s = DB_TIMEOUT_S if timeout_s is None else timeout_s
        self.argument, self.read_only, self.waiting = argument, read_only, waiting
        busy_s = min(self.timeout_s, BUSY_SLICE_S)  # sqlite's wait; _waiting tries again
        # A reader of a WAL database writes its -shm file beside it (sqlite's WAL mode).
        self._elsewhere = ("copy it (and its -wal file) to a folder this user can write and "
                           "name the copy" if read_only else "give another --out")
        if read_only:
            uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=ro"
            with self.errors_as_refusals("cannot open"):
                self.db = sqlite3.connect(uri, uri=True, timeout=busy_s)
            try:
                self._waiting("cannot read", lambda: self.db.execute(
                    "SELECT study FROM results LIMIT 0"))
            except StoreError:
                self.db.close()
                raise
            return
        with self.errors_as_refusals("cannot create the results database"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.errors_as_refusals("cannot open the results database"):
            self.db = sqlite3.connect(self.path, timeout=busy_s)
        try:
            self._waiting("cannot open the results database", self._prepare)
        except StoreError:
            self.db.close()
            raise

    def _prepare(self) -> None:
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        with self.db:
            self.db.execute(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def status(self, study: str, cell: str, repeat: int) -> str | None:
        row = self.get(study, cell, repeat)
        return row.status if row else None

    def get(self, study: str, cell: str, repeat: int) -> Row | None:
        found = self._waiting("cannot read the results database", lambda: self.db.execute(
            f"SELECT {_COLUMNS} FROM results WHERE study=? AND cell=? AND repeat=?",
            (study, cell, repeat)).fetchone())
        return _row(found) if found else None

    def write(self, row: Row) -> None:
        """Commit `row` in its own transaction; waits up to `timeout_s` for another process's
        lock (_waiting), then StoreLocked."""
        values = (row.study, row.cell, row.repeat, json.dumps(row.axes), row.status, row.reason,
                  row.finished or time.time(), row.seconds, row.recipe, _json(row.manifest),
                  _json(row.figures), _json(row.prediction))

        def insert() -> None:
            with self.db:  # one transaction per row
                self.db.execute("INSERT OR REPLACE INTO results VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                                values)

        self._waiting("cannot write to the results database", insert)

    def rows(self, study: str | None = None) -> list[Row]:
        query, args = f"SELECT {_COLUMNS} FROM results", ()
        if study:
            query, args = query + " WHERE study=?", (study,)
        found = self._waiting("cannot read the results database", lambda: self.db.execute(
            query + " ORDER BY rowid", args).fetchall())
        return [_row(r) for r in found]

    def _waiting(self, doing: str, action: Callable[[], Any]) -> Any:
        """`action()`, tried again while another process holds the database's lock (sqlite's
        busy wait of BUSY_SLICE_S each time) until `timeout_s` has passed, then StoreLocked;
        `waiting` hears that it waits, every WAIT_NOTICE_S how long, and when the lock goes.
        Any other error as errors_as_refusals says."""
        started, told, path = time.monotonic(), None, self.path
        while True:
            try:
                with self.errors_as_refusals(doing):
                    result = action()
            except StoreLocked:
                waited = time.monotonic() - started
                if waited >= self.timeout_s:
                    raise
                if told is None:
                    told = waited
                    self._say(f"waiting for the lock on {path}: another process holds it; "
                              f"waiting up to {duration(self.timeout_s)} for it to go")
                elif waited - told >= WAIT_NOTICE_S:
                    told = waited
                    self._say(f"still waiting for the lock on {path}: {duration(waited)} of up "
                              f"to {duration(self.timeout_s)}")
                time.sleep(min(0.05, max(0.0, self.timeout_s - waited)))
                continue
            if told is not None:
                self._say(f"the lock on {path} went after "
                          f"{duration(time.monotonic() - started)}; going on")
            return result

    def _say(self, line: str) -> None:
        if self.waiting is not None:
            self.waiting(line)

    @contextlib.contextmanager
    def errors_as_refusals(self, doing: str):
        """sqlite's and the file system's errors as StoreError naming the database."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise self._locked(exc) from None
            if str(exc).startswith("no such table"):  # a SQLite file of another program
                raise self._not_ours("it has no results table") from None
            raise self._unusable(doing, exc) from None
        except sqlite3.DatabaseError as exc:
            raise self._not_ours(f"sqlite: {exc}") from None
        except OSError as exc:
            raise self._unusable(doing, exc) from None

    def _unusable(self, doing: str, exc: BaseException) -> StoreError:
        return unusable(self.argument, self.path, doing, exc, elsewhere=self._elsewhere,
                        writable_elsewhere="copy it (and its -wal file) to a writable file system "
                        "and name the copy" if self.read_only else None,
                        reading=self.read_only, cls=StoreError)

    def _locked(self, exc: BaseException) -> StoreLocked:
        again = "dsforge report" if self.read_only else "the study"
        longer = "" if self.read_only else ", or give a longer --db-timeout"
        return StoreLocked(f"another process held the database's lock for more than "
                           f"{duration(self.timeout_s)} ({exc})", argument=self.argument,
                           value=self.path, fix=f"run {again} again once the other process lets "
                           f"go of it (fuser -v {self.path} lists who has it open){longer}")

    def _not_ours(self, why: str) -> StoreError:
        fix = ("name the results.db that dsforge bench wrote (OUT/results.db)" if self.read_only
               else "move it away (dsforge bench keeps its results in OUT/results.db) or give "
               "another --out")
        return StoreError(f"is not a usable results database ({why})", argument=self.argument,
                          value=self.path, fix=fix)


def _row(r: tuple) -> Row:
    return Row(study=r[0], cell=r[1], repeat=r[2], axes=json.loads(r[3]), status=r[4],
               reason=r[5], seconds=r[6], recipe=r[7], manifest=_load(r[8]),
               figures=_load(r[9]), prediction=_load(r[10]), finished=r[11])


def duration(seconds: float) -> str:
    """`seconds` for a person: 0.5s, 42s, 10m 0s, 2h 30m."""
    if seconds < 10:
        return f"{seconds:.2g}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes = int(round(seconds)) // 60
    if minutes < 60:
        return f"{minutes}m {int(round(seconds)) % 60}s"
    return f"{minutes // 60}h {minutes % 60}m"


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)
