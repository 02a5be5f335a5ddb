"""The one reduction of gradients: ``reduce_gradients``, a free function over a tree (like
``mlx.nn.average_gradients``), and ``Reduction``, which every reduction of floating arrays
in the library goes through (``DistributedOptimizer``, its sharded state, ``DiLoCo``).

``Reduction`` decides once, from the op, the world size N, the weight and the compression,
how each array g travels and comes back:

    sent   = g * w / unit, in the wire dtype          (w: this rank's weight, else 1)
    result = (sum over the ranks of sent) * unit * factor, in g's dtype
    factor = scale / (sum of the weights) when weighted, else scale / N ("avg") or scale ("sum")

    compression      wire dtype                              unit
    None             g's                                     1 (unweighted: the transport scales)
    bfloat16/float16 that dtype (g's when it is no wider)    N, so that the sum cannot overflow
    int8             int8                                    (max over the ranks of |g w|) / (127 // N)
"""

import functools

import mlx.core as mx
import numpy as np

from .arrays import evaluate
from .collectives import allgather, allreduce_arrays, reduce_scatter_sum, start_sum
from .tree import GRADIENT_BUCKET_BYTES, buckets, describe, floating_leaves, pack, replace_arrays, unpack
from .tree import verify_same_structure


def reduce_gradients(
    backend,
    gradients,
    *,
    op="avg",
    scale=1.0,
    weight=None,
    compression=None,
    bucket_bytes=None,
    verify=True,
    what="reduce_gradients(grads)",
):
    """Collective: the floating mx.arrays of ``gradients`` (a tree) reduced across ranks, in a
    tree of the same structure (other leaves pass through); the table: this module's docstring.

    - ``op``: "avg" (N ranks at batch B step like one process at batch N*B) or "sum", times ``scale``.
    - ``weight``: this rank's weight (a number or 0-d mx.array: its tokens, say): the result is
      ``sum_r w_r g_r / sum_r w_r`` (zeros if every weight is 0), as one process on the union.
    - ``compression``: ``mx.bfloat16``/``mx.float16`` (or their names), pre-divided by N so that
      the sum cannot overflow (MPIBackend sends float32); ``"int8"``: ``127 // N`` levels a side
      of a per-array scale found in one small allgather (for DiLoCo's pseudo-gradients).
    - ``bucket_bytes``: arrays smaller than this travel packed by dtype, this many bytes a
      collective (0: each alone; default 32 MiB).
    - ``verify``: first check, in one 32-byte allgather, that every rank passes the same tree
      and weighting (not while MLX traces), else ``TreeMismatchError`` naming ``what`` on every rank.

    On MPIBackend, arrays that can be (evaluated, contiguous, not sharing memory) are reduced
    in their own memory and hold the result. In a world of one they come back as they are.
    """
    reduction = Reduction(backend, op, compression, bucket_bytes)
    weight = None if weight is None else as_weight(weight)
    leaves = reduction.leaves(gradients, weight, what, verify)
    return replace_arrays(gradients, reduction.allreduce([g for _, g in leaves], scale, weight))


