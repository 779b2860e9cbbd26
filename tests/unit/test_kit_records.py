"""benchmarks/gpu/kit_records.py: machine paths written as placeholders, a results folder packed
into what a reader opens plus one deterministic records.tar.gz, the kit's OUT built that way
from its work folder; and the repository's own records packed and scrubbed."""

from __future__ import annotations

import io
import json
import re
import shutil
import sqlite3
import subprocess
import tarfile
import tempfile

import pytest

from tests.conftest import REPO
from tests.unit.helpers.kit_modules import load_kit_module

kr = load_kit_module("kit_records")
PLACES = kr.default_places("/srv/checkout", "/tmp/dsforge-gpu-kit", "/root/out", homes=("/root",))
# A truncated database: no sqlite reads it, so it is left as it is, as any binary file.
DB = b"SQLite format 3\0/srv/checkout/inside-a-database"


# ---------------------------------------------------------------------------------------------
# scrub


def test_scrub_replaces_whole_paths_only():
    text = ("/srv/checkout/recipes/a.yaml /srv/checkoutline /x/srv/checkout /srv/checkout. (/srv/checkout) "
            "/srv/checkout-2 /srv/checkout.d /srv/checkout")
    assert kr.scrub(text, PLACES) == (
        "<checkout>/recipes/a.yaml /srv/checkoutline /x/srv/checkout <checkout>. (<checkout>) "
        "/srv/checkout-2 /srv/checkout.d <checkout>")


def test_scrub_takes_the_longest_path_first_and_is_idempotent():
    places = kr.default_places("/srv/co", "/srv/co/scratch", "/root/out", homes=("/root",))
    text = "/srv/co/scratch/runs /srv/co/x /root/out/a /root/.cache /root/outside"
    once = kr.scrub(text, places)
    assert once == "<work>/runs <checkout>/x <out>/a <home>/.cache <home>/outside"
    assert kr.scrub(once, places) == once


def test_places_never_replace_the_root_and_keep_the_first_placeholder_of_a_path():
    places = kr.default_places("/", "/tmp/w", "/tmp/w", homes=("", "/home/u"))
    assert dict(places.pairs) == {"/tmp/w": "<work>", "/home/u": "<home>"}
    assert kr.scrub("/usr/lib /tmp/w/x", places) == "/usr/lib <work>/x"


def _results_db(path, source):
    """A bench results.db (its table cut to what matters here) in WAL mode, as bench keeps it."""
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE results (cell TEXT, recipe TEXT, seconds REAL)")
    connection.execute("INSERT INTO results VALUES ('c1', ?, 0.5)", (f"data:\n  source: {source}\n",))
    connection.commit()
    connection.close()


def _rows(data):
    """The rows of a database's bytes (a WAL database is read from a file, not from memory)."""
    with tempfile.TemporaryDirectory(prefix="test-kit-records-") as folder:
        path = f"{folder}/read.db"
        with open(path, "wb") as f:
            f.write(data)
        connection = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
        rows = connection.execute("SELECT * FROM results").fetchall()
        connection.close()
    return rows


def test_the_scrub_command_rewrites_the_text_values_of_a_database(tmp_path):
    db = tmp_path / "results.db"
    _results_db(db, "/srv/co/data/tempest.u16.bin")
    assert kr.main(["scrub", str(db), "--checkout", "/srv/co"]) == 0
    data = db.read_bytes()
    assert _rows(data) == [("c1", "data:\n  source: <checkout>/data/tempest.u16.bin\n", 0.5)]
    assert b"/srv/co" not in data  # vacuumed: no free page keeps the old text
    assert data[18:20] == b"\2\2"  # still a WAL database
    assert not kr.scrub_file(db, kr.default_places("/srv/co")) and db.read_bytes() == data


def test_the_scrub_command_rewrites_text_files_and_leaves_binary_ones(tmp_path):
    text, binary = tmp_path / "a.json", tmp_path / "b.db"
    text.write_text('{"path": "/srv/co/data"}\n')
    binary.write_bytes(b"\0/srv/co/data")
    assert kr.main(["scrub", str(text), str(binary), "--checkout", "/srv/co"]) == 0
    assert text.read_text() == '{"path": "<checkout>/data"}\n'
    assert binary.read_bytes() == b"\0/srv/co/data"


# ---------------------------------------------------------------------------------------------
# pack

