"""The primitives every transport implements; everything above `backends/` uses only these."""

import abc
import functools
import os
import pickle
import socket

import mlx.core as mx
import numpy as np

from .. import watchdog

OPS = ("sum", "avg", "max", "min", "prod")

#: The primitives that run under the watchdog (in every subclass that defines them).
COLLECTIVES = ("allreduce", "allreduce_arrays", "bcast", "bcast_object", "allgather", "allgather_object", "barrier")


class BackendUnavailableError(RuntimeError):
    """The transport behind a backend cannot run on this machine or in this process."""


class AbstractBackend(abc.ABC):
    """A fixed group of processes that run the same collectives in the same order.

    Subclasses set ``rank`` and ``size`` in ``__init__`` and implement the array
    primitives. Array primitives take an ``mx.array`` or a ``numpy.ndarray`` and
    return the same kind; every rank must pass the same shape and dtype.
    """

    rank: int
    size: int
    #: The launcher's name for this backend (``du-launch --backend NAME``).
    launch_name: str = ""

    #: This process's rank among the processes on its host; set by ``handshake``.
    node_rank: int = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in COLLECTIVES:
            if name in cls.__dict__:
                setattr(cls, name, _watched(name, cls.__dict__[name]))

    @abc.abstractmethod
    def allreduce(self, x, op: str):
        """Elementwise reduction of ``x`` over all ranks; ``op`` is one of ``OPS``."""

    @abc.abstractmethod
    def bcast(self, x, root: int):
        """Root's ``x``, bit for bit, on every rank."""

    @abc.abstractmethod
    def allgather(self, x):
        """Every rank's ``x`` concatenated along the first axis, in rank order."""

    @abc.abstractmethod
    def barrier(self):
        """Returns on each rank once every rank has called it."""

    def allreduce_arrays(self, arrays: list, op: str, in_place: bool = False) -> list:
        """Reduce many arrays at once; transports override this with their fastest form.
        ``in_place``: the caller hands the arrays over, and a transport may overwrite them."""
        return [self.allreduce(a, op) for a in arrays]

    def bcast_object(self, obj, root: int):
        """Root's picklable ``obj`` on every rank; if root cannot pickle it, every rank raises."""
        payload, error = np.empty(0, np.uint8), None
        if self.rank == root:
            try:
                payload = _to_bytes(obj)
            except Exception as e:  # tell the other ranks rather than leave them waiting
                payload, error = _to_bytes(_Unpicklable(f"{type(e).__name__}: {e}")), e
        n = self.bcast(np.array([payload.size], np.int64), root)[0]
        if self.rank != root:
            payload = np.empty(int(n), np.uint8)
        received = pickle.loads(self.bcast(payload, root).tobytes())
        if error is not None:
            raise error
        if isinstance(received, _Unpicklable):
            raise TypeError(f"rank {root} could not pickle the object it broadcasts ({received.reason})")
        return received

    def allgather_object(self, obj) -> list:
        """The list of every rank's picklable ``obj``, in rank order."""
        payload = _to_bytes(obj)
        sizes = self.allgather(np.array([payload.size], np.int64))
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[: payload.size] = payload
        rows = self.allgather(padded[None]).reshape(self.size, -1)
        return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, sizes)]

    def handshake(self):
        """Collective, once after creation: learn ``node_rank`` and check that every rank
        belongs to the job the launcher started (two jobs on one port cross-connect)."""
        expected = os.environ.get("DU_WORLD_SIZE")
        if expected is not None and int(expected) != self.size:
            raise BackendUnavailableError(
                f"{type(self).__name__}: the launcher started {expected} processes but this "
                f"backend sees a world of {self.size}; launch with "
                f"`du-launch --backend {self.launch_name}` (it was "
                f"`--backend {os.environ.get('DU_BACKEND', '?')}`)"
            )
        peers = self.allgather_object((socket.gethostname(), os.environ.get("DU_JOB_ID")))
        jobs = {job for _, job in peers}
        if len(jobs) > 1:
            by_job = {job: [r for r, (_, j) in enumerate(peers) if j == job] for job in jobs}
            raise RuntimeError(
                f"{type(self).__name__}: rank {self.rank} is connected to processes of another "
                f"job (ranks by job id: {by_job}); two jobs share a port"
            )
        hosts = [host for host, _ in peers]
        self.node_rank = hosts[: self.rank].count(hosts[self.rank])

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


def _watched(name, method):
    """``method`` run as one watched collective (see ``watchdog``); nested calls are part of it."""
    if getattr(method, "_du_watched", False) or getattr(method, "__isabstractmethod__", False):
        return method

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with watchdog.collective(self, name, args):
            return method(self, *args, **kwargs)

    run._du_watched = True
    return run


for _name in COLLECTIVES:
    setattr(AbstractBackend, _name, _watched(_name, AbstractBackend.__dict__[_name]))


#: The unsigned integer dtype of each item size in bytes: views that carry any array's bits.
UINT_BY_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def mx_from_numpy(a: np.ndarray) -> mx.array:
    """A copy of ``a`` as an mx.array of the same dtype (``mx.array`` alone makes float64 float32)."""
    return mx.array(a, dtype=getattr(mx, a.dtype.name.replace("bool", "bool_")))


def _to_bytes(obj) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


class _Unpicklable:
    """What root broadcasts in place of an object it cannot pickle."""

    def __init__(self, reason: str):
        self.reason = reason
