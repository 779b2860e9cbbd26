"""The hosts an attempt of a multi-node job runs on, as its ranks learn them.

`dsforge run` over a hostfile puts the hosts in use, in rank order with their slots, into the
ranks' environment (HOSTS_ENV, through the job word): DeepSpeed numbers the ranks host by host
in that order, so a rank knows its host by its number (`gethostname` would name one machine for
every loopback alias of the tests). The host-down drill (runtime/guard/drills.py) marks its
host as failed under RUN_DIR/drills, for the launcher's preflight (launch/host_pool.py).
"""

from __future__ import annotations

from pathlib import Path

from dsforge.job.run_dir import RunDir

HOSTS_ENV = "DSFORGE_RANK_HOSTS"


def encode(hosts: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{host}={slots}" for host, slots in hosts)


def host_of_rank(encoded: str, rank: int) -> str | None:
    """The host of `rank` among `encoded` hosts (HOSTS_ENV's value), or None."""
    start = 0
    for item in filter(None, encoded.split(",")):
        host, _, slots = item.rpartition("=")
        if start <= rank < start + int(slots):
            return host
        start += int(slots)
    return None


def down_marker(run_dir: RunDir, host: str) -> Path:
    return run_dir.drills / f"down-{host}"


def marked_down(run_dir: RunDir) -> list[str]:
    """Hosts the host-down drill marked as failed."""
    return sorted(p.name.removeprefix("down-") for p in run_dir.drills.glob("down-*"))
