"""MPIBackend: collectives through mpi4py on host buffers (Open MPI from the pip wheel by default)."""

import mlx.core as mx
import numpy as np

from .base import AbstractBackend, BackendUnavailableError, mx_from_numpy
from .mpi_library import start_mlx_mpi


class MPIBackend(AbstractBackend):
    """MPI through mpi4py. Works on evaluated host buffers: an ``mx.array`` is read through a
    zero-copy numpy view and the result is copied into a new ``mx.array``."""

    launch_name = "mpi"

    def __init__(self, comm=None):
        if mx.distributed.is_available("mpi"):
            try:  # first, so that MLXMPIBackend can still start in this process afterwards
                start_mlx_mpi()
            except BackendUnavailableError:
                pass  # MPIBackend does not need it
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}

    def allreduce(self, x, op):
        if x.dtype in (mx.float16, mx.bfloat16, np.float16):
            # MPI has no 16-bit float types: reduce in float32, round once at the end.
            wide = x.astype(mx.float32 if isinstance(x, mx.array) else np.float32)
            return self.allreduce(wide, op).astype(x.dtype)
        if op == "avg":
            total = self.allreduce(x, "sum")
            return (total / self.size).astype(x.dtype)
        buf = host_view(x)
        dtype = buf.dtype
        if dtype == np.bool_:  # reduce bools as bytes: sum/max are OR, min/prod are AND
            buf, op = buf.view(np.uint8), ("max" if op in ("sum", "max") else "min")
        out = np.empty_like(buf)
        self.comm.Allreduce(buf, out, op=self._ops[op])
        return like(out.view(dtype), x)

    def allreduce_arrays(self, arrays, op, in_place=False):
        """With ``in_place=True`` the caller hands ``arrays`` over: each one that is C-contiguous,
        shares no memory with another and has an MPI type (not 16-bit floats, not bool) is
        evaluated and reduced ("sum" or "avg") in its own memory through a zero-copy numpy view,
        and returned as the same object. The rest, and every array without ``in_place``, get
        new arrays."""
        if not in_place or op not in ("sum", "avg"):
            return super().allreduce_arrays(arrays, op)
        try:
            mx.eval([a for a in arrays if isinstance(a, mx.array)])
        except (ValueError, RuntimeError) as e:  # MLX refuses to evaluate while tracing
            if "compil" not in str(e):
                raise
            raise ValueError(
                "MPIBackend reduces evaluated host buffers, so it cannot run inside mx.compile or "
                "mx.vmap: compile the gradient computation and reduce outside it (or use an MLX backend)"
            ) from e
        out, taken = [], []
        for a in arrays:
            view = _own_view(a, taken)
            if view is None:  # a new array; host_view needs a contiguous one
                out.append(self.allreduce(mx.contiguous(a) if isinstance(a, mx.array) else np.ascontiguousarray(a), op))
                continue
            flat = view.reshape(-1)
            step = max(1, _CHUNK_BYTES // flat.itemsize)
            for start in range(0, flat.size, step):  # chunks: the scaling finds them in cache
                chunk = flat[start : start + step]
                self.comm.Allreduce(self._MPI.IN_PLACE, chunk, op=self._MPI.SUM)
                if op == "avg":
                    np.multiply(chunk, 1 / self.size, out=chunk, casting="unsafe")
            out.append(a)
        return out

    def bcast(self, x, root):
        buf = host_view(x)
        if self.rank == root:
            self.comm.Bcast(as_bytes(buf), root=root)
            return x
        out = np.empty_like(buf)
        self.comm.Bcast(as_bytes(out), root=root)
        return like(out, x)

    def allgather(self, x):
        buf = host_view(x)
        out = np.empty((self.size,) + buf.shape, buf.dtype)
        self.comm.Allgather(as_bytes(buf), as_bytes(out))
        return like(out.reshape((-1,) + buf.shape[1:]), x)

    def barrier(self):
        self.comm.Barrier()


#: Arrays reduced in place go through MPI in pieces of this size (see allreduce_arrays).
_CHUNK_BYTES = 4 * 1024**2


def _own_view(a, taken: list):
    """``a``'s memory as a numpy array that MPI can reduce in place, or None: it must be
    writable, C-contiguous, of an MPI type, and overlap no span in ``taken`` (which it joins)."""
    if isinstance(a, mx.array):
        if a.dtype in (mx.float16, mx.bfloat16, mx.bool_):
            return None
        a = host_view(a)
    if a.dtype.kind not in "iufc" or a.dtype == np.float16 or a.size == 0:
        return None
    if not (a.flags.c_contiguous and a.flags.writeable):
        return None
    start = a.__array_interface__["data"][0]
    end = start + a.nbytes
    if any(s < end and start < e for s, e in taken):
        return None
    taken.append((start, end))
    return a


def host_view(x) -> np.ndarray:
    """``x``'s memory as a C-contiguous numpy array: zero-copy for an evaluated ``mx.array``."""
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            x = x.view(mx.uint16)
        mx.eval(x)
        return np.asarray(x)
    return np.require(x, requirements="C")


def like(buf: np.ndarray, x):
    """``buf`` returned as the kind of array ``x`` is."""
    if isinstance(x, mx.array):
        out = mx_from_numpy(buf)
        return out.view(mx.bfloat16) if x.dtype == mx.bfloat16 else out
    return buf


def as_bytes(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1).view(np.uint8)
