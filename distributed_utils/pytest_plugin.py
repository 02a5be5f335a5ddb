"""The pytest plugin for the same tests on every rank (``du-launch ... python -m pytest``),
loaded wherever distributed_utils is installed; in a job of several ranks:

- a failed test ends its rank's session at once (like ``-x``), with pytest's report: the rank
  exits 1 and the launcher stops the others and names it (they would wait for it otherwise);
- each rank gets its own ``--basetemp`` (else ranks remove each other's directories);
- hypothesis draws from one seed for every rank (they must issue the same collectives), new
  for each job and shown in the header: ``DU_HYPOTHESIS_SEED=N`` repeats a run."""

import os
import tempfile
from pathlib import Path

import pytest

from .backends import contract


def _in_job() -> bool:
    return (contract.expected_world_size() or 1) > 1


@pytest.hookimpl(tryfirst=True)  # before hypothesis's own plugin reads its seed
def pytest_configure(config):
    if not _in_job():
        return
    job, rank = contract.job_id(), contract.launched_rank()
    if config.option.basetemp is None:
        job_dir = Path(tempfile.gettempdir()) / f"du-tests-{(job or str(os.getppid()))[:12]}"
        job_dir.mkdir(exist_ok=True)
        config.option.basetemp = str(job_dir / f"rank{rank}")
    seed = os.environ.get("DU_HYPOTHESIS_SEED") or (job and str(int(job[:8], 16)))
    if seed and getattr(config.option, "hypothesis_seed", "absent") is None:  # hypothesis, no seed given
        config.option.hypothesis_seed = seed


def pytest_report_header(config):
    seed = getattr(config.option, "hypothesis_seed", None)
    if _in_job() and seed is not None:
        rank = contract.launched_rank()
        return f"rank {rank}: hypothesis seed {seed} (DU_HYPOTHESIS_SEED={seed} repeats it)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _in_job():
        rank = contract.launched_rank()
        item.session.shouldfail = f"rank {rank} failed {item.nodeid}: the other ranks cannot go on without it"
    return report
