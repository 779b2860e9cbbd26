"""DeepSpeed-format hostfiles (`host slots=N`, `#` comments), parsed strictly.

Rules (docs/validation.md): H1 one `host slots=N` per line and no duplicate hosts; H2 host
tokens are hostname/IP characters only and never start with `-` (ssh would read an option);
H3 a hostfile that was named but does not exist is an error, never a silent fallback to
localhost (DeepSpeed only warns). `parse_hostfile` is pure; `read_hostfile` adds the file.

A spare host stands by on a line `#spare host slots=N`: a full-line comment, which DeepSpeed's
own parser skips (so a plain `deepspeed --hostfile` never starts ranks there), and which
dsforge reads to take the place of a host that fails (launch/host_pool.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dsforge.problems import Problem, RecipeError, read_text

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")
_SPARE = re.compile(r"^#\s*spare\s+(?P<line>.*?)\s*$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


@dataclass(frozen=True, kw_only=True)
class Hostfile:
    hosts: tuple[tuple[str, int], ...]  # (host, slots) in file order = rank order
    source: str = "<hostfile>"
    spares: tuple[tuple[str, int], ...] = ()  # `#spare host slots=N` lines, in file order

    def text(self) -> str:
        """The hosts in use as DeepSpeed reads them, spares as the comments it skips."""
        return "".join([*(f"{host} slots={slots}\n" for host, slots in self.hosts),
                        *(f"#spare {host} slots={slots}\n" for host, slots in self.spares)])

    @property
    def total_slots(self) -> int:
        return sum(slots for _, slots in self.hosts)

    @property
    def node_slots(self) -> tuple[int, ...]:
        return tuple(slots for _, slots in self.hosts)

    @property
    def hostnames(self) -> tuple[str, ...]:
        return tuple(host for host, _ in self.hosts)


MAX_HOSTFILE_BYTES = 16 << 20  # a line per host: enough for a million hosts
MAX_SLOTS = 1 << 16  # ranks on one host


def read_hostfile(path: str | Path) -> Hostfile:
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise RecipeError([Problem(rule="H3", fields={"hostfile": str(path)},
                                   message="hostfile not found (dsforge never falls back to "
                                           "running on localhost)",
                                   fix="check the path, or leave out --hostfile for a local run")])
    text = read_text(path, "hostfile", rule="H3", example="hostfiles/2nodes.txt",
                     limit=MAX_HOSTFILE_BYTES)
    return parse_hostfile(text.splitlines(), source=str(path))


def parse_hostfile(lines: Iterable[str], source: str = "<hostfile>") -> Hostfile:
    """Parse hostfile lines; raises RecipeError listing every bad line."""
    hosts: list[tuple[str, int]] = []
    first_seen: dict[str, int] = {}
    problems: list[Problem] = []
    spares: list[tuple[str, int]] = []
    for number, line in enumerate(lines, start=1):
        spare = _SPARE.match(line.strip())
        text = spare["line"].split("#", 1)[0].strip() if spare else line.split("#", 1)[0].strip()
        if not text:
            continue
        where = {f"{source}:{number}": line.strip() if spare else text}
        parsed = _parse_line(text, where, problems)
        if parsed is None:
            continue
        host, slots = parsed
        if host in first_seen:
            problems.append(Problem(rule="H1", fields=where,
                                    message=f"duplicate host (first on line {first_seen[host]})",
                                    fix="list each host once with its total slots, in use or "
                                        "spare"))
            continue
        first_seen[host] = number
        (spares if spare else hosts).append((host, slots))
    if not hosts and not problems:
        problems.append(Problem(rule="H1", fields={"hostfile": source}, message="no hosts",
                                fix="add lines such as `node1 slots=8`"))
    if problems:
        raise RecipeError(problems)
    return Hostfile(hosts=tuple(hosts), source=source, spares=tuple(spares))


def _parse_line(text: str, where: dict, problems: list[Problem]) -> tuple[str, int] | None:
    match = _LINE.match(text)
    if not match:
        problems.append(Problem(rule="H1", fields=where, message="expected `host slots=N`",
                                fix="write one host per line, e.g. `worker-1 slots=8`"))
        return None
    host, slots = match["host"], match["slots"]
    if not _HOST.match(host):
        problems.append(Problem(rule="H2", fields=where,
                                message="host names may hold only letters, digits, '.', '-', "
                                        "'_' and ':' and may not start with '-'",
                                fix="use the plain hostname or IP address"))
        return None
    # Not isdigit(): it accepts '²'. A few digits: int() refuses more than 4300.
    if not re.fullmatch(r"[0-9]{1,9}", slots) or not 1 <= int(slots) <= MAX_SLOTS:
        problems.append(Problem(rule="H1", fields=where,
                                message=f"slots must be a whole number from 1 to {MAX_SLOTS:,}",
                                fix="e.g. slots=8 for a node with 8 GPUs"))
        return None
    return host, int(slots)


def active_hosts(hostfile: Hostfile, include: str = "", exclude: str = "") -> Hostfile:
    """The hosts and slot counts left after DeepSpeed's --include/--exclude filters (rule H5),
    computed with DeepSpeed's own parser so dsforge validates what DeepSpeed will run."""
    if not include and not exclude:
        return hostfile
    from collections import OrderedDict

    from deepspeed.launcher.runner import parse_inclusion_exclusion

    try:
        active = parse_inclusion_exclusion(OrderedDict(hostfile.hosts), include, exclude)
    except ValueError as exc:
        raise RecipeError([Problem(rule="H5", fields={"--include": include, "--exclude": exclude},
                                   message=str(exc),
                                   fix="name hosts and slots that the hostfile has, e.g. "
                                       "--include node-a:0,1@node-b")]) from None
    hosts = tuple((host, len(slots)) for host, slots in active.items())
    if not hosts:
        raise RecipeError([Problem(rule="H5", fields={"--exclude": exclude},
                                   message="no slots left", fix="exclude fewer hosts")])
    return Hostfile(hosts=hosts, source=f"{hostfile.source} (filtered)", spares=hostfile.spares)
