"""Shared fixtures. Tests under tests/distributed/ run twice: here as a world of one, and
under ``du-launch`` with 2-4 processes (tests/test_multiprocess.py), every rank running the
same tests in the same order."""

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


@pytest.fixture(scope="session")
def backend():
    """The backend the launcher started, or a world of one outside a launcher."""
    return du.initialize()
