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
        """With ``in_place=True`` the caller hands ``arrays`` over: each one that is C-contiguous
        and shares no memory with another is evaluated and reduced ("sum" or "avg") in its own
        memory through a zero-copy numpy view, and returned as the same object. 16-bit floats
        (no MPI type) are reduced in a float32 copy. The rest, and every array without
        ``in_place``, get new arrays."""
        if not in_place or op not in ("sum", "avg"):
            return super().allreduce_arrays(arrays, op)
        narrow = [a.dtype if isinstance(a, mx.array) and a.dtype in (mx.float16, mx.bfloat16) else None for a in arrays]
        arrays = [a if d is None else a.astype(mx.float32) for a, d in zip(arrays, narrow)]
        try:
            mx.eval([a for a in arrays if isinstance(a, mx.array)])
        except (ValueError, RuntimeError) as e:  # MLX refuses to evaluate while tracing
            if "compil" not in str(e):
                raise
            raise ValueError(
                "MPIBackend reduces evaluated host buffers, so it cannot run inside mx.compile or "
                "mx.vmap: compile the gradient computation and reduce outside it (or use an MLX backend)"
            ) from e
        # Decide (and copy) everything before overwriting anything: arrays may share memory. Only
        # the copying depends on this rank; the MPI calls depend on dtypes and sizes alone.
        plans, taken = [], []
        for a in arrays:
            view = _own_view(a, taken) if _in_place_dtype(a.dtype) else None
            copy = view is None and _in_place_dtype(a.dtype)
            if copy:
                view = np.array(host_view(a) if isinstance(a, mx.array) else a, order="C")
            plans.append((a, view, copy))
        for _, view, _ in plans:
            if view is not None:
                self._sum_in_place(view)
        out = []
        for (a, view, copy), narrow_dtype in zip(plans, narrow):
            if view is None:
                a = self.allreduce(a, op)
            else:
                if op == "avg":  # after all the sums: scaling between them would skew the ranks
                    np.multiply(view, 1 / self.size, out=view, casting="unsafe")
                a = like(view, a) if copy else a
            out.append(a if narrow_dtype is None else a.astype(narrow_dtype))
        return out

    def _sum_in_place(self, view):
        flat = view.reshape(-1)
        step = max(1, _PIECE_BYTES // flat.itemsize)
        for start in range(0, flat.size, step):
            self.comm.Allreduce(self._MPI.IN_PLACE, flat[start : start + step], op=self._MPI.SUM)

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


#: In-place reductions go through MPI in pieces of this size: on one host (Open MPI 5, 2 ranks)
#: 113 MB of MLX arrays took 29 ms in 4 MiB pieces against 62 ms in one call.
_PIECE_BYTES = 4 * 2**20


def _in_place_dtype(dtype) -> bool:
    """Whether MPI can sum arrays of ``dtype`` in place (16-bit floats and bool: no)."""
    if isinstance(dtype, np.dtype):
        return dtype.kind in "iufc" and dtype != np.float16
    return dtype not in (mx.float16, mx.bfloat16, mx.bool_)


def _own_view(a, taken: list):
    """``a``'s own memory as a writable C-contiguous numpy array that overlaps no span in
    ``taken`` (it joins them), or None."""
    view = a
    if isinstance(a, mx.array):  # its raw memory: host_view would hand a strided array's copy
        mx.eval(a)
        try:
            view = np.asarray(a)
        except BufferError:  # layouts numpy cannot view
            return None
    if not (view.flags.c_contiguous and view.flags.writeable) or view.size == 0:
        return None
    start = view.__array_interface__["data"][0]
    end = start + view.nbytes
    if any(s < end and start < e for s, e in taken):
        return None
    taken.append((start, end))
    return view


def host_view(x) -> np.ndarray:
    """``x``'s memory as a C-contiguous numpy array: zero-copy for an evaluated ``mx.array``."""
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            x = x.view(mx.uint16)
        x = mx.contiguous(x)  # transposed, broadcast or sliced arrays have no flat buffer
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
