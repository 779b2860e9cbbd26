"""The contract between `dsforge run` and its ranks, torch-free.

Both sides import it; it imports neither (only dsforge's bottom modules: problems, files,
units, lock). What it holds:
  run_dir.py       the run directory as code: `RunDir`, one named member per entry, and who may
                   use a run directory
  word.py          the job word (`JobSpec`) and the environment it forwards
  owner.py         ranks that end themselves when the `dsforge` that started them is gone
  slurm_env.py     a rank's RANK/WORLD_SIZE/LOCAL_RANK from Slurm's variables
  job/console.py       the marks on a rank's lines meant for the user's terminal
  signals.py       stop signals and exit codes
  failure.py, heartbeat.py, pids.py, job/metrics_file.py
                   the records ranks leave in the run directory and `dsforge run`, `dsforge
                   bench` and the tools read back
"""