KEPT = {
    "README.md", "1-essential/table.md", "1-essential/results.json", "1-essential/profile-7b.yaml",
    "1-essential/runs/7b/summary.json", "1-essential/runs/7b/manifest.json",
    "1-essential/runs/7b/recipe.yaml", "1-essential/runs/7b/metrics.jsonl",
    "1-essential/bench/zero/cells/c1/repeat0/summary.json",
    "1-essential/bench/zero/cells/c1/repeat0/result.json",
    "1-essential/bench/zero/report.md", "1-essential/bench/zero/plot.png",
    "2-search/search.txt",  # linked from the README
}
ARCHIVED = {
    "1-essential/kit.log", "1-essential/env.json", "1-essential/gpu-tests.xml",
    "1-essential/logs/7b.log", "1-essential/plans/7b.json", "1-essential/runs/7b/job.log",
    "1-essential/runs/7b/ranks/rank00000.json", "1-essential/bench/zero/results.db",
    "1-essential/pytest/gpu-runs/default.out", "1-essential/bench/zero/cells/c1/repeat0/job.log",
    "2-search/base.yaml", "1-essential/bench/zero-real/results.db",
}


def _results_folder(folder):
    """A results folder as a session copies the kit's OUT into the repository."""
    files = {name: f"{name}: made in /srv/checkout by /root/out/x\n" for name in KEPT | ARCHIVED}
    files["README.md"] = ("# H200\n\n[the search](2-search/search.txt), [records](records.tar.gz), "
                          "[the kit](../../README.md), [a site](https://example.com/a.log)\n")
    files["1-essential/bench/zero/report.md"] = "![plot](plot.png)\n"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    (folder / "1-essential/bench/zero/results.db").write_bytes(DB)
    (folder / "1-essential/bench/zero-real/results.db").unlink()  # written as text above
    _results_db(folder / "1-essential/bench/zero-real/results.db", "/srv/checkout/data/x.bin")
    return folder


def _tree(folder):
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_pack_keeps_what_a_reader_opens_and_archives_the_rest(tmp_path):
    folder = _results_folder(tmp_path / "2026-12-01-h200")
    assert set(kr.pack(folder, PLACES)) == ARCHIVED
    assert _tree(folder) == KEPT | {"records.tar.gz"}
    assert not (folder / "1-essential" / "logs").exists()  # emptied folders go too
    members = kr.read_records(folder / "records.tar.gz")
    assert set(members) == ARCHIVED
    said = "made in <checkout> by <out>/x\n"
    assert members["1-essential/kit.log"].decode().endswith(said)
    assert (folder / "1-essential/runs/7b/recipe.yaml").read_text().endswith(said)
    assert members["1-essential/bench/zero/results.db"] == DB
    assert _rows(members["1-essential/bench/zero-real/results.db"]) == [
        ("c1", "data:\n  source: <checkout>/data/x.bin\n", 0.5)]


def test_links_in_kept_markdown_still_resolve(tmp_path):
    folder = _results_folder(tmp_path / "2026-12-01-h200")
    kr.pack(folder, PLACES)
    for md in folder.rglob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)\)", md.read_text()):
            if "://" not in target and not target.startswith("../"):
                assert (md.parent / target).is_file(), (md, target)


def test_packing_again_changes_nothing_and_the_archive_bytes_are_deterministic(tmp_path):
    first = _results_folder(tmp_path / "a" / "2026-12-01-h200")
    kr.pack(first, PLACES)
    archive = (first / "records.tar.gz").read_bytes()
    tree = {name: (first / name).read_bytes() for name in _tree(first)}
    assert kr.pack(first, PLACES) == []
    assert {name: (first / name).read_bytes() for name in _tree(first)} == tree
    second = _results_folder(tmp_path / "b" / "2026-12-01-h200")  # other times, same files
    kr.pack(second, PLACES)
    assert (second / "records.tar.gz").read_bytes() == archive
    with tarfile.open(first / "records.tar.gz") as opened:
        infos = opened.getmembers()
    assert [i.name for i in infos] == sorted(ARCHIVED)
    assert {(i.mtime, i.uid, i.gid, i.uname, i.mode) for i in infos} == {(0, 0, 0, "", 0o644)}


def test_a_later_file_is_merged_into_the_archive(tmp_path):
    folder = _results_folder(tmp_path / "2026-12-01-h200")
    kr.pack(folder, PLACES)
    (folder / "3-more" / "logs").mkdir(parents=True)
    (folder / "3-more" / "logs" / "gemm.log").write_text("/tmp/dsforge-gpu-kit/gemm.json\n")
    assert kr.pack(folder, PLACES) == ["3-more/logs/gemm.log"]
    members = kr.read_records(folder / "records.tar.gz")
    assert set(members) == ARCHIVED | {"3-more/logs/gemm.log"}
    assert members["3-more/logs/gemm.log"] == b"<work>/gemm.json\n"


