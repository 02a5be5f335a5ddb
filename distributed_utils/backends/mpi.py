"""MPIBackend: collectives through mpi4py on host buffers (Open MPI from the pip wheel by default)."""

import contextlib
import functools

import mlx.core as mx
import numpy as np

from . import contract
from ..arrays import MX_BY_NUMPY, contiguous_numpy, evaluate, own_memory, to_mx, widened
from .base import AbstractBackend, BackendUnavailableError
from .mlx import MLXMPIBackend

#: Sums in place go through MPI in pieces of this size (the sizes side by side: docs/architecture.md).
PIECE_BYTES = 2**20
#: Results up to this size are received into numpy and copied (see ``_received``).
SMALL_BYTES = 64 * 2**10


class MPIBackend(AbstractBackend):
    """MPI through mpi4py on host buffers: an ``mx.array``'s memory, read through a numpy view, is reduced
    in place when handed over (``in_place``), else in a copy; numpy arrays stay in numpy. While MLX
    traces a function, the collectives are MLX's own MPI ops on the same processes (``MLXMPIBackend``)."""

    launch_name, started_by_du_launch = "mpi", True
    bucket_bytes = 64 * 2**10  # (MPI's latency is small: packing beyond that only costs a copy)
    host_buffers = True

    def __init__(self, comm=None):
        if contract.mlx_available("mpi"):  # first, so that MLXMPIBackend can still start here afterwards
            with contextlib.suppress(BackendUnavailableError):  # (MPIBackend does not need it)
                contract.start_mlx_mpi()
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}

    @functools.cached_property
    def _traced(self) -> MLXMPIBackend:
        """MLX's MPI backend on these processes, which runs the collectives of traced functions (arrays that
        ``evaluate`` cannot evaluate; numpy's, ``host_buffers``, it always can)."""
        try:
            traced = MLXMPIBackend()
        except BackendUnavailableError as e:
            raise ValueError(
                "MPIBackend reduces evaluated host buffers, so inside mx.compile it needs MLX's own "
                f"MPI backend, which cannot start here ({e}): compile the gradient computation and "
                "reduce outside it, or use an MLX backend"
            ) from e
        if (traced.rank, traced.size) != (self.rank, self.size):
            raise ValueError(
                f"MPIBackend: MLX's MPI backend sees rank {traced.rank} of {traced.size}, "
                f"not {self.rank} of {self.size}; it cannot run this job's collectives in mx.compile"
            )
        return traced

    def allreduce(self, arrays, op, scale=1.0, in_place=False):
        if not evaluate(arrays):
            return self._traced.allreduce(arrays, op, scale)
        return self._reduced(arrays, arrays, op, scale, in_place)

    def start_sum(self, arrays, scale=1.0, in_place=False):
        # Summed now, on this thread: on a thread of their own, Open MPI's sums beside MLX's computation
        # made a step 1.7-3.8x slower on this 2-core machine (benchmarks/overlap.py).
        if not evaluate(arrays):
            return self._traced.start_sum(arrays, scale)
        given = arrays
        if not in_place:  # scaled by MLX into memory of its own: MLX may still read the arrays' memory (a
            arrays, scale = [widened(a) * scale for a in arrays], 1.0  # view of it) for what it computes next
        out = self._reduced(arrays, given, "sum", scale, True)
        return lambda: out

    def _reduced(self, arrays, like, op, scale, in_place) -> list:
        """``arrays`` all-reduced in ``_buffers``, a piece at a time; the results as ``like``'s kinds."""
        work, views = _buffers(arrays, in_place)
        for flat in [view.reshape(-1) for view in views if view is not None]:
            for start in range(0, flat.size, PIECE_BYTES // flat.itemsize):
                piece = flat[start : start + PIECE_BYTES // flat.itemsize]
                if scale != 1.0:  # before its sum, as on MLX's backends, while in the cache
                    np.multiply(piece, scale, out=piece, casting="unsafe")
                self.comm.Allreduce(self._MPI.IN_PLACE, piece, op=self._ops[op])
        return [_like(w, a) for w, a in zip(work, like)]

    def bcast(self, x, root):
        if not evaluate([x]):
            return self._traced.bcast(x, root)
        buf = contiguous_numpy(x)
        if self.rank == root:
            self.comm.Bcast(_bytes(buf), root=root)
            return x
        return _received(buf.shape, buf.dtype, x.dtype, lambda out: self.comm.Bcast(out, root=root))

    def allgather(self, x):
        if not evaluate([x]):
            return self._traced.allgather(x)
        buf = contiguous_numpy(x)
        shape = (self.size * buf.shape[0],) + buf.shape[1:]
        return _received(shape, buf.dtype, x.dtype, lambda out: self.comm.Allgather(_bytes(buf), out))

    def barrier(self):
        self.comm.Barrier()

    def reduce_scatter(self, x, scale=1.0):
        if not evaluate([x]):
            return self._traced.reduce_scatter(x, scale)
        sent = contiguous_numpy(widened(x))  # (x's own memory; MPI has no float16 or bfloat16)
        part = np.empty(sent.size // self.size, sent.dtype)
        self.comm.Reduce_scatter_block(sent, part, op=self._MPI.SUM)
        if scale != 1.0:
            np.multiply(part, scale, out=part, casting="unsafe")
        return _like(part, x)

    def split(self, color):
        return MPIBackend(self.comm.Split(color, self.rank))


def _buffers(arrays, in_place):
    """What an all-reduce of ``arrays`` reduces in (``work``, as returned) and the numpy views of it that MPI
    writes (None: nothing to send); ``in_place``: the arrays are handed over."""
    # Only the copying depends on this rank; the MPI calls depend on dtypes and sizes alone.
    in_place = in_place and len(arrays) == 1  # (several arrays may share memory: each reduced in a copy)
    work, views = [], []
    for a in arrays:
        if isinstance(a, np.ndarray):  # (host_buffers) reduced in a, handed over, or in a C-ordered copy
            wide = np.float32 if a.dtype == np.float16 else a.dtype
            mine = in_place and a.flags.c_contiguous and a.flags.writeable and wide == a.dtype
            w = a if mine else np.array(a, wide, order="C")
            view = w
        else:
            w = widened(a)  # (no MPI type: reduced in float32, rounded once)
            view = own_memory(w) if (in_place or w is not a) and w.size else None
            if view is None and w.size and w.nbytes <= SMALL_BYTES:  # a small copy: numpy's (_received)
                w = np.array(w, order="C")  # (evaluated, of a dtype numpy has: not narrow)
                view = w
            elif view is None and w.size:  # a copy to reduce in
                w = to_mx(contiguous_numpy(w))
                view = own_memory(w)
        work.append(w)
        views.append(view)
    return work, views


def _received(shape, dtype, mx_dtype, receive) -> mx.array:
    """A new mx.array of ``shape`` (seen as ``mx_dtype``) that ``receive(bytes)`` writes as numpy ``dtype``:
    into its own memory, or up to ``SMALL_BYTES`` into numpy's, then copied (cheaper than a new MLX array);
    of no elements, MLX's own (an empty array on numpy's memory hung MLX's reductions of it), nothing sent."""
    if 0 in shape:
        return mx.zeros(shape, mx_dtype)
    if int(np.prod(shape)) * dtype.itemsize <= SMALL_BYTES:
        out = np.zeros(shape, dtype)  # (zeros, as mx.zeros: no stale memory if a rank sent less)
        receive(_bytes(out))
        out = to_mx(out)
    else:
        out = mx.zeros(shape, MX_BY_NUMPY[dtype])
        receive(_bytes(own_memory(out)))
    return out if out.dtype == mx_dtype else out.view(mx_dtype)


def _like(result, a):
    result = to_mx(result) if isinstance(a, mx.array) else result
    return result if result.dtype == a.dtype else result.astype(a.dtype)


def _bytes(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1).view(np.uint8)
