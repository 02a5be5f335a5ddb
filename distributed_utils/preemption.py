"""Preemption: a scheduler's signal becomes one step, agreed by every rank, to save at.

Schedulers send SIGTERM (or SIGUSR1: ``#SBATCH --signal=B:USR1@90``), then kill the job;
du-launch forwards either to every rank as SIGUSR1 and waits ``--grace`` seconds. After its
first call, ``preempted`` makes both signals mark this rank instead of ending it; once it
returned True, du-launch exits 75 (``contract.PREEMPTED_EXIT``) when the job ends well."""

import signal

import numpy as np

from .backends.contract import PREEMPTED, say_record
from .collectives import allreduce

_received = []  # the signals this process received since the first preempted()
_told = False  # whether du-launch was told (once)


def _mark(signum, frame):
    _received.append(signum)


def preempted(backend) -> bool:
    """Collective (one 1-byte allreduce): True on every rank once any rank has received SIGTERM
    or SIGUSR1 since its first call. At the same step on every rank: ``if du.preempted(backend):``
    save one checkpoint and return."""
    global _told
    if signal.getsignal(signal.SIGUSR1) is not _mark:  # (signals are set from the main thread only)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, _mark)
    if not allreduce(backend, np.uint8(bool(_received)), "max"):  # (bools cost two casts more)
        return False
    if not _told:
        say_record(PREEMPTED, signals=[signal.Signals(s).name for s in _received])
        _told = True
    return True
