"""The keeper: `python -m dsforge.launch.keeper PARENT COMMAND...` runs COMMAND (the launcher:
dsforge's, launch/node.py, or DeepSpeed's runner) for `dsforge run`, whose child it is, and
ends the job the moment dsforge dies.

dsforge starts it in a new session, so the keeper leads the job's process group: the launcher,
DeepSpeed's per-node launcher, pdsh and ssh, and this machine's ranks. The kernel sends the keeper
SIGHUP when its parent dies however it dies (PR_SET_PDEATHSIG, job/owner.py), and the keeper
then kills the whole group, before any rank need have started and whatever state the ranks
are in; ranks on other hosts see their ssh session close and end themselves (their
supervisors' watch, job/owner.py). Signals dsforge sends the group (SIGINT, SIGTERM) are for
the launcher: the keeper waits for it and exits as it exited, so to dsforge the keeper is the
launcher. It writes nothing: its output is dsforge's pipe, which may have no reader.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dsforge.job.owner import die_with_parent

OWNER_GONE = signal.SIGHUP


def keeper_command(command: list[str]) -> list[str]:
    """`command` run under a keeper whose parent is this process."""
    return [sys.executable, "-m", "dsforge.launch.keeper", str(os.getpid()), *command]


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the runner's to act on; wait for it
        signal.signal(sig, lambda *_: None)
    parent, command = int(argv[0]), argv[1:]
    signal.signal(OWNER_GONE, lambda *_: _end_job())
    if not die_with_parent(OWNER_GONE, parent):
        _end_job()  # dsforge died while this process started
    code = subprocess.Popen(command).wait()
    if code < 0:  # killed by signal -code: end the same way, as the runner would have
        if -code != signal.SIGKILL:  # SIGKILL's action cannot be set and is the default
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _end_job() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
