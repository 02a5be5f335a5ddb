"""All of tests/distributed/ under du-launch: every backend at 2 ranks (ring, Open MPI through mpi4py,
MLX's MPI: each transport's own code), then 3 ranks once (an odd world: uneven shards, padding, the ring's
N - 1 steps; on the ring, the backend of Macs) and 4 once (more ranks than cores, on MPIBackend, whose waiting
ranks yield the core: the oversubscribed ring spends minutes spinning in the kernel for nothing it tests)."""

import re

import pytest
from launching import launch

WORLDS = [("mpi", 2), ("ring", 2), ("mlx-mpi", 2), ("ring", 3), ("mpi", 4)]


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
