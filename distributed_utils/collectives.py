"""The collectives, and the one door every collective of the library passes (``run_collective``).

Every function here that takes a backend is collective: all ranks call it, in the same order,
with arrays of the same shape and dtype. Python objects travel pickled, as bytes."""

import hashlib
import operator
import pickle

import mlx.core as mx
import numpy as np

from . import watchdog
from .arrays import DTYPE_NAMES, MX_BY_NUMPY, dtype_name, evaluate, is_floating, to_mx, to_numpy
from .backends import AbstractBackend, BackendUnavailableError

#: Lux's ``DistributedUtils.avg``: the averaging reduction op.
avg = "avg"

#: The op names, and Python's own functions for them (as Lux takes Julia's).
_OPS = {name: name for name in ("sum", "avg", "max", "min", "prod")}
_OPS.update({operator.add: "sum", operator.mul: "prod", max: "max", min: "min"})


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (debug mode); raised on every rank with the same message."""


def bcast(backend, x, root: int = 0):
    """Root's ``x`` on every rank, bit for bit: arrays (of the same shape and dtype on every
    rank), or any picklable object, sent whole from root."""
    check_root(backend, root)
    if not isinstance(x, (mx.array, np.ndarray)):
        return _exchange_objects(backend, x, root)[0]
    arr, back = _as_array(x)
    out = run_collective(backend, "bcast", to_mx(arr), lambda a: backend.bcast(a, root), f"root={root}")
    return back(out)


def allreduce(backend, x, op):
    """The elementwise reduction of every rank's ``x``: op is "sum", "avg" (``du.avg``),
    "max", "min", "prod", or operator.add, max, min, operator.mul. Returns the kind of ``x``
    (mx.array, numpy array or Python scalar; a Python int travels as int64, and its sum wraps
    as numpy's does). Bools: sum/max are OR, min/prod are AND. Floating max/min: a NaN on any
    rank gives NaN there, on every backend."""
    check_backend(backend)
    arr, back = _as_array(x)
    try:
        op = _OPS[op]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown reduction op {op!r}: use 'sum', 'avg' (du.avg), 'max', 'min', 'prod', "
            "or operator.add, max, min, operator.mul"
        ) from None
    if op == "avg" and not is_floating(arr.dtype):
        raise TypeError(f"op 'avg' needs a floating or complex dtype, got {arr.dtype}; use 'sum'")
    bools, nan_wins = arr.dtype in {mx.bool_, np.dtype(bool)}, op in ("max", "min") and is_floating(arr.dtype)
    if nan_wins and dtype_name(arr.dtype).startswith("complex"):  # (mx or numpy dtype)
        raise TypeError(f"op {op!r} is not defined for complex numbers ({arr.dtype})")
    arr = to_mx(arr) if bools or nan_wins or not backend.host_buffers else arr  # (else MPI on numpy's memory)
    if bools:  # as bytes: MPI aborts on bools
        arr, op = arr.astype(mx.uint8), "max" if op in ("sum", "max") else "min"
    if nan_wins:
        return back(_nan_wins(backend, arr, op))
    mine = arr is not x  # a copy of ours: the transport may write the result into it
    out = allreduce_arrays(backend, [arr], op, in_place=mine, what="allreduce")[0]
    return back(out.astype(mx.bool_) if bools else out)


def _nan_wins(backend, a, op):
    """max or min where a NaN on any rank wins (on every transport): NaNs sent as the losing infinity,
    beside NaN flags (1 for max, -1 for min: the op spreads them)."""
    nan = mx.isnan(a).reshape(-1)
    loser, flag = (-mx.inf, 1) if op == "max" else (mx.inf, -1)
    both = mx.concatenate([mx.where(nan, loser, a.reshape(-1)).astype(a.dtype), (nan * flag).astype(a.dtype)])
    out = allreduce_arrays(backend, [both], op, what="allreduce")[0]
    return mx.where(out[a.size :] != 0, mx.nan, out[: a.size]).astype(a.dtype).reshape(a.shape)


def weighted_mean(backend, value, weight) -> float:
    """Collective: ``sum_r value_r * weight_r / sum_r weight_r`` on every rank, in one allreduce
    (NaN if every weight is 0): the loss per token over every rank's tokens, say."""
    v, w = (float(x.item()) if isinstance(x, mx.array) else float(x) for x in (value, weight))
    total = allreduce(backend, np.array([v * w, w]), "sum")
    return float(total[0] / total[1]) if total[1] else float("nan")


def reduce(backend, x, op, root: int = 0):
    """Like ``allreduce``; the result is defined on ``root`` (other ranks get it too)."""
    check_root(backend, root)
    return allreduce(backend, x, op)


def allgather(backend, x):
    """Every rank's array ``x`` concatenated along the first axis in rank order (0-d ones: a 1-d
    array); anything else, the list of every rank's ``x``."""
    check_backend(backend)
    if not isinstance(x, (mx.array, np.ndarray)):
        return _exchange_objects(backend, x)
    arr, back = _as_array(x)
    return back(run_collective(backend, "allgather", mx.atleast_1d(to_mx(arr)), backend.allgather))


def barrier(backend):
    """Returns on each rank once every rank has reached it."""
    run_collective(check_backend(backend), "barrier", [], lambda _: backend.barrier())


def reduce_scatter_sum(backend, x, scale: float = 1.0):
    details = _shown("sum", scale)
    return run_collective(backend, "reduce_scatter", x, lambda a: backend.reduce_scatter(a, scale), *details)


def _shown(op, scale) -> tuple:  # (how a reduction's op and scale show in reports)
    return (op,) if scale == 1.0 else (op, f"scale={scale:.4g}")


def average_factor(size: int) -> float:
    """What "avg" multiplies a sum over ``size`` ranks by: 1 / size (decided here, once)."""
    return 1.0 / size


def allreduce_arrays(backend, arrays: list, op, in_place=False, what="allreduce_arrays"):
    """Collective (every all-reduce's path): each (numeric) mx.array of ``arrays`` reduced with ``op``.
    ``in_place``: the arrays are handed over; the transport may write the results in them."""
    shown, scale = op, 1.0
    if op == "avg":
        op, scale = "sum", average_factor(backend.size)
    return run_collective(backend, what, arrays, lambda a: backend.allreduce(a, op, scale, in_place), shown)


def start_sum(backend, arrays: list, scale: float = 1.0, in_place=False) -> "Started":
    """Collective: start the sum across ranks of each of ``arrays`` times ``scale`` on the backend's
    communication stream (MLX; MPIBackend sums at once), while this rank computes on (``in_place``: the arrays are
    handed over, and no computation to come reads their memory). Several may be in flight: they travel in
    the order started. ``Started.wait()`` gives the sums; any other collective waits for every sum in flight
    first (one thread drives a transport at a time)."""
    details = _shown("sum", scale)
    return run_collective(
        backend, "start_sum", arrays, lambda a: backend.start_sum(a, scale, in_place), *details, start=True
    )


class Started:
    """A ``start_sum`` in flight: ``wait()`` gives its sums (and those started before it), each wait a
    collective of its own (``wait(#N start_sum(...))``: watched, and in the account as a collective)."""

    def __init__(self, backend, text: str, done):
        self.backend, self.text, self.done, self.results = backend, text, done, None

    def wait(self) -> list:
        while self.results is None:
            first = _in_flight.pop(0)
            with watchdog.Collective(first.backend, "wait", (first.text,)):
                try:
                    first.results = first.done()
                except RuntimeError as e:  # (MLX's and mpi4py's: as the door names them)
                    _in_flight.clear()  # (the transport failed: nothing else in flight arrives)
                    raise RuntimeError(f"collective {first.text} failed in the transport: {e}") from e
        return self.results


_in_flight = []  # the start_sum collectives not yet waited for, in the order they were started


def run_collective(backend, what, arrays, primitive, *details, start=False):
    """The one door: ``primitive(arrays)`` as one watched collective, its inputs evaluated before the
    clock starts, its result inside, after the debug check; a transport's error names the rank and the
    collective. ``start``: ``primitive`` starts it and returns the function that waits for it (``Started``).
    While MLX traces a function, nothing is evaluated or checked."""
    if _in_flight and not start:  # (a start_sum travels behind those started before it)
        _in_flight[-1].wait()
    tracing = not evaluate(arrays)
    with watchdog.Collective(backend, what, details, arrays) as call:
        if call is not None and call.debug and backend.size > 1 and not tracing:  # (its gathers: nested)
            differ = "ranks issued different collectives (DU_DEBUG)"
            check_same(backend, differ, {"collective": call.text()}, CollectiveMismatchError)
        try:
            out = primitive(arrays)
            if start:
                out = Started(backend, what if call is None else call.text(limit=3), out)
                _in_flight.append(out)
            else:
                evaluate(out)
        except RuntimeError as e:  # MLX's and mpi4py's
            # (nested: the outermost names it; ours already say what and where)
            if call is None or isinstance(e, (CollectiveMismatchError, BackendUnavailableError)):
                raise
            raise RuntimeError(
                f"rank {backend.rank}: collective {call.text(limit=3)} failed in the transport: {e} "
                "(a peer that died fails so, as do ranks passing different kinds, shapes or dtypes: "
                "DU_DEBUG=1 names those)"
            ) from e
    return out


def _exchange_objects(backend, obj, root=None) -> list:
    """``[root's obj]`` on every rank (``root`` None: every rank's); TypeError if one cannot (un)pickle."""
    senders = range(backend.size) if root is None else [root]
    send = (lambda a: allgather(backend, a)) if root is None else (lambda a: bcast(backend, a, root))
    what = "allgather_object" if root is None else "bcast_object"

    def run(_):
        payload, error = np.empty(0, np.uint8), None
        if backend.rank in senders:
            try:
                payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
            except Exception as e:
                error = f"cannot pickle it: {type(e).__name__}: {e}"
        pairs = send(np.array([_OBJECT_TAG, payload.size])).reshape(-1, 2)  # (tag, size) by sender
        other = [r for r, (tag, size) in zip(senders, pairs) if tag != _OBJECT_TAG or not 0 <= size < 2**40]
        if other:  # a rank sent no size: it is in another collective
            raise CollectiveMismatchError(
                f"rank {backend.rank}: collective {what}: ranks {other} sent no object size: they are in another "
                "collective (a rank made one collective more or fewer than the others; DU_DEBUG=1 names it)"
            )
        sizes = pairs[:, 1]
        rows = send(np.pad(payload, (0, int(sizes.max()) - payload.size))[None])  # (zeros after each payload)
        received = [(obj, None)] if backend.rank == root else [_unpickled(r[:n]) for r, n in zip(rows, sizes)]
        error = error or next((e for _, e in received if e is not None), None)
        failed = allgather(backend, np.array([error is not None]))
        if failed.any():  # (errors are strings: they pickle)
            errors = _exchange_objects(backend, error)
            whose = "the objects ranks gather" if root is None else f"the object rank {root} broadcasts"
            raise TypeError(f"{whose}: " + "; ".join(f"rank {r} {errors[r]}" for r in np.flatnonzero(failed)))
        return [r for r, _ in received]

    return run_collective(backend, what, [], run, *([] if root is None else [f"root={root}"]))


_OBJECT_TAG = 0x64755F6F626A  # "du_obj": announces an object's size, so that a mismatch is seen


def _unpickled(payload: np.ndarray):
    try:
        return (pickle.loads(payload.tobytes()), None) if payload.size else (None, None)
    except Exception as e:
        return None, f"cannot unpickle it: {type(e).__name__}: {e}"


def run_on_root(backend, fn, root, error_type, doing: str):
    """Collective: ``fn()`` run on ``root`` alone, its (picklable) result returned on every
    rank; if it raises, every rank raises ``error_type`` naming root and what it was ``doing``."""
    result, error, cause = None, None, None
    if backend.rank == root:
        try:
            result = fn()
        except Exception as e:  # the other ranks must hear of it rather than wait
            error, cause = f"{type(e).__name__}: {e}", e
    result, error = _exchange_objects(backend, (result, error), root)[0]
    if error is not None:
        raise error_type(f"rank {root} could not {doing}: {error}") from cause  # (root's traceback, on root)
    return result


def check_same(backend, who: str, values: dict, error=ValueError, explain=None):
    """Collective: unless every rank passes the same ``values`` (by repr), ``error`` on every rank naming
    the first that differs and each rank's value (or ``explain(who, every rank's values)``)."""
    digest = np.frombuffer(hashlib.sha256(repr(values).encode()).digest(), np.uint8)
    if (allgather(backend, digest).reshape(backend.size, -1) == digest).all():
        return
    everyone = _exchange_objects(backend, values)
    if explain is not None:
        raise error(explain(who, everyone))
    name = next(name for name in values if len({repr(theirs[name]) for theirs in everyone}) > 1)
    differ = [r for r, theirs in enumerate(everyone) if repr(theirs[name]) != repr(everyone[0][name])]
    shown = ", ".join(f"rank {r}: {theirs[name]!r}" for r, theirs in enumerate(everyone))
    raise error(f"{who}: every rank needs the same {name}; ranks {differ} differ from rank 0 ({shown})")


def _as_array(x):
    """``x`` as an array (a number: numpy's), and the function that gives a result back as ``x``'s kind."""
    if isinstance(x, mx.array):
        return x, lambda r: r
    if not isinstance(x, (np.ndarray, bool, int, float, complex, np.generic)):
        raise TypeError(
            f"cannot reduce a {type(x).__name__}: pass an mx.array, a numpy array or a Python number "
            "(use du.synchronize for trees and objects)"
        )
    arr = np.asanyarray(x)  # (a numpy array: itself)
    if isinstance(x, int) and not isinstance(x, bool) and arr.dtype != np.int64:
        raise TypeError(f"the integer {x} does not fit in int64")
    if arr.dtype not in MX_BY_NUMPY:  # (the dtypes that travel on every backend)
        raise TypeError(f"dtype {arr.dtype} is not supported; use one of {DTYPE_NAMES}")
    return arr, to_numpy if arr is x else lambda r: type(x)(to_numpy(r).item())


def check_backend(backend) -> AbstractBackend:
    if not isinstance(backend, AbstractBackend):
        is_class = isinstance(backend, type) and issubclass(backend, AbstractBackend)
        hint = f"; get it with du.get_distributed_backend(du.{backend.__name__})" if is_class else ""
        raise TypeError(f"expected a backend object, got {backend!r}{hint}")
    return backend


def check_count(value, least: int, what: str, most=None) -> int:
    """``value``, an int >= ``least`` (<= ``most``); else a TypeError (not an int) or ValueError."""
    an_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not (an_int and least <= value <= (value if most is None else most)):
        kind = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise (ValueError if an_int else TypeError)(f"{what} must be an int {kind}, got {value!r}")
    return int(value)


def check_root(backend, root):
    size = check_backend(backend).size
    if not (isinstance(root, (int, np.integer)) and 0 <= root < size):
        raise ValueError(f"root={root!r} is not a rank of this job (0 .. {size - 1})")
