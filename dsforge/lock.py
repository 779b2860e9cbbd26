"""One owner at a time for a directory that a job writes into (a bench cell, a run directory).

`hold_directory(DIR, what=...)` takes an exclusive `fcntl.flock` on the file `DIR.lock` beside
the directory (beside, so that the owner may empty or recreate DIR itself) and keeps it open
until `release()`. The kernel drops a flock when its holder dies, however it dies, so a lock
is never stale and there is nothing to clean up. The file also holds who took it (pid, host,
start time, what for) so that a refused caller can be told who owns the directory.

A flock belongs to the dsforge process, not to the job it starts: the ranks run in their own
session and can outlive a SIGKILLed dsforge for a while. So taking the lock also looks for
live processes of a job started for DIR (their `--job` word names it, job/word.py) and
waits `wait_s` for them to go; if they are still there, the directory is busy.

    with hold_directory(run_dir, what="dsforge bench study cell abc repeat 0"):
        ...  # this process alone writes into run_dir
    # raises Busy (owner, leftover pids) when someone else owns it

Locks are per open file: a second `hold_directory` of the same directory in the same process
is refused too. flock is local to a machine (on NFS it is not reliable across hosts).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

# The environment variable that tags every local process of a job with its run directory
# (set by `dsforge run` and `dsforge bench` for the launcher; inherited by the ranks).
JOB_DIR_ENV = "DSFORGE_JOB_DIR"
# How long a new owner waits for processes of an earlier owner's job to end (ranks whose
# dsforge is gone end themselves within about a second, job/owner.py).
LEFTOVER_WAIT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class Owner:
    pid: int
    host: str
    started: float  # unix time the lock was taken
    what: str

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{self.what or 'a dsforge process'} (pid {self.pid} on {self.host}, since {since})"


class Busy(Exception):
    """The directory has another live owner: a process holding its lock, or processes of a
    job started for it that are still running."""

    def __init__(self, directory: Path, owner: Owner | None = None, pids: tuple[int, ...] = ()):
        self.directory, self.owner, self.pids = directory, owner, pids
        if pids:
            text = (f"{directory} is still written by processes of an earlier job "
                    f"(pids {', '.join(map(str, pids))})")
        else:
            text = f"{directory} is in use by " + (owner.describe() if owner else "another process")
        super().__init__(text)


class Lock:
    """A held lock; `release()` (or leaving the `with` block) gives it up."""

    def __init__(self, path: Path, fd: int, owner: Owner):
        self.path, self.owner, self._fd = path, owner, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_path(directory: Path) -> Path:
    return directory.with_name(directory.name + ".lock")


def acquire(path: Path, *, what: str = "") -> Lock:
    """Take the flock on file `path` (created if needed) without waiting; Busy if held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Busy(path, owner=read_owner(path)) from None
    except BaseException:
        os.close(fd)
        raise
    owner = Owner(pid=os.getpid(), host=socket.gethostname(), started=time.time(), what=what)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(owner)).encode(), 0)
    return Lock(path, fd, owner)


def hold_directory(directory: Path, *, what: str = "", wait_s: float | None = None,
                   check_jobs: bool = True) -> Lock:
    """Own `directory`: its lock, and (with `check_jobs`) no live process of a job started for
    it (waiting up to `wait_s`, default LEFTOVER_WAIT_S, for such processes to end). Raises
    Busy otherwise."""
    directory = Path(directory).absolute()
    try:
        lock = acquire(lock_path(directory), what=what)
    except Busy as busy:
        raise Busy(directory, owner=busy.owner) from None
    if not check_jobs:
        return lock
    deadline = time.monotonic() + (LEFTOVER_WAIT_S if wait_s is None else wait_s)
    while pids := job_processes(directory):
        if time.monotonic() >= deadline:
            lock.release()
            raise Busy(directory, pids=tuple(pids))
        time.sleep(0.2)
    return lock


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on file `path` (created if needed), waiting for it: for work
    one process of a machine does while the others wait (building a dataset index cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def read_owner(path: Path) -> Owner | None:
    """Who took the lock file `path` last (None if unknown); says nothing about liveness."""
    try:
        return Owner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def job_processes(directory: Path) -> list[int]:
    """PIDs of live processes on this machine (other than this one) of a job whose run
    directory is `directory`: tagged JOB_DIR_ENV=DIRECTORY in their environment, or with a
    `--job` word (job/word.py: the runner, the launcher and every rank) naming it. Zombies
    do not count (their command line and environment read empty). Empty without /proc."""
    target = str(Path(directory).resolve())
    tag = f"{JOB_DIR_ENV}={target}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        args = _read(f"/proc/{entry}/cmdline").split(b"\0")
        if tag in _read(f"/proc/{entry}/environ").split(b"\0") or _job_run_dir(args) == target:
            found.append(int(entry))
    return sorted(found)


def job_word_of(pid: int) -> dict | None:
    """Process `pid`'s `--job` word (job/word.py), decoded; None without one."""
    return _job_word(_read(f"/proc/{pid}/cmdline").split(b"\0"))


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def _job_run_dir(args: list[bytes]) -> str | None:
    word = _job_word(args)
    return word.get("run_dir") if word is not None else None


def _job_word(args: list[bytes]) -> dict | None:
    for flag, word in zip(args, args[1:]):
        if flag == b"--job" or flag.startswith(b"--job="):
            word = flag.partition(b"=")[2] if flag.startswith(b"--job=") else word
            try:
                decoded = json.loads(base64.urlsafe_b64decode(word))
            except (binascii.Error, ValueError, TypeError):
                return None
            return decoded if isinstance(decoded, dict) else None
    return None
