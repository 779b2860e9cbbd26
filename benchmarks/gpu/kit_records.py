#!/usr/bin/env python3
"""The GPU kit's records: what a reader opens stays a file, the rest goes into one archive.

    python3 benchmarks/gpu/kit_records.py pack FOLDER...   # a results folder, in place
    python3 benchmarks/gpu/kit_records.py scrub FILE...    # machine paths written as placeholders
                                                           # (a text file or a SQLite database)

A packed results folder (benchmarks/gpu/results/<date>-<gpu>/) keeps as files: every .md
(README.md, table.md, bench reports), results.json, peers.json, the charts (*.png), the
calibrated profiles (profile*.yaml), in each run directory (a folder holding summary.json:
runs/<label>/, bench cells, tests/gpu's runs) its RUN_FILES, and every file a kept .md links
to by a relative path. Everything else (logs, pytest output, databases, env.json, plans/,
ranks/, kit.log) is in records.tar.gz at the folder's root, each member named by its path
relative to the folder (`tar -xzf records.tar.gz 1-essential/kit.log` brings one back). A
kit-files.tar.gz (the kit's work folder as kit.py archived it before pack_out) is unfolded first.


Machine paths (the checkout, the home folder, the kit's scratch folder, the device tool's out
folder) are written as `<checkout>`, `<home>`, `<work>` and `<out>` in the text of both, and
in the text values of a SQLite database (a bench results.db), so a record names no one's machine. The archive is deterministic (sorted names, mtime 0, owner 0),
and packing a packed folder changes nothing, so a repack does not churn git.

Stdlib only: kit.py calls pack_out on the GPU machine, where nothing of the kit is installed yet.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import gzip
import io
import os
import re
import sqlite3
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[2]
ARCHIVE = "records.tar.gz"
OLD_ARCHIVE = "kit-files.tar.gz"  # the kit's work folder as kit.py archived it before pack_out
# The kit's scratch folder on the GPU machine (kit.py --work's default): the one place that names it.
DEFAULT_WORK = "/tmp/dsforge-gpu-kit"
DEFAULT_OUT = "/root/out"  # the device tool's $OUT in the records of 2026-11
RUN_FILES = ("summary.json", "manifest.json", "recipe.yaml", "metrics.jsonl",
             "anomalies.jsonl", "result.json")  # dsforge/job/run_dir.py's names
# The tables and their data, the charts, and the profiles `dsforge calibrate` and --measure write.
KEPT_NAMES = ("*.md", "results.json", "peers.json", "*.png", "profile*.yaml")
# The work folder as kit.py's archive_work walked it: DeepSpeed's op builds and checkpoints are
# no records, and files over 4 MiB would not fit what the device tool returns.
SKIP_DIRS = ("torch_extensions", "checkpoints", "out")
FILE_LIMIT = 4 * 1024**2
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\[[^\]]+\]:\s*(\S+)", re.M)


@dataclass(frozen=True)
class Places:
    """Machine paths and the placeholder each is written as, longest path first."""

    pairs: tuple[tuple[str, str], ...]


def default_places(checkout: str | Path, work: str | Path = DEFAULT_WORK,
                   out: str | Path = DEFAULT_OUT,
                   homes: tuple[str | Path, ...] = (Path.home(), "/root")) -> Places:
    """The checkout, the kit's work folder, the device tool's out folder and the home folders
    (the GPU machine's is /root; this machine's may differ). A path given twice keeps its first
    placeholder; "/" is never replaced (it would rewrite every path)."""
    seen: dict[str, str] = {}
    named = [(checkout, "<checkout>"), (work, "<work>"), (out, "<out>")]
    for path, holder in named + [(h, "<home>") for h in homes]:
        text = os.path.normpath(str(path)) if str(path) else ""
        if text not in ("", "/", ".") and text not in seen:
            seen[text] = holder
    pairs = sorted(seen.items(), key=lambda pair: -len(pair[0]))  # stable: ties keep their order
    return Places(tuple(pairs))


@functools.lru_cache(maxsize=8)
def _pattern(places: Places) -> re.Pattern:
    # Whole paths only: not preceded by a name character (/x/work/main) and not followed by one
    # (/work/mainline); a dot ends the path only where no name follows it (`/work/main.`).
    names = "|".join(re.escape(path) for path, _ in places.pairs)
    return re.compile(rf"(?<![\w.-])({names})(?![\w-]|\.\w)")


def scrub(text: str, places: Places) -> str:
    """`text` with each machine path in `places` written as its placeholder."""
    if not places.pairs:
        return text
    holders = dict(places.pairs)
    return _pattern(places).sub(lambda m: holders[m.group(1)], text)


def _as_text(data: bytes) -> str | None:
    """The bytes as UTF-8 text, or None for a binary file (a database, an image, an archive)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


SQLITE_HEADER = b"SQLite format 3\0"


def is_database(data: bytes) -> bool:
    return data.startswith(SQLITE_HEADER)