class Reduction:
    """How floating arrays are reduced across ranks (see the module's docstring); collective."""

    def __init__(self, backend, op="avg", compression=None, bucket_bytes=None):
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' (du.avg) or 'sum', got {op!r}")
        self.backend, self.op, self.compression = backend, op, as_compression(compression)
        self.bucket_bytes = GRADIENT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes

    def leaves(self, tree, weight, what, verify=True) -> list:
        """Collective: ``[(key, array)]``, the (floating, else TypeError) mx.arrays of ``tree``, once
        every rank passes the same tree, weighted alike (else ``TreeMismatchError``)."""
        if weight is not None and self.op != "avg":
            raise ValueError(f"{what}: weight= gives a weighted mean, so op must be 'avg', not {self.op!r}")
        if verify and self.backend.size > 1 and evaluate(tree):  # (not while MLX traces)
            weighted = [("(weight)", "weighted")] if weight is not None else []
            verify_same_structure(self.backend, describe(tree) + weighted, what)
        return floating_leaves(tree, what)  # after the check: the same error on every rank

    def allreduce(self, leaves, scale=1.0, weight=None) -> list:
        """Collective: each of ``leaves`` reduced, times ``scale`` (``weight``: this rank's, 0-d float32)."""
        return self.start(leaves, scale, weight, later=False)()

    def start(self, leaves, scale=1.0, weight=None, later=True):
        """Collective: ``allreduce``, started (``later``: while this rank computes); returns its wait."""
        if self.backend.size == 1 and weight is None:
            alone = leaves if scale == 1.0 else [g * scale for g in leaves]
            return lambda: alone
        _raise_cache_limit(4 * sum(g.nbytes for g in leaves))
        if self.compression is None and weight is None:  # as they are: the transport scales
            return _bucketed(self.backend, leaves, self._factor(scale), self.bucket_bytes, later)
        units, total = self._units(leaves, weight)
        weights = [weight.reshape(1)] if weight is not None and total is None else []  # with the float32 ones
        sent = [self._sent(g, unit, weight) for g, unit in zip(leaves, units)]
        summed = _bucketed(self.backend, sent + weights, 1.0, self.bucket_bytes, later)

        def result():
            sums = summed()
            factor = self._factor(scale, sums[-1] if weights else total)
            return [_scaled(s, unit * factor, g.dtype) for s, g, unit in zip(sums, leaves, units)]

        return result

    def reduce_scatter(self, flats, scale=1.0, weight=None) -> list:
        """Collective: this rank's part of what ``allreduce`` gives for each of ``flats`` (1-d, their
        lengths multiples of N), by the transport's reduce-scatter."""
        _raise_cache_limit(4 * sum(flat.nbytes for flat in flats))
        total = None if weight is None else allreduce_arrays(self.backend, [weight.reshape(1)], "sum")[0]
        unit = 1.0 if self.compression is None else float(self.backend.size)
        factor = unit * self._factor(scale, total)
        sent = [flat if unit == 1.0 and weight is None else self._sent(flat, unit, weight) for flat in flats]
        return [
            _scaled(reduce_scatter_sum(self.backend, s), factor, flat.dtype) for s, flat in zip(sent, flats)
        ]

    def _units(self, leaves, weight):
        """Per leaf, what one unit on the wire is worth; and the total weight if int8's allgather
        (of each array's largest magnitude) brought it."""
        n = self.backend.size
        if self.compression != "int8":
            return [1.0 if self.compression is None else float(n)] * len(leaves), None
        w = mx.array(1.0) if weight is None else weight
        local = [
            mx.max(mx.abs(g)).astype(mx.float32) * mx.abs(w) if g.size else mx.array(0.0) for g in leaves
        ]
        everyone = allgather(self.backend, mx.stack(local + [w])[None])
        steps = mx.max(everyone[:, :-1], axis=0) / (127 // n)
        units = [mx.where(s > 0, s, 1.0) for s in steps]  # an array of zeros: any unit
        return units, None if weight is None else mx.sum(everyone[:, -1])

    def _sent(self, g, unit, weight):
        """What travels for ``g``: ``g * weight / unit`` in the wire dtype."""
        narrow = self.compression is None or (self.compression != "int8" and g.dtype.size <= 2)
        return _scaled(g, (1.0 if weight is None else weight) / unit, g.dtype if narrow else self.compression)

    def _factor(self, scale, total=None):
        if total is not None:  # every weight 0: gradients 0
            return scale / mx.maximum(total.reshape(()), mx.array(1e-30, mx.float32))
        return scale / self.backend.size if self.op == "avg" else scale


def as_compression(compression):
    """None, ``mx.bfloat16``, ``mx.float16`` or ``"int8"``, from those or their names."""
    name = None if compression is None else str(compression).removeprefix("mlx.core.")
    if name not in (None, "bfloat16", "float16", "int8"):
        raise ValueError(f"compression must be None, 'bfloat16', 'float16' or 'int8', got {compression!r}")
    return getattr(mx, name) if name in ("bfloat16", "float16") else name


def as_weight(weight) -> mx.array:
    """A rank's weight as a 0-d float32 mx.array."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number, mx.array)):
        raise TypeError(
            f"weight must be a number or a 0-d mx.array (such as a count of tokens), got {weight!r}"
        )
    weight = mx.array(weight, mx.float32) if not isinstance(weight, mx.array) else weight.astype(mx.float32)
    if weight.ndim != 0:
        raise ValueError(f"weight must be 0-d (one number per rank), got shape {weight.shape}")
    return weight


def _bucketed(backend, arrays, scale, bucket_bytes, later=False):
    """The wait for the sums of ``arrays`` times ``scale``, small ones packed (run now, or ``later``)."""
    groups = buckets(arrays, bucket_bytes)
    packed = [pack(arrays, g) for g in groups]
    # in place: the packer's copies, or the caller's own arrays (as documented)
    sums = (
        start_sum(backend, packed, scale)
        if later
        else allreduce_arrays(backend, packed, "sum", scale, in_place=True)
    )

    def unpacked():
        out = [None] * len(arrays)
        for group, total in zip(groups, sums() if later else sums):
            for i, piece in zip(group, unpack(total, arrays, group)):
                out[i] = piece
        return out

    return unpacked


def _scaled(x, s, dtype):
    """``(x * s).astype(dtype)`` (``dtype`` "int8": rounded to the nearest) in one fused pass."""
    return _fused(dtype)(x, s if isinstance(s, mx.array) else mx.array(s, mx.float32))


@functools.cache
def _fused(dtype):  # shapeless, and the scale an array: one trace for every shape and scale
    if dtype == "int8":
        return mx.compile(lambda x, s: mx.round(x * s).astype(mx.int8), shapeless=True)
    return mx.compile(lambda x, s: (x * s).astype(dtype), shapeless=True)


def _raise_cache_limit(nbytes: int):
    """MLX's cache keeps 32 MiB by default: a larger buffer freed each step is mapped anew each step."""
    previous = mx.set_cache_limit(nbytes)
    if previous > nbytes:
        mx.set_cache_limit(previous)
