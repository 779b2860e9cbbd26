"""No tracked file names an absolute path of the machine it was made on: the checkout, anything
inside a home folder, the GPU kit's scratch folder and the device tool's out folder. Records
name them as kit_records writes them (`<checkout>`, `<home>`, `<work>`, `<out>`).

Every file `git ls-files` lists is read: its bytes, the text values of a SQLite database (a
bench results.db, also inside an archive), and each member of a .tar.gz archive (the GPU kit's
records.tar.gz). Paths made up for documentation and tests (/srv/checkout, /home/alice) are
no machine's, and a home folder on its own (`HOME=/root` in a test) names nothing inside it."""

from __future__ import annotations

import io
import os
import re
import shutil
import sqlite3
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.helpers.kit_modules import load_kit_module

kr = load_kit_module("kit_records")

# Code that names the machines' places on purpose: the scrubber holds them as what it
# replaces, its tests and this file's own use them as fixtures.
NAMES_THE_PLACES = {"benchmarks/gpu/kit_records.py", "tests/unit/test_kit_records.py",
                    "tests/unit/test_machine_paths.py"}


@dataclass(frozen=True)
class Place:
    path: str
    inside_only: bool  # a home folder: only a path inside it is the machine's


def machine_places(checkout: Path = REPO, homes: tuple[str, ...] = (str(Path.home()), "/root"),
                   ) -> tuple[Place, ...]:
    """This checkout, the home folders (this machine's and the GPU machine's), the kit's
    scratch folder and the device tool's out folder; "/" is nobody's place."""
    places = [Place(str(checkout), False), Place(kr.DEFAULT_WORK, False),
              Place(kr.DEFAULT_OUT, False)] + [Place(home, True) for home in homes]
    return tuple(dict.fromkeys(p for p in places if os.path.normpath(p.path) not in ("/", ".")))


def _pattern(places: tuple[Place, ...]) -> re.Pattern:
    """Whole paths, as kit_records.scrub matches them (not inside a longer name on either
    side), each match running on to the path's end."""
    parts = []
    for place in places:
        path = re.escape(os.path.normpath(place.path).encode())
        parts.append(path + (rb"(?=/[\w.-])" if place.inside_only else rb"(?![\w-]|\.\w)"))
    return re.compile(rb"(?<![\w.-])(?:" + b"|".join(parts) + rb")(?:/[\w.-]+)*")


def _database_values(data: bytes) -> bytes:
    """Every text value of a SQLite database, one a line: a long value may be split over
    overflow pages in the file's bytes."""
    with tempfile.TemporaryDirectory(prefix="dsforge-paths-") as folder:
        path = Path(folder) / "read.db"
        path.write_bytes(data)
        connection = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
        try:
            values = [str(value) for table, column in kr.table_columns(connection)
                      for (value,) in connection.execute(
                          f'SELECT "{column}" FROM "{table}" WHERE typeof("{column}") = \'text\'')]
        finally:
            connection.close()
    return "\n".join(values).encode()


def _archive_members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def found_in(name: str, data: bytes, pattern: re.Pattern, read: dict[str, int]) -> list[str]:
    """'NAME: PATH' for each machine path in a file's bytes, a database's values and an
    archive's members (named NAME:MEMBER); `read` counts the kinds of file read."""
    kind = "database" if kr.is_database(data) else \
        "archive" if name.endswith((".tar.gz", ".tgz")) else "file"
    read[kind] = read.get(kind, 0) + 1
    texts = [data] + ([_database_values(data)] if kind == "database" else [])
    found = sorted({f"{name}: {m.group().decode(errors='replace')}"
                    for text in texts for m in pattern.finditer(text)})
    if kind == "archive":
        for member, member_data in _archive_members(data).items():
            found += found_in(f"{name}:{member}", member_data, pattern, read)
    return found


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return [name for name in listed if name and (REPO / name).is_file()]


def test_no_tracked_file_names_a_path_of_this_machine():
    pattern, read, found = _pattern(machine_places()), {}, []
    for name in _tracked():
        if name not in NAMES_THE_PLACES:
            found += found_in(name, (REPO / name).read_bytes(), pattern, read)
    assert not found
    # The databases and the kit's archives were read as such, not only as bytes.
    assert read.get("database", 0) >= 1 and read.get("archive", 0) >= 1, read


# ---------------------------------------------------------------------------------------------
# The rule on made-up files: each place is found where records hide it; documentation's
# paths are not.

CHECKOUT = "/data/u/dsforge"
PLACES = machine_places(Path(CHECKOUT), homes=("/home/u", "/root"))


def _found(name: str, data: bytes) -> list[str]:
    return found_in(name, data, _pattern(PLACES), {})


def _database(tmp_path, value: str) -> bytes:
    path = tmp_path / "results.db"
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE results (cell TEXT, recipe TEXT, seconds REAL)")
    connection.execute("INSERT INTO results VALUES ('a', ?, 1.5)", (value,))
    connection.commit()
    connection.close()
    return path.read_bytes()


def _targz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("text", [
    f"source: {CHECKOUT}/data/tempest.u16.bin", f"cd {CHECKOUT}", f"({CHECKOUT}).",
    "/home/u/.cache/torch_extensions", "/root/out/table.md", "file:///root/.triton",
    "/tmp/dsforge-gpu-kit/runs/7b/job.log"])
def test_a_machine_path_is_found_in_text(text):
    assert _found("a.json", text.encode()) != []


@pytest.mark.parametrize("text", [
    "/srv/checkout/recipes/a.yaml", "/home/alice/dsforge/runs", "HOME=/root", '"HOME": "/home/u"',
    f"{CHECKOUT}line", f"/x{CHECKOUT}", f"{CHECKOUT}-2", "<checkout>/data/tempest.u16.bin",
    "/tmp/before", "/rootless", "/usr/bin/python3"])
def test_made_up_and_placeholder_paths_are_not(text):
    assert _found("a.md", text.encode()) == []


def test_a_machine_path_is_found_in_a_database_and_in_an_archive(tmp_path):
    recipe = "data:\n  source: " + CHECKOUT + "/data/tempest.u16.bin\n" + "x: 1\n" * 3000
    db = _database(tmp_path, recipe)  # a value longer than a page: on overflow pages
    read: dict[str, int] = {}
    found = found_in("records.tar.gz", _targz({"1-run/bench/results.db": db}),
                     _pattern(PLACES), read)
    assert found == [f"records.tar.gz:1-run/bench/results.db: {CHECKOUT}/data/tempest.u16.bin"]
    assert read == {"archive": 1, "database": 1}


def test_a_scrubbed_database_names_no_machine_path_and_keeps_its_other_values(tmp_path):
    db = tmp_path / "results.db"
    db.write_bytes(_database(tmp_path, f"source: {CHECKOUT}/data/x.bin"))
    places = kr.default_places(CHECKOUT, homes=("/home/u",))
    assert kr.scrub_file(db, places)
    assert _found("results.db", db.read_bytes()) == []
    connection = sqlite3.connect(db)
    assert connection.execute("SELECT * FROM results").fetchall() == [
        ("a", "source: <checkout>/data/x.bin", 1.5)]
    connection.close()
    before = db.read_bytes()
    assert not kr.scrub_file(db, places) and db.read_bytes() == before  # nothing left to change
