"""All of tests/distributed/ under du-launch, in the worlds that each cover something of their own:

- every backend at 2 ranks: ring, Open MPI through mpi4py, MLX's MPI (each transport's own code);
- 3 ranks (an odd world: uneven shards, padding, a group of 2 and one of 1) on MLX's MPI, whole;
- the ring at 3 ranks for its collectives alone (its N - 1 steps, uneven sizes): oversubscribing 2 cores, its
  ranks spin in the kernel, and the rest of the suite there took 2.5 minutes to test nothing of the ring's;
- 4 ranks (more ranks than cores) on MPIBackend, whose waiting ranks yield the core."""

import re

import pytest
from launching import launch

WORLDS = [
    ("mpi", 2, "tests/distributed"),
    ("ring", 2, "tests/distributed"),
    ("mlx-mpi", 2, "tests/distributed"),
    ("mlx-mpi", 3, "tests/distributed"),
    ("ring", 3, "tests/distributed/test_collectives.py"),
    ("mpi", 4, "tests/distributed"),
]


@pytest.mark.parametrize("backend,n,tests", WORLDS, ids=[f"{b}-{n}" for b, n, _ in WORLDS])
def test_under_launcher(backend, n, tests):
    """The tests in one job per world (a job's start costs more than most tests)."""
    # A rank that fails alone leaves the others in a collective it never joins: the watchdog
    # turns that into a prompt failure instead of a wait for the outer timeout.
    run = launch(
        n,
        backend,
        ["python", "-m", "pytest", "-q", "--color=no", tests],
        timeout=900,
        env={"DU_TIMEOUT": "60"},
    )
    summaries = re.findall(r"^\[rank (\d+)\] (?:=+ )?(.*) in [\d.]+s", run.stdout, re.M)
    assert run.returncode == 0, run.stdout
    assert sorted(int(r) for r, _ in summaries) == list(range(n)), run.stdout
    for _, summary in summaries:
        assert "passed" in summary and "failed" not in summary, run.stdout
