"""Stop signals and exit codes shared by `dsforge run`, its ranks and `dsforge bench`."""

from __future__ import annotations

import signal

# The exit code of a `dsforge run` whose ranks stopped with a checkpoint on request or before
# train.time_limit (EX_TEMPFAIL, sysexits.h: "try again later"): resume with --resume.
EXIT_RESUMABLE = 75
# Signals that ask the ranks to save and stop. SIGINT (Ctrl-C) and SIGHUP still stop at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TIME_LIMIT = "time limit"
