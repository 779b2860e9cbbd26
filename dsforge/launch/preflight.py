"""Checks before a multi-node job: every host reachable, the master port free, the same
software everywhere. Each problem names the host and a fix; nothing is left running.

SSH is used the way pdsh will use it: when PDSH_SSH_ARGS is set (pdsh's own variable,
e.g. `-F my_ssh_config -l%u %h`), its options apply to every check too. Hosts are checked in
parallel, each command with a timeout, so one dead host costs `timeout_s`, not N times it.
"""

from __future__ import annotations

import getpass
import inspect
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from dsforge import host_memory
from dsforge.launch import probe as probe_module
from dsforge.problems import Problem, errors
from dsforge.recipe.hostfile import Hostfile
from dsforge.versions import PACKAGES, RANKS_ONLY, package_versions

_DSFORGE_IMPORT = "from dsforge.host_memory import memory_available\n"


def _standalone(probe_text: str) -> str:
    """probe.py's text with its one dsforge import replaced by the functions it imports."""
    assert _DSFORGE_IMPORT in probe_text, "probe.py no longer imports host_memory as expected"
    functions = "".join(inspect.getsource(f) + "\n\n" for f in (host_memory._cgroup_headroom,
                                                                  host_memory.memory_available))
    return probe_text.replace(_DSFORGE_IMPORT, functions)


# One ssh round trip per host: its package versions and what it has for the job, its build
# tools when the job builds an op (probe.py's own text, so the remote side needs nothing but
# Python; `nvcc --version` alone can take seconds).
_HOST_PROBE = (
    _standalone(Path(probe_module.__file__).read_text()).replace('if __name__ == "__main__":',
                                                                 "if False:")
    + "\nfrom importlib.metadata import version, PackageNotFoundError\n"
    "def _version(name):\n"
    "    try:\n"
    "        return version(name)\n"
    "    except PackageNotFoundError:\n"
    "        return None\n")
_HOST_REPORT = (f"print(json.dumps({{'versions': {{name: _version(name) for name in {PACKAGES!r}}}, "
                "'machine': dict(probe(), build=build_facts() if BUILDS else None)}))\n")


def host_script(builds: bool) -> str:
    return _HOST_PROBE + f"BUILDS = {builds!r}\n" + _HOST_REPORT


def ssh_command(host: str, remote: list[str], timeout_s: float) -> list[str]:
    """ssh argv for `remote` on `host`, non-interactive, with pdsh's options if set."""
    options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout_s))}"]
    pdsh_args = os.environ.get("PDSH_SSH_ARGS")
    if pdsh_args:
        words = [w.replace("%u", getpass.getuser()) for w in shlex.split(pdsh_args)]
        target = [w.replace("%h", host) for w in words if "%h" in w] or [host]
        options += [w for w in words if "%h" not in w] + target
    else:
        options += [host]
    return ["ssh", *options, shlex.join(remote)]


def run_command(command: list[str], timeout_s: float) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `command` (an ssh command line), never waiting on a
    terminal: 124 without an answer within `timeout_s`, 127 when it cannot start."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, "", f"no answer within {timeout_s:.0f}s"
    except OSError as exc:
        return 127, "", str(exc)
    return done.returncode, done.stdout, done.stderr.strip()


def check_host(host: str, python: str, timeout_s: float,
               builds: bool = False) -> tuple[list[Problem], dict | None]:
    """SSH reachability; the host's package versions and machine (probe.py), with its build
    tools when `builds`."""
    command = [python, "-c", host_script(builds)]
    code, out, err = run_command(ssh_command(host, command, timeout_s), timeout_s + 5)
    if code == 0:
        try:
            return [], json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            pass
    reason = err.splitlines()[-1] if err else f"exit code {code}"
    return [Problem(rule="F1", fields={"host": host}, message=f"cannot run Python over ssh: {reason}",
                    fix=f"check that `ssh {host} {python} -V` works without a password prompt "
                        "(keys, host name, BatchMode) and that Python is at the same path")], None