def _archive(members):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_pack_unfolds_the_old_kit_files_archive_of_an_out_folder(tmp_path):
    out = tmp_path / "1-essential"
    out.mkdir()
    (out / "table.md").write_text("| run |\n")
    (out / "kit.log").write_text("kit: 3 steps\n")
    (out / "kit-files.tar.gz").write_bytes(_archive({
        "runs/7b/summary.json": b"{}", "runs/7b/job.log": b"/srv/checkout\n", "env.json": b"{}"}))
    kr.pack(out, PLACES)
    assert _tree(out) == {"table.md", "runs/7b/summary.json", "records.tar.gz"}
    assert kr.read_records(out / "records.tar.gz") == {
        "kit.log": b"kit: 3 steps\n", "runs/7b/job.log": b"<checkout>\n", "env.json": b"{}"}


# ---------------------------------------------------------------------------------------------
# pack_out


def _kit_work(work):
    files = {"runs/7b/summary.json": "{}", "runs/7b/recipe.yaml": "source: /srv/checkout/data\n",
             "runs/7b/job.log": "started\n", "logs/7b.log": "/root/.cache/x\n",
             "plans/7b.json": "{}", "env.json": "{}", "profile-7b.yaml": "gpu: h200\n",
             "torch_extensions/fused_adam/build.ninja": "never a record\n",
             "bench/zero/report.md": "![p](p.png)\n", "bench/zero/p.png": "\x89PNG"}
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    return sorted(files)


def test_pack_out_builds_the_packed_layout_from_the_work_folder(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    before = _kit_work(work)
    out.mkdir()
    (out / "table.md").write_text("# in /tmp/dsforge-gpu-kit\n")
    (out / "results.json").write_text(json.dumps({"command": "--out /root/out"}))
    (out / "kit.log").write_text("kit: begun\n")
    (out / "torch_extensions.tar.gz").write_bytes(b"a carried build")
    names = kr.pack_out(out, work, PLACES, final=False)
    assert names == ["env.json", "kit.log", "logs/7b.log", "plans/7b.json", "runs/7b/job.log"]
    assert (out / "kit.log").is_file()  # the kit's log still grows after a step's call
    with (out / "kit.log").open("a") as log:
        log.write("kit: done\n")
    kr.pack_out(out, work, PLACES)
    assert _tree(out) == {"table.md", "results.json", "torch_extensions.tar.gz", "records.tar.gz",
                          "runs/7b/summary.json", "runs/7b/recipe.yaml", "profile-7b.yaml",
                          "bench/zero/report.md", "bench/zero/p.png"}
    members = kr.read_records(out / "records.tar.gz")
    assert members["kit.log"] == b"kit: begun\nkit: done\n"
    assert members["logs/7b.log"] == b"<home>/.cache/x\n"
    assert (out / "runs/7b/recipe.yaml").read_text() == "source: <checkout>/data\n"
    assert (out / "table.md").read_text() == "# in <work>\n"
    assert json.loads((out / "results.json").read_text()) == {"command": "--out <out>"}
    assert (out / "torch_extensions.tar.gz").read_bytes() == b"a carried build"
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file()) == before


def test_pack_out_leaves_out_an_out_folder_inside_the_work_folder(tmp_path):
    work = tmp_path / "work"
    _kit_work(work)
    out = work / "kit-out"
    out.mkdir()
    (out / "table.md").write_text("| run |\n")
    kr.pack_out(out, work, PLACES)
    assert not any(name.startswith("kit-out/") for name in kr.read_records(out / "records.tar.gz"))
    assert not (out / "kit-out").exists()


# ---------------------------------------------------------------------------------------------
# The repository

RESULTS = REPO / "benchmarks" / "gpu" / "results"


def _tracked(*paths):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return [REPO / name for name in listed if name and (REPO / name).is_file()]


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.endswith(("-shm", "-wal"))}


@pytest.mark.parametrize("folder", sorted(p.name for p in RESULTS.iterdir() if p.is_dir()))
def test_every_results_folder_is_packed_as_the_kit_packs(folder, tmp_path):
    """Packing a copy of the committed folder with this machine's places archives nothing and
    changes no byte: every file left out of records.tar.gz is one a reader opens, scrubbed."""
    copy = tmp_path / folder
    shutil.copytree(RESULTS / folder, copy, ignore=shutil.ignore_patterns("*-shm", "*-wal"))
    before = _files(copy)
    assert "records.tar.gz" in before
    assert kr.pack(copy, kr.default_places(REPO)) == []
    assert _files(copy) == before


def test_every_relative_markdown_link_resolves():
    broken = []
    for md in _tracked("benchmarks/*.md", "docs/*.md", "README.md"):
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # code blocks are no links
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?[^)]*\)", text):
            target = target.split("#")[0]
            if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and \
                    not (md.parent / target).exists():
                broken.append(f"{md.relative_to(REPO)}: {target}")
    assert not broken
