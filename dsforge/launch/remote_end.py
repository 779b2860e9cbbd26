"""Ending what a failed attempt left on a host the restart leaves out (launch/host_pool.py).

On this machine a restart waits for the failed attempt's processes to be gone
(launch/restart.py); on the other hosts their supervisors end a node's part once pdsh's ssh
session is gone, and a stuck rank's watchdog ends it. A host that failed is the one where
that may not have happened (a hung rank, a supervisor stopped with it), so before its place
is taken dsforge ends there, over ssh as pdsh reaches it, every process of the job: found by
the run directory their job word or environment names (dsforge/lock.py `job_processes`, whose
text is sent: the same test as on this machine, never by name pattern), SIGKILLed by PID. A
host that cannot be reached is named, with what that means.
"""

from __future__ import annotations

import inspect
import os
import sys

from dsforge import lock
from dsforge.job.run_dir import RunDir
from dsforge.launch.preflight import run_command, ssh_command

# Sent as text, standard library only (dsforge need not be importable in an ssh session's
# directory): lock.py's own functions, then the kill. This process's PID is left alone:
# loopback hosts share this machine.
_END = ("import base64, binascii, json, os, signal, sys\nfrom pathlib import Path\n"
        f"JOB_DIR_ENV = {lock.JOB_DIR_ENV!r}\n"
        + "".join(inspect.getsource(f) + "\n" for f in (lock._read, lock._job_word,
                                                        lock._job_run_dir, lock.job_processes))
        + "found = [p for p in job_processes(sys.argv[1]) if p != int(sys.argv[2])]\n"
        "for pid in found:\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except ProcessLookupError:\n"
        "        pass\n"
        "print(' '.join(map(str, found)))\n")


def end_job_on(host: str, run_dir: RunDir, *, timeout_s: float = 20.0) -> str:
    """End the job's processes on `host`; the line that says what happened."""
    command = ssh_command(host, [sys.executable, "-c", _END, str(run_dir.path.absolute()),
                                 str(os.getpid())], timeout_s)
    code, out, err = run_command(command, timeout_s + 5)
    if code != 0:
        why = (err.splitlines() or ["?"])[-1]
        return (f"dsforge: could not reach {host} to end the failed attempt's processes there "
                f"({why}); any still running end when their supervisor sees the job gone, or "
                "with the host")
    pids = out.split()
    if not pids:
        return f"dsforge: nothing of the failed attempt is left on {host}"
    return (f"dsforge: ended {len(pids)} process(es) of the failed attempt on {host} "
            f"(PIDs {', '.join(pids)})")
