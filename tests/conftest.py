"""Shared fixtures. Tests under tests/distributed/ run twice: here as a world of one, and
under ``du-launch`` with 2-4 processes (tests/test_multiprocess.py), every rank running the
same tests in the same order."""

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

import distributed_utils as du

# Every rank must draw the same examples, and must not shrink on its own: a failure on one
# rank would make it issue different collectives from the others.
settings.register_profile(
    "ranks",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
settings.load_profile("ranks")


def pytest_configure(config):
    """Under du-launch, each rank gets its own temporary directory: ranks sharing pytest's
    numbered directories would clean up each other's."""
    job = os.environ.get("DU_JOB_ID")
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    if job and rank is not None and config.option.basetemp is None:
        job_dir = Path(tempfile.gettempdir()) / f"du-tests-{job[:12]}"
        job_dir.mkdir(exist_ok=True)
        config.option.basetemp = str(job_dir / f"rank{rank}")


@pytest.fixture(scope="session")
def backend():
    """The backend the launcher started, or a world of one outside a launcher."""
    return du.initialize()
