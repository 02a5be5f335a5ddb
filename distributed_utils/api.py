"""initialize / get_distributed_backend and the collectives, for any backend.

Every function here that takes a backend is collective: all ranks call it, in the
same order, with arrays of the same shape and dtype. Each runs under the watchdog
(``watchdog.py``) and returns evaluated arrays, except inside ``mx.compile``/``vmap``
where MLX results stay lazy.
"""

import operator
import os

import mlx.core as mx
import numpy as np

from . import watchdog
from .backends import BY_LAUNCH_NAME, OPS, AbstractBackend, MLXBackend, RingBackend

#: Lux's ``DistributedUtils.avg``: the averaging reduction op.
avg = "avg"

_BACKENDS = {}

_OP_ALIASES = {
    operator.add: "sum", operator.mul: "prod", max: "max", min: "min",
    np.add: "sum", np.multiply: "prod", np.maximum: "max", np.minimum: "min",
    mx.add: "sum", mx.multiply: "prod", mx.maximum: "max", mx.minimum: "min",
}  # fmt: skip

_DTYPES = ", ".join(["bool", "(u)int8-64", "float16", "bfloat16", "float32", "float64", "complex64"])


def initialize(backend_type=None, *, timeout=None, debug=None, **kwargs) -> AbstractBackend:
    """Start ``backend_type`` (a class such as ``du.MPIBackend``) in this process; collective.

    Idempotent: later calls return the backend started first. With no argument, the
    backend that ``du-launch`` started (or MPI under ``mpirun``, else a world of one).
    ``timeout``: seconds after which a collective that has not finished ends the job
    (default ``DU_TIMEOUT``, else 300; 0: never); ``debug``: check every collective's
    op, shapes and dtypes across ranks first (default ``DU_DEBUG``). Pass the same on every rank.
    """
    if backend_type is None:
        backend_type = launched_backend_type()
    _check_backend_type(backend_type)
    watchdog.configure(timeout, debug)
    if backend_type not in _BACKENDS:
        with watchdog.connecting(f"initialize({backend_type.__name__})"):
            backend = backend_type(**kwargs)
            backend.handshake()
        _BACKENDS[backend_type] = backend
    return _BACKENDS[backend_type]


def initialized(backend_type) -> bool:
    """Whether ``initialize(backend_type)`` has run in this process."""
    _check_backend_type(backend_type)
    return backend_type in _BACKENDS


def get_distributed_backend(backend_type) -> AbstractBackend:
    """The backend object that ``initialize(backend_type)`` started."""
    _check_backend_type(backend_type)
    if backend_type not in _BACKENDS:
        raise RuntimeError(
            f"{backend_type.__name__} is not initialized: call "
            f"du.initialize(du.{backend_type.__name__}) first (on every rank)"
        )
    return _BACKENDS[backend_type]


def launched_backend_type() -> type:
    """The backend class the launcher asked for (``DU_BACKEND``), else a guess from the environment."""
    name = os.environ.get("DU_BACKEND")
    if name is not None:
        if name not in BY_LAUNCH_NAME:
            raise ValueError(f"DU_BACKEND={name!r} is not one of {sorted(BY_LAUNCH_NAME)}")
        return BY_LAUNCH_NAME[name]
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        return BY_LAUNCH_NAME["mpi"]
    return RingBackend  # with no MLX_HOSTFILE: a world of one process


def local_rank(backend) -> int:
    """This process's rank in the whole job (Lux's ``local_rank``: 0 .. total_workers - 1)."""
    return _check_backend(backend).rank


def total_workers(backend) -> int:
    """The number of processes in the job."""
    return _check_backend(backend).size


def node_rank(backend) -> int:
    """This process's rank among the job's processes on the same host."""
    return _check_backend(backend).node_rank


def bcast(backend, x, root: int = 0):
    """Root's ``x`` on every rank, bit for bit. Arrays of the same shape and dtype on every
    rank; anything else (scalars, str, None, picklable objects) is sent whole from root."""
    _check_root(backend, root)
    if _is_array(x):
        with watchdog.collective(backend, "bcast", (_check_array(x), root)):
            return _evaluated(backend.bcast(x, root))
    return backend.bcast_object(x, root)


def allreduce(backend, x, op):
    """The elementwise reduction of every rank's ``x``: op is "sum", "avg" (``du.avg``),
    "max", "min", "prod", or operator.add, max, min, operator.mul. Returns the kind of ``x``
    (mx.array, numpy array or Python scalar). Bools: sum/max are OR, min/prod are AND."""
    op = _op_name(op)
    arr, back = _as_array(_check_backend(backend), x)
    _check_op_dtype(op, arr.dtype)
    with watchdog.collective(backend, "allreduce", (arr, op)):
        return back(_evaluated(backend.allreduce(arr, op)))


