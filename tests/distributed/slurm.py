"""A private one-node Slurm cluster on this machine, for tests/distributed/test_slurm.py.

munged (a generated key), slurmctld and slurmd run in the foreground from a temporary
directory with their own slurm.conf (free ports, state, spool, logs and the munge socket all
in that directory), each in its own process group. Clients reach it through SLURM_CONF (in
`Cluster.env`). `stop` cancels every job of the cluster, waits for them to end and then stops
the daemons by their pids. Debian's slurmd is built without multiple-slurmd support, so one
machine is one node: multi-node layouts cannot be made here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # the test's environment for Slurm clients and the jobs they submit
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 30,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              env=env or self.env)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Reason, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                       for p in sorted(self.root.glob("*.log")))


def available() -> str | None:
    """Why a Slurm cluster cannot run here, or None."""
    missing = [tool for tool in DAEMONS + CLIENTS if _which(tool) is None]
    if missing:
        return (f"needs {', '.join(missing)}: install the Debian packages slurmctld, slurmd, "
                "slurm-client and munge (.ci/run does)")
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root (SlurmUser=root)"
    return None


def _which(tool: str) -> str | None:
    return shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/sbin/{tool}")
                                       if Path(p).exists()), None)


def start(root: Path, environ=os.environ) -> Cluster:
    """Start the cluster in `root`; RuntimeError (with the daemons' logs) when it does not
    come up. Whatever started is stopped again on failure."""
    env = {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    cluster = Cluster(root=root, env=env)
    try:
        _start_munge(cluster)
        _write_conf(root, node=_node_line(env))
        for daemon, args in (("slurmctld", ["-D", "-i"]), ("slurmd", ["-D"])):
            cluster.procs.append(subprocess.Popen(
                [_which(daemon), *args, "-f", str(root / "slurm.conf")], env=env,
                stdout=subprocess.DEVNULL, stderr=open(root / f"{daemon}.stderr.log", "wb"),
                start_new_session=True))
        _wait_until_idle(cluster)
    except Exception:
        stop(cluster)
        raise
    return cluster


def _start_munge(cluster: Cluster) -> None:
    root = cluster.root
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cluster.procs.append(subprocess.Popen(
        [_which("munged"), "--foreground", "--force", f"--key-file={key}",
         f"--socket={root / 'munge.sock'}", f"--pid-file={root / 'munged.pid'}",
         f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True))
    _wait_for(lambda: (root / "munge.sock").exists(), 15, "munged did not create its socket",
              cluster)


def _node_line(env: dict[str, str]) -> str:
    """This machine as slurmd sees it (`slurmd -C`), without its memory (a figure that may
    shrink and drain the node)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30,
                         env=env).stdout
    line = next(line for line in out.splitlines() if line.startswith("NodeName="))
    return re.sub(r"\s*RealMemory=\S+", "", line)


def _write_conf(root: Path, *, node: str) -> None:
    name = node.split()[0].split("=", 1)[1]
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    (root / "plugstack.conf").write_text("")
    (root / "slurm.conf").write_text(f"""\
ClusterName=dsforgetest
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={root / 'munge.sock'}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd.log'}
PlugStackConfig={root / 'plugstack.conf'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=5
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes={name} Default=YES MaxTime=INFINITE State=UP
""")


def _wait_until_idle(cluster: Cluster) -> None:
    def idle() -> bool:
        for proc in cluster.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}\n{cluster.logs()}")
        out = cluster.run("sinfo", "-h", "-o", "%T").stdout.split()
        return out == ["idle"]

    _wait_for(idle, 30, "the node did not become idle", cluster)


def _wait_for(ready, timeout_s: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} within {timeout_s:.0f}s\n{cluster.logs()}")


def stop(cluster: Cluster) -> None:
    """Cancel every job, wait (up to 30 s) for them to end, then stop the daemons."""
    if len(cluster.procs) == len(DAEMONS):
        try:
            cluster.run("scancel", "--full", "--user", "root")
            deadline = time.monotonic() + 30
            while cluster.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for proc in reversed(cluster.procs):
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
