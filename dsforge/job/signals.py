"""Stop signals and exit codes shared by `dsforge run`, its ranks and `dsforge bench`."""

from __future__ import annotations

import signal

# The exit code of a `dsforge run` whose ranks stopped with a checkpoint on request or before
# train.time_limit (EX_TEMPFAIL, sysexits.h: "try again later"): resume with --resume.
EXIT_RESUMABLE = 75
# The exit code of a `dsforge run` whose ranks stopped together because the training went bad:
# a step's loss or gradients were not finite (train.on_nonfinite), a loss spike with
# train.on_spike: stop, or non-finite weights before a save (EX_DATAERR, sysexits.h). Not
# resumable as it stands: the report says what to change. `dsforge sbatch` does not requeue it.
EXIT_NONFINITE = 65
# Signals that ask the ranks to save and stop. SIGINT (Ctrl-C) and SIGHUP still stop at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TIME_LIMIT = "time limit"