def reduce(backend, x, op, root: int = 0):
    """Like ``allreduce``; the result is defined on ``root`` (other ranks get it too)."""
    _check_root(backend, root)
    return allreduce(backend, x, op)


def allgather(backend, x):
    """Arrays: every rank's ``x`` concatenated along the first axis in rank order (0-d arrays
    become a 1-d array of length total_workers). Anything else: a list of every rank's ``x``."""
    _check_backend(backend)
    if _is_array(x):
        with watchdog.collective(backend, "allgather", (_check_array(x),)):
            return _evaluated(backend.allgather(x))
    return backend.allgather_object(x)


def barrier(backend):
    """Returns on each rank once every rank has reached it."""
    _check_backend(backend).barrier()


def _evaluated(out):
    """``out``, evaluated inside the caller's watched region (lazy while MLX traces a function)."""
    watchdog.evaluate(out)
    return out


def _check_backend_type(backend_type):
    if isinstance(backend_type, AbstractBackend):
        raise TypeError(
            f"expected a backend class such as du.{type(backend_type).__name__}, "
            f"got the backend instance {backend_type!r}"
        )
    if not (isinstance(backend_type, type) and issubclass(backend_type, AbstractBackend)):
        raise TypeError(
            f"expected a backend class (one of du.{', du.'.join(c.__name__ for c in BY_LAUNCH_NAME.values())}), "
            f"got {backend_type!r}"
        )
    if backend_type in (AbstractBackend, MLXBackend):
        raise TypeError(f"{backend_type.__name__} is abstract; use one of its subclasses")


def _check_backend(backend) -> AbstractBackend:
    if not isinstance(backend, AbstractBackend):
        hint = (
            f"; get it with du.get_distributed_backend(du.{backend.__name__})"
            if isinstance(backend, type) and issubclass(backend, AbstractBackend)
            else ""
        )
        raise TypeError(f"expected a backend object, got {backend!r}{hint}")
    return backend


def _check_root(backend, root):
    size = _check_backend(backend).size
    if not (isinstance(root, (int, np.integer)) and 0 <= root < size):
        raise ValueError(f"root={root!r} is not a rank of this job (0 .. {size - 1})")


def _op_name(op) -> str:
    if isinstance(op, str) and op in OPS:
        return op
    try:
        return _OP_ALIASES[op]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown reduction op {op!r}: use 'sum', 'avg' (du.avg), 'max', 'min', 'prod', "
            "or operator.add, max, min, operator.mul"
        ) from None


def _is_array(x) -> bool:
    return isinstance(x, (mx.array, np.ndarray))


_NUMPY_DTYPES = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                        np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64)}  # fmt: skip


def _check_array(x):
    """``x`` if its dtype can travel on every backend, else a TypeError naming it."""
    if isinstance(x, np.ndarray) and x.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"dtype {x.dtype} is not supported; use one of {_DTYPES}")
    return x


def _as_array(backend, x):
    """``x`` as an array, and the function that turns a result back into ``x``'s kind."""
    if _is_array(x):
        return _check_array(x), lambda r: r
    if isinstance(x, (bool, int, float, np.generic)) and not isinstance(x, complex):
        arr = np.asarray(x)
        if isinstance(x, int) and not isinstance(x, bool) and arr.dtype != np.int64:
            raise TypeError(f"the integer {x} does not fit in int64")
        return _check_array(arr), lambda r: type(x)(np.asarray(r).item())
    if isinstance(x, complex):
        raise TypeError(
            "Python complex numbers are double precision, which MLX lacks: "
            "reduce np.complex64(x) or an mx.array instead"
        )
    raise TypeError(
        f"cannot reduce a {type(x).__name__}: pass an mx.array, a numpy array or a Python number "
        "(use du.synchronize for trees and objects)"
    )


def _check_op_dtype(op, dtype):
    kind = np.dtype(dtype).kind if isinstance(dtype, np.dtype) else None
    floating = mx.issubdtype(dtype, mx.inexact) if kind is None else kind in "fc"
    is_complex = dtype == mx.complex64 if kind is None else kind == "c"
    if op == "avg" and not floating:
        raise TypeError(f"op 'avg' needs a floating or complex dtype, got {dtype}; use 'sum'")
    if op in ("max", "min") and is_complex:
        raise TypeError(f"op {op!r} is not defined for complex numbers ({dtype})")
