"""The primitives every transport implements; everything above `backends/` uses only these."""

import abc
import os
import pickle
import socket

import numpy as np

OPS = ("sum", "avg", "max", "min", "prod")


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

    def allreduce_arrays(self, arrays: list, op: str) -> list:
        """Reduce many arrays at once; transports override this with their fastest form."""
        return [self.allreduce(a, op) for a in arrays]

    def bcast_object(self, obj, root: int):
        """Root's picklable ``obj`` on every rank."""
        payload = _to_bytes(obj) if self.rank == root else np.empty(0, np.uint8)
        n = self.bcast(np.array([payload.size], np.int64), root)[0]
        if self.rank != root:
            payload = np.empty(int(n), np.uint8)
        return pickle.loads(self.bcast(payload, root).tobytes())

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


def _to_bytes(obj) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
