"""The contract between `dsforge run` and its ranks, torch-free.

Both sides import it; it imports neither (only dsforge's bottom modules: problems, files,
units, lock). What it holds:
  run_dir.py       the run directory as code: `RunDir`, one named member per entry, and who may
                   use a run directory
  word.py          the job word (`JobSpec`) and the environment it forwards
  owner.py         a job's processes end when the `dsforge` that started them is gone
  who_failed.py    who failed first and who went silent, for the report and the restart
  steps.py         steps numbered from 0 in records and from 1 in what dsforge says
  slurm_env.py     a rank's RANK/WORLD_SIZE/LOCAL_RANK from Slurm's variables
  console.py       the marks on a rank's lines meant for the user's terminal
  signals.py       stop signals and exit codes
  failure.py, heartbeat.py, pids.py, metrics_file.py
                   the records ranks leave in the run directory and `dsforge run`, `dsforge
                   bench` and the tools read back
"""
