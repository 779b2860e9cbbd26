#!/usr/bin/env bash
# The GPU kit on the device machine (benchmarks/gpu/README.md): from the repository root, with
# the working tree's dsforge first on the path, run kit.py, which installs the carried wheels
# (benchmarks/gpu/wheels) into this python3, checks the environment and runs the measurements.
#   bash benchmarks/gpu/run.sh --out "$OUT" --budget 470 essential
#   bash benchmarks/gpu/run.sh --dry-run essential  # any machine: checks and prints the commands
# The machine's python3 is the one that holds torch (a virtual environment already, so the
# wheels go straight into it: a venv made from it would see the base interpreter's packages,
# not torch).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu/kit.py "$@"
