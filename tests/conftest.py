"""Shared fixtures. Tests under tests/distributed/ run twice: here as a world of one, and
under ``du-launch`` with 2-4 processes (tests/test_multiprocess.py), every rank running the
same tests in the same order. Under du-launch the library's pytest plugin
(``distributed_utils/pytest_plugin.py``) gives each rank its own temporary directory, one
hypothesis seed for every rank (new each job, in the header), and ends the job at a rank's
first failure."""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, Phase, settings

import distributed_utils as du

# Every rank must draw the same examples (the plugin seeds hypothesis with the job's seed), and
# must not shrink on its own: a failure on one rank would make it issue different collectives.
settings.register_profile(
    "ranks",
    database=None,
    deadline=None,
    max_examples=25,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
settings.load_profile("ranks")


def pytest_configure(config):
    # du-launch --check remembers its figure in the user's cache: the tests' jobs, in a folder of their own
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="du-tests-cache-"))
    config.addinivalue_line(
        "markers",
        "world(min_size=1, max_size=None, backend=None): a test for worlds of min_size to max_size ranks "
        "(and of this backend class); deselected in the others, where it cannot mean anything (max_size=1: "
        "what a rank does alone, before any collective, which every world would repeat)",
    )


def pytest_collection_modifyitems(config, items):
    backend = du.initialize()  # every rank collects the same tests, so this is collective too
    keep = []
    for item in items:
        marker = item.get_closest_marker("world")
        wanted = marker.kwargs if marker else {}
        sizes = range(wanted.get("min_size", 1), (wanted.get("max_size") or backend.size) + 1)
        fits = backend.size in sizes and isinstance(backend, wanted.get("backend") or du.AbstractBackend)
        keep.append(fits)
    config.hook.pytest_deselected(items=[item for item, fits in zip(items, keep) if not fits])
    items[:] = [item for item, fits in zip(items, keep) if fits]


@pytest.fixture(scope="session")
def backend():
    """The backend the launcher started, or a world of one outside a launcher."""
    return du.initialize()


@pytest.fixture(autouse=True)
def a_process_with_no_fully_sharded_model_yet(monkeypatch):
    """Each test starts as a job of its own would: once a model was fully sharded in a process, an optimizer
    needs ``model=`` (``fsdp.sharded``); a test that shards one does not ask that of the tests after it."""
    monkeypatch.setattr(du.fsdp, "fully_sharded_in_process", False)
