"""Inside a rank: `python -m dsforge.runtime.rank --job WORD` (rank.py) and what it runs.

By concern, each sub-package importing only those after it in this list (and everything
below runtime/: job/, ckpt/, hf/, translate/, recipe/, estimate/, data/):
  loop/        the training loop and what it measures (trainer, step, metrics, breakdown)
  checkpoint/  the rank's side of a checkpoint: saving and loading engine state (ckpt/ holds
               the format, the reader and the trust checks)
  assemble/    assembling the rank: the model, the engine, kernels, weights' initialisation
  guard/       guarding the process: failure records, out-of-memory, the watchdog, stop
               requests and time limits, the supervisor
"""
