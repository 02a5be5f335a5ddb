"""All of tests/distributed/ under du-launch with 2, 3 and 4 processes on each backend."""

import re

import pytest
from launching import launch

WORLDS = [(backend, n) for backend in ("mpi", "ring", "mlx-mpi") for n in (2, 3, 4)]


@pytest.mark.parametrize("backend,n", WORLDS, ids=[f"{b}-{n}" for b, n in WORLDS])
def test_under_launcher(backend, n):
    """All of tests/distributed in one job per world (a job's start costs more than most tests)."""
    # A rank that fails alone leaves the others in a collective it never joins: the watchdog
    # turns that into a prompt failure instead of a wait for the outer timeout.
    run = launch(
        n,
        backend,
        ["python", "-m", "pytest", "-q", "--color=no", "tests/distributed"],
        timeout=900,
        env={"DU_TIMEOUT": "60"},
    )
    summaries = re.findall(r"^\[rank (\d+)\] (?:=+ )?(.*) in [\d.]+s", run.stdout, re.M)
    assert run.returncode == 0, run.stdout
    assert sorted(int(r) for r, _ in summaries) == list(range(n)), run.stdout
    for _, summary in summaries:
        assert "passed" in summary and "failed" not in summary, run.stdout
