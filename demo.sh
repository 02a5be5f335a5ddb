#!/usr/bin/env bash
# Sets up .venv, then trains the digits classifier data-parallel on this machine:
# N=2 processes (override with N=4 ./demo.sh) over BACKEND=mpi (or ring, mlx-mpi).
# Arguments go to examples/digits.py (try --help).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[examples]"
exec .venv/bin/du-launch -n "${N:-2}" --backend "${BACKEND:-mpi}" .venv/bin/python examples/digits.py "$@"
