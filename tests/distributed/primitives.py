"""Counting what a backend's transport is asked to do: its primitives (the contract every
transport implements, ``distributed_utils/backends/base.py``), called by this rank, in order."""

import contextlib

NAMES = ("allreduce", "bcast", "allgather", "barrier", "start_sum", "reduce_scatter")


@contextlib.contextmanager
def counted(backend):
    """``with counted(backend) as calls:`` the names of the primitives called meanwhile."""
    calls = []
    for name in NAMES:
        method = getattr(backend, name)
        setattr(backend, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    try:
        yield calls
    finally:
        for name in NAMES:
            delattr(backend, name)  # the class's own again