def check_port(host: str, port: int, python: str, timeout_s: float) -> list[Problem]:
    script = f"import socket; s = socket.socket(); s.bind(('', {port})); s.close()"
    code, _, err = run_command(ssh_command(host, [python, "-c", script], timeout_s), timeout_s + 5)
    if code == 0:
        return []
    return [Problem(rule="F2", fields={"host": host, "--master-port": port},
                    message=f"the master port is not free: {err.splitlines()[-1] if err else code}",
                    fix="pass another --master-port")]


def version_problems(host: str, remote: dict, reference: dict) -> list[Problem]:
    """F3: `reference` maps each package to (the version every host must have, where that
    version is: "here", or "on HOST" for the ones compared among the hosts, RANKS_ONLY)."""
    return [Problem(rule="F3", fields={"host": host, "package": name},
                    message=f"{name} {remote.get(name)} there, {wanted} {where}",
                    fix="install the same versions on every host (pip install -e . with the same "
                        "pins), or exclude the host")
            for name, (wanted, where) in reference.items() if remote.get(name) != wanted]


def _builds(fit) -> bool:
    """Whether the job's ranks build a DeepSpeed op on any device, or compile their layers
    (then the hosts' build tools are probed)."""
    from dsforge.translate.build_env import job_ops

    return fit is not None and (fit[0].recipe.model.compile != "none"  # inductor's compiler
                                or any(job_ops(fit[0], device) for device in ("cuda", "cpu")))


def _reference_versions(local: dict, hosts: list[str], results: list) -> dict:
    """The versions every host must have, and where they are: this machine's, but for
    RANKS_ONLY packages the first reachable host's (the launching machine runs no rank)."""
    reference = {name: (version, "here") for name, version in local.items()}
    first = next(((host, found) for host, (_, found) in zip(hosts, results) if found), None)
    if first is not None:
        reference |= {name: (first[1]["versions"].get(name), f"on {first[0]}") for name in RANKS_ONLY}
    return reference


def preflight(hostfile: Hostfile, *, master_port: int, timeout_s: float = 10.0,
              python: str = sys.executable, fit=None) -> list[Problem]:
    """Every problem with the hosts of `hostfile` (no errors: ready to launch). With `fit`
    = (resolved recipe, --device), each host's slots must also fit its GPUs or memory, the
    host must be able to build the DeepSpeed ops its ranks build (translate/build_env.py), and
    its ranks' device must run the recipe's kernels (K1, translate/kernels.py)."""
    hosts = list(hostfile.hostnames)
    local = package_versions()
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = list(pool.map(lambda h: check_host(h, python, timeout_s, _builds(fit)), hosts))
    reference = _reference_versions(local, hosts, results)
    if fit is None or fit[0].recipe.train.fp8 == "none":
        reference.pop("torchao", None)  # only float8 GEMMs use it
    problems = []
    for host, slots, (host_problems, found) in zip(hosts, hostfile.node_slots, results):
        problems += host_problems
        if found is not None:
            problems += version_problems(host, found["versions"], reference)
            problems += _fit(host, slots, found["machine"], found["versions"], fit) if fit else []
    if not errors(problems):
        problems += check_port(hosts[0], master_port, python, timeout_s)
    return problems


def _fit(host: str, slots: int, probed: dict, probed_versions: dict, fit) -> list[Problem]:
    from dsforge.launch.fit import Machine, device_for, fit_problems, lowest_capability, run_problems

    resolved, device = fit
    machine = Machine.from_probe(host, probed)
    if machine.build is not None:
        machine = replace(machine, build=machine.build.forwarded(os.environ))
    device = device_for(device, machine)
    built = machine.build
    return (run_problems(resolved, device, capability=lowest_capability(probed),
                         liger=probed_versions.get("liger-kernel") is not None,
                         torchao=probed_versions.get("torchao") is not None,
                         compiler=lambda: built.cxx_path if built is not None else None,
                         cache_dir=None, host=host)
            + fit_problems(resolved, machine, device=device, ranks=slots))
