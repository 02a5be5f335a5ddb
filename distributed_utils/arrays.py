"""What an array is here: the dtypes that travel, bit views, numpy <-> mx, signatures."""

import mlx.core as mx
import numpy as np


def dtype_name(dtype) -> str:
    """An mx or numpy dtype's name: "float32", "bfloat16" (mx dtypes do not pickle; their names do)."""
    return str(dtype).removeprefix("mlx.core.")


MX_DTYPES = {dtype_name(d): d for d in vars(mx).values() if isinstance(d, mx.Dtype)}

#: The numpy dtypes a collective accepts (numpy has no bfloat16) -> the mx dtype of the same name.
MX_BY_NUMPY = {np.dtype(name): d for name, d in MX_DTYPES.items() if name != "bfloat16"}
DTYPE_NAMES = "bool, (u)int8-64, float16, bfloat16, float32, float64, complex64"

UINT_BY_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}  # views that carry any array's bits

#: The floats too narrow to sum in (they overflow or round early; MPI has no type for them).
NARROW_FLOATS = (mx.float16, mx.bfloat16)


def widened(a):
    return a.astype(mx.float32) if a.dtype in NARROW_FLOATS else a


def is_floating(dtype) -> bool:
    return dtype.kind in "fc" if isinstance(dtype, np.dtype) else mx.issubdtype(dtype, mx.inexact)


def to_mx(a) -> mx.array:
    """Numpy ``a`` copied as an mx.array of its dtype (``mx.array`` makes float64 float32); else ``a``."""
    if not isinstance(a, np.ndarray):
        return a
    contiguous = a if a.flags.c_contiguous else np.ascontiguousarray(a)  # (which makes 0-d 1-d)
    return mx.array(contiguous, dtype=MX_BY_NUMPY[a.dtype])


def to_numpy(a) -> np.ndarray:
    """A numpy copy of mx.array ``a``, evaluated first (``np.array`` hides its error); numpy ``a`` itself."""
    if isinstance(a, np.ndarray):
        return a
    mx.eval(a)
    return np.array(a)


def own_memory(a: mx.array):
    """``a``'s own memory as a writable C-contiguous numpy view, or None (transposed, broadcast, ...)."""
    mx.eval(a)
    try:
        view = np.asarray(a)
    except BufferError:
        return None
    return view if view.flags.c_contiguous and view.flags.writeable and view.size else None


def contiguous_numpy(a: mx.array) -> np.ndarray:
    """``a``'s values as a C-contiguous numpy array (its own memory if it can; bfloat16 as uint16 bits)."""
    a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    view = own_memory(a)  # zero-copy where it can be (a new graph node costs ~25 us)
    if view is None:  # a contiguous copy, read in place
        a = mx.contiguous(a)
        mx.eval(a)
        view = np.asarray(a)
    return view


def bits(a) -> mx.array:
    """``a``'s bits as a flat ``mx.array`` of unsigned ints of its item size (numpy: the widest dividing)."""
    if isinstance(a, np.ndarray):  # (strings and records too: any item size)
        width = next(w for w in (8, 4, 2, 1) if a.dtype.itemsize % w == 0)
        return to_mx(a.reshape(-1).view(f"u{width}"))
    return a.reshape(-1).view(UINT_BY_SIZE[a.dtype.size])


def signature(x):
    if isinstance(x, (mx.array, np.ndarray)):
        return (dtype_name(x.dtype), tuple(x.shape))
    return type(x).__name__


def show(sig) -> str:
    return f"{sig[0]}{sig[1]}" if isinstance(sig, tuple) else str(sig)


def evaluate(*values) -> bool:
    """``mx.eval(values)`` and True; False while MLX traces a function (``mx.compile``, ``vmap``)."""
    try:
        mx.eval(values)
    except ValueError as e:
        if "function transformations" not in str(e):
            raise
        return False
    return True
