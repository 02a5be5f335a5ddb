"""Preemption: a scheduler's signal becomes one step, agreed by every rank, to save at.

SLURM and other schedulers send SIGTERM (or, with ``#SBATCH --signal=B:USR1@90``, SIGUSR1
before the time limit), then kill the job a little later; du-launch forwards either to every
rank as SIGUSR1 and gives them ``--grace`` seconds. From its first call on, ``preempted``
makes SIGTERM and SIGUSR1 mark this rank preempted instead of ending it, and returns True on
every rank at the same call once any rank is marked: the loop saves one checkpoint, at one
step, and returns.
"""

import signal

import numpy as np

from .collectives import allreduce

_received = []  # the signals this process received since the first preempted()
_handling = False  # whether preempted() has made SIGTERM and SIGUSR1 call _mark


def _mark(signum, frame):
    _received.append(signum)


def preempted(backend) -> bool:
    """Collective (one 1-byte allreduce): True on every rank once any rank has received
    SIGTERM or SIGUSR1 since its first call. Call it at the same step on every rank::

        if du.preempted(backend):
            du.save_checkpoint(backend, "checkpoints", model=model, optimizer=opt, data=data, step=step, keep=3)
            return
    """
    global _handling
    if not _handling:  # (signals are set from the main thread only)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, _mark)
        _handling = True
    return bool(allreduce(backend, np.uint8(bool(_received)), "max"))  # (bools cost two casts more)
