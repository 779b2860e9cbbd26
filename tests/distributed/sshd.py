"""A private sshd on 127.0.0.1 that answers for three host aliases, for pdsh multi-node tests
(two hosts in use, and a spare for the restarts that leave a host out).

It runs from a temporary directory with its own host key, accepts one generated client key,
and is reached through an ssh config that maps `node-a` and `node-b` to it. pdsh and dsforge's
preflight pick the config up from PDSH_SSH_ARGS. The daemon runs in its own process group
and is killed by the fixture that started it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ALIASES = ("node-a", "node-b", "node-c")


@dataclass(frozen=True)
class LoopbackHosts:
    ssh_config: Path
    env: dict[str, str]


def available() -> str | None:
    """Why the pdsh tests cannot run here, or None."""
    missing = [tool for tool in ("sshd", "pdsh", "ssh", "ssh-keygen")
               if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        return (f"needs {', '.join(missing)}: install the Debian packages openssh-server and "
                "pdsh (.ci/run does)")
    return None


def start(tmp: Path) -> tuple[subprocess.Popen, LoopbackHosts]:
    port = _free_port()
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)], check=True)
    (tmp / "authorized_keys").write_text((tmp / "client_key.pub").read_text())
    os.chmod(tmp / "authorized_keys", 0o600)
    config = tmp / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp / 'host_key'}\n"
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}\nPidFile {tmp / 'sshd.pid'}\n"
        "StrictModes no\nUsePAM no\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n"
        "AcceptEnv none\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "sshd.log", "wb"), start_new_session=True)
    client = tmp / "ssh_config"
    client.write_text("".join(
        f"Host {alias}\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {tmp / 'client_key'}\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        for alias in ALIASES))
    env = {"PDSH_SSH_ARGS": f"-F {client} -x -l%u %h", "PDSH_RCMD_TYPE": "ssh"}
    _wait_for_port(port, proc, tmp)
    return proc, LoopbackHosts(ssh_config=client, env=env)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, tmp: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited: {(tmp / 'sshd.log').read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError("sshd did not start listening")