def table_columns(connection: sqlite3.Connection) -> list[tuple[str, str]]:
    """(table, column) of every column of every table of the database."""
    tables = [row[0] for row in connection.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    return [(table, row[1]) for table in tables
            for row in connection.execute(f'PRAGMA table_info("{table}")')]


def scrub_database(path: Path, places: Places) -> bool:
    """Rewrites the text values of a SQLite database in place where they name a machine path;
    True if any changed. The file is vacuumed after a change, so no page keeps the old text,
    and left byte for byte as it was where nothing changed (a repack does not churn git)."""
    connection = sqlite3.connect(path)
    try:
        changed = _scrub_values(connection, places)
    except sqlite3.DatabaseError:  # not one sqlite reads (a truncated copy): as any binary file
        changed = 0
    finally:
        connection.close()
    return changed > 0


def _scrub_values(connection: sqlite3.Connection, places: Places) -> int:
    """Scrubs every text value in place; the number of values changed."""
    changed = 0
    for table, column in table_columns(connection):
        values = [row[0] for row in connection.execute(
            f'SELECT DISTINCT "{column}" FROM "{table}" WHERE typeof("{column}") = \'text\'')]
        for value in values:
            scrubbed = scrub(value, places)
            if scrubbed != value:
                connection.execute(f'UPDATE "{table}" SET "{column}" = ? WHERE "{column}" = ?',
                                   (scrubbed, value))
                changed += 1
    if changed:
        connection.commit()
        connection.execute("VACUUM")
        # A WAL database keeps the vacuumed pages in its -wal file until a checkpoint.
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return changed


def _scrub_database_bytes(data: bytes, places: Places) -> bytes:
    """A database held in memory (an archive's member), scrubbed through a scratch file."""
    with tempfile.TemporaryDirectory(prefix="kit-records-") as folder:
        path = Path(folder) / "records.db"
        path.write_bytes(data)
        return path.read_bytes() if scrub_database(path, places) else data


def scrub_bytes(data: bytes, places: Places) -> bytes:
    """A file's bytes with its machine paths written as placeholders: the text of a text file,
    the text values of a SQLite database; any other binary file as it is."""
    if is_database(data):
        return _scrub_database_bytes(data, places)
    text = _as_text(data)
    return data if text is None else scrub(text, places).encode("utf-8")


def scrub_file(path: Path, places: Places) -> bool:
    """Rewrites a text file or a SQLite database in place where it names a machine path; True
    if it changed."""
    with path.open("rb") as head:
        if is_database(head.read(len(SQLITE_HEADER))):
            return scrub_database(path, places)
    data = path.read_bytes()
    scrubbed = scrub_bytes(data, places)
    if scrubbed != data:
        path.write_bytes(scrubbed)
    return scrubbed != data


# ---------------------------------------------------------------------------------------------
# What a reader keeps


def _links(md: str, text: str) -> set[str]:
    """The relative paths that the markdown file `md` (a name relative to the folder) links to,
    as names relative to the folder; links out of it, to URLs or to anchors are left out."""
    found = set()
    for match in LINK.finditer(text):
        target = (match.group(1) or match.group(2)).split("#")[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("/"):
            continue
        joined = os.path.normpath(str(PurePosixPath(md).parent / target))
        if not joined.startswith(".."):
            found.add(PurePosixPath(joined).as_posix())
    return found


def kept(files: dict[str, bytes]) -> set[str]:
    """The names (relative to the folder) of the files a reader needs in the tree."""
    runs = {str(PurePosixPath(n).parent) for n in files if PurePosixPath(n).name == "summary.json"}

    def reader_file(name: str) -> bool:
        path = PurePosixPath(name)
        return any(fnmatch.fnmatch(path.name, p) for p in KEPT_NAMES) or \
            (str(path.parent) in runs and path.name in RUN_FILES)

    keep = {n for n in files if reader_file(n)}
    for md in [n for n in keep if n.endswith(".md")]:
        keep |= _links(md, files[md].decode("utf-8", errors="replace")) & files.keys()
    return keep


# ---------------------------------------------------------------------------------------------
# The archive


def read_records(path: Path) -> dict[str, bytes]:
    """The archive's members by name ({} where there is none)."""
    if not path.is_file():
        return {}
    with tarfile.open(path) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def _archive_bytes(members: dict[str, bytes]) -> bytes:
    """A .tar.gz whose bytes depend on the members only: sorted, mtime 0, owner 0, mode 644,
    and no name or time in the gzip header."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as archive:
            for name in sorted(members):
                info = tarfile.TarInfo(name)  # mtime, uid and gid 0 by default
                info.size, info.mode = len(members[name]), 0o644
                archive.addfile(info, io.BytesIO(members[name]))
    return buffer.getvalue()


def merge_records(path: Path, members: dict[str, bytes], places: Places) -> None:
    """Adds `members` to the archive at `path` (a member of the same name is replaced), every
    member's text scrubbed; the file is left untouched where its bytes would not change."""
    merged = {**read_records(path), **members}
    data = _archive_bytes({n: scrub_bytes(d, places) for n, d in merged.items()})
    if not path.is_file() or path.read_bytes() != data:
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        partial.replace(path)


# ---------------------------------------------------------------------------------------------
# A results folder, and the kit's OUT


def _tree(folder: Path) -> dict[str, Path]:
    """The folder's files by name relative to it, the archive itself left out."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != ARCHIVE}


def _unfold_old_archive(folder: Path) -> None:
    """An OUT folder as the kit returned it before pack_out: kit-files.tar.gz's members become
    the folder's files (those already in the tree win), so they are sorted like any other."""
    old = folder / OLD_ARCHIVE
    for name, data in read_records(old).items():
        target = folder / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    old.unlink(missing_ok=True)


def _remove(folder: Path, names: set[str]) -> None:
    """Deletes the named files, then the folders that are left empty."""
    for name in names:
        (folder / name).unlink()
    for path in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(path.iterdir()):
            path.rmdir()


def pack(folder: Path, places: Places) -> list[str]:
    """Packs one results folder in place (module docstring): the kept files scrubbed, the rest
    merged into FOLDER/records.tar.gz and removed. Returns the names archived by this call."""
    _unfold_old_archive(folder)
    tree = _tree(folder)
    data = {name: path.read_bytes() for name, path in tree.items()}
    keep = kept(data)
    moved = {n: d for n, d in data.items() if n not in keep}
    if moved or (folder / ARCHIVE).is_file():
        merge_records(folder / ARCHIVE, moved, places)
    for name in keep:
        scrub_file(tree[name], places)
    _remove(folder, set(moved))
    return sorted(moved)


def _work_files(work: Path, out: Path) -> dict[str, Path]:
    """The work folder's files that are records: by name relative to it, as archive_work chose."""
    found = {}
    for path in sorted(work.rglob("*")):
        inside = path.relative_to(work)
        if path.is_file() and not set(SKIP_DIRS) & set(inside.parts) and \
                out not in path.parents and path.stat().st_size <= FILE_LIMIT:
            found[inside.as_posix()] = path
    return found


def pack_out(out: Path, work: Path, places: Places, *, final: bool = True) -> list[str]:
    """The kit's OUT in the packed layout, built from its work folder; returns the names in
    OUT/records.tar.gz.

    Contract (kit.py calls it where it called archive_work(work, out / "kit-files.tar.gz")):
    - Reads WORK (runs/<label>/, bench/, logs/, plans/, pytest/, env.json, ...), as
      archive_work did: SKIP_DIRS, OUT itself (when it is inside WORK) and files over
      FILE_LIMIT left out. WORK is not changed.
    - Reads OUT's own files (table.md, results.json, kit.log; *.tar.gz files such as
      torch_extensions.tar.gz are not records and stay as they are).
    - Writes into OUT a scrubbed copy of each kept WORK file at the same relative path
      (runs/7b-shipped/summary.json, bench/zero-1b/report.md and its plots, ...), scrubs OUT's
      kept files (table.md, results.json) in place, and merges everything else into
      OUT/records.tar.gz (deterministic; a member already there is replaced).
    - final=True (the last call): OUT's own archived files (kit.log) are removed, so OUT is a
      packed results folder as it is. final=False (a call after each step, so a command cut
      short still returns its records): they are archived as copies and left, because the
      kit's Log keeps appending to kit.log.
    - The caller checks the archive against what the device tool returns (16 MiB a file).
    """
    files = _work_files(work, out)
    own = {p.name: p for p in out.iterdir()
           if p.is_file() and not p.name.endswith((".tar.gz", ".partial"))}
    data = {name: path.read_bytes() for name, path in {**files, **own}.items()}
    keep = kept(data)
    for name in keep - own.keys():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(scrub_bytes(data[name], places))
    for name in keep & own.keys():
        scrub_file(own[name], places)
    moved = {n: d for n, d in data.items() if n not in keep}
    merge_records(out / ARCHIVE, moved, places)
    if final:
        for name in moved.keys() & own.keys():
            own[name].unlink()
    return sorted(read_records(out / ARCHIVE))


# ---------------------------------------------------------------------------------------------
# The command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    places = argparse.ArgumentParser(add_help=False)
    places.add_argument("--checkout", default=str(REPO), help="[the repository root]")
    places.add_argument("--home", action="append", help="[this machine's home and /root]")
    places.add_argument("--work", default=DEFAULT_WORK, help="kit.py's work folder [%(default)s]")
    places.add_argument("--out", default=DEFAULT_OUT, help="the device tool's $OUT [%(default)s]")
    parser = argparse.ArgumentParser(prog="kit_records.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pack", parents=[places], help="pack results folders in place") \
        .add_argument("paths", nargs="+", type=Path, metavar="FOLDER")
    commands.add_parser("scrub", parents=[places], help="scrub text files and SQLite databases in place") \
        .add_argument("paths", nargs="+", type=Path, metavar="FILE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    homes = tuple(args.home) if args.home else (Path.home(), "/root")
    places = default_places(args.checkout, args.work, args.out, homes)
    for path in args.paths:
        if args.command == "pack":
            print(f"{path}: {len(pack(path, places))} files archived in {ARCHIVE}")
        elif scrub_file(path, places):
            print(f"{path}: scrubbed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
