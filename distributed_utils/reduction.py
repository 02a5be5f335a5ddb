"""The one reduction of floating arrays, ``Reduction.reduce(tree) -> Pending``, that every reduction of
gradients in the library goes through, as an all-reduce or a reduce-scatter.

Decided here, once, from the op, the world size N, the weights and the compression: each
floating leaf g of rank r travels as

    sent   = g * share_r / unit, in the wire dtype
    result = (sum over the ranks of sent) * unit * scale, in g's dtype

    share_r  w_r / (sum of the weights) when weighted (the weights travel first, in one
             allgather); else 1/N ("avg"; for "sum" too, with scale times N: a compressed sum cannot overflow)
    wire     g's dtype, float32 for a float16/bfloat16 g when weighted; with compression its
             dtype (bfloat16, float16: g's when g is no wider; int8)
    unit     1; int8: (max over the ranks of |g| * share_r) / (127 // N), from one allgather

Unweighted and uncompressed, the transport itself multiplies the leaves by share * scale ("sum": by scale):
before the sum (MPI's all-reduce: in their own memory, a piece at a time; its reduce-scatter: after)."""

import functools

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import watchdog
from .arrays import NARROW_FLOATS, dtype_name, evaluate
from .collectives import allgather, average_factor, check_count, reduce_scatter_sum, start_sum
from .tree import buckets, describe, floating_leaves, pack, replace_arrays, unpack, verify_same_structure


def reduce_gradients(
    backend, gradients, *, op="avg", scale=1.0, weight=None, compression=None, bucket_bytes=None, verify=True
):
    """Collective: the floating mx.arrays of ``gradients`` (a tree) reduced across ranks, in a
    tree of the same structure (other leaves pass through); the table: this module's docstring.

    - ``op``: "avg" (N ranks at batch B step like one process at batch N*B) or "sum", times ``scale``.
    - ``weight``: this rank's weight (a number >= 0 or 0-d mx.array: its tokens, say): the result
      is ``sum_r w_r g_r / sum_r w_r`` (zeros if every weight is 0), as one process on the union.
    - ``compression``: ``mx.bfloat16``/``mx.float16`` (or their names), or ``"int8"`` (the table's unit).
    - ``bucket_bytes``: smaller arrays travel packed by dtype, this many bytes a collective (0: each
      alone; default the backend's ``bucket_bytes``); larger ones alone, as they are.
    - ``verify``: first check, in one 32-byte allgather, that every rank passes the same tree
      and weighting (not while MLX traces), else ``TreeMismatchError`` on every rank.

    The arrays of ``gradients`` keep their values (the sums go into memory of their own: the backward pass
    may still read a gradient's memory). In a world of one they come back as they are."""
    reduction = Reduction(backend, op, compression, bucket_bytes)
    watchdog.stepped()  # (a step, for du-launch's account: the reduction of a gradient tree is one)
    return reduction.reduce(gradients, scale=scale, weight=weight, verify=verify).wait()


#: An all-reduce's tree travels in at least this many buckets (of at least MIN_BUCKET_BYTES each).
OVERLAP_BUCKETS, MIN_BUCKET_BYTES = 4, 2**20


class Reduction:
    """How floating arrays are reduced across ranks (the module's docstring); ``reduce`` is collective."""

    def __init__(self, backend, op="avg", compression=None, bucket_bytes=None):
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' (du.avg) or 'sum', got {op!r}")
        name = None if compression is None else dtype_name(compression)
        if name not in (None, "bfloat16", "float16", "int8"):
            raise ValueError(
                f"compression must be None, 'bfloat16', 'float16' or 'int8', got {compression!r}"
            )
        self.backend, self.op = backend, op
        self.compression = getattr(mx, name) if name in ("bfloat16", "float16") else name
        if self.compression == "int8" and backend.size > 127:
            raise ValueError(f"int8 compression sums at most 127 ranks' levels; this job has {backend.size}")
        self.bucket_bytes = None if bucket_bytes is None else check_count(bucket_bytes, 0, "bucket_bytes")

    def settings(self) -> dict:
        """What every rank's reduction must agree on."""
        return dict(op=self.op, compression=self.compression, bucket_bytes=self.bucket_bytes)

    def reduce(self, tree, *, scale=1.0, weight=None, scatter=False, verify=True, what=None):
        """Collective: ``tree``'s floating mx.arrays reduced (``Pending.wait()`` gives them). ``weight``: this
        rank's; ``scatter``: 1-d leaves of lengths N divides, each given back as this rank's part."""
        what, weight = what or "reduce_gradients(grads)", None if weight is None else as_weight(weight)
        arrays = [g for _, g in self.check(tree, weight, what, verify, scale)]
        if self.backend.size == 1 and weight is None:  # (a reduce-scatter's one part is the whole)
            return Pending(lambda: replace_arrays(tree, [g if scale == 1.0 else g * scale for g in arrays]))
        weights = None if weight is None else self._weights(weight, what)
        maxima = self._maxima(arrays) if self.compression == "int8" else None
        sent, transport_scale, decode = plan(
            arrays, self.backend.rank, self.backend.size, self.op, scale, self.compression, weights, maxima
        )
        # MLX's cache keeps 32 MiB by default: a larger buffer freed each step would be mapped anew each step
        limit = 4 * sum(g.nbytes for g in arrays)
        previous = mx.set_cache_limit(limit)
        if previous > limit:
            mx.set_cache_limit(previous)
        sums = self._transport(sent, transport_scale, scatter)
        return Pending(lambda: replace_arrays(tree, decode(sums())))

    def _transport(self, sent, scale, scatter):
        """Collective: the sums of ``sent`` times ``scale`` started in buckets (the last leaves' first, each
        started once computed), and the function that waits. ``scatter``: this rank's part of each."""
        groups = buckets(sent, self._bucket_limit(sent))
        if scatter:
            rows = self.backend.size
            parts = [reduce_scatter_sum(self.backend, pack(sent, g, rows), scale) for g in groups]
            return lambda: unpack(parts, sent, groups, rows)
        # (in place: a bucket's packed copy; a lone gradient's memory MLX may still read)
        started = [start_sum(self.backend, [pack(sent, g)], scale, len(g) > 1) for g in groups]
        return lambda: unpack([s.wait()[0] for s in started], sent, groups)

    def check(self, tree, weight, what, verify=True, scale=1.0) -> list:
        """Collective: ``[(key, array)]``, the (floating, else TypeError) mx.arrays of ``tree``, once every
        rank passes the same tree, weighted and reduced alike (``verify``; else ``TreeMismatchError``)."""
        if weight is not None and self.op != "avg":
            raise ValueError(f"{what}: weight= gives a weighted mean, so op must be 'avg', not {self.op!r}")
        # the leaf that travels first alone is evaluated to tell whether MLX traces (then nothing is checked)
        last = [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)][-1:]
        if verify and self.backend.size > 1 and evaluate(last):
            how = ", ".join(f"{k}={v}" for k, v in {**self.settings(), "scale": scale}.items())
            weighted = [("(weight)", "weighted")] if weight is not None else []
            verify_same_structure(self.backend, describe(tree) + weighted + [("(reduction)", how)], what)
        return floating_leaves(tree, what)  # after the check: the same error on every rank

    def _weights(self, weight, what):
        """Every rank's weight, from one allgather; one negative or not finite is a ValueError on every rank."""
        weights = allgather(self.backend, weight.reshape(1))
        if evaluate(weights):  # (not while MLX traces)
            check_weights(weights.tolist(), what)
        return weights

    def _maxima(self, arrays):
        """Every rank's largest magnitude of each of ``arrays`` (rows: ranks), from one allgather."""
        local = [mx.max(mx.abs(g)).astype(mx.float32) if g.size else mx.array(0.0) for g in arrays]
        return allgather(self.backend, mx.stack(local)[None])

    def _bucket_limit(self, arrays) -> int:
        """The bytes a bucket holds at most: ``bucket_bytes``, else a ``1 / OVERLAP_BUCKETS`` of the tree (so
        that all but the last bucket travel while the backward pass computes), at least ``MIN_BUCKET_BYTES``
        and at most the backend's ``bucket_bytes`` (MPI's 64 KiB; MLX's 32 MiB: each collective costs)."""
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        share = sum(a.nbytes for a in arrays) // OVERLAP_BUCKETS
        return min(self.backend.bucket_bytes, max(MIN_BUCKET_BYTES, share))


def plan(arrays, rank, size, op="avg", scale=1.0, compression=None, weights=None, maxima=None) -> tuple:
    """``(sent, transport_scale, decode)`` of rank ``rank`` of ``size``: the module's table, from numbers alone
    (a test runs every rank's plan in one process). ``weights``: every rank's weight, if weighted;
    ``maxima``: every rank's largest magnitude of each array (rows: ranks), for int8. The transport sums
    ``sent`` over the ranks times ``transport_scale``; ``decode`` gives the results of those sums."""
    if weights is not None:
        shares = weighted_shares(weights)
    else:  # "avg" is a sum times 1/N; so is "sum", times N afterwards
        scale = scale if op == "avg" else scale * size
        if compression is None:  # as they are: the transport scales
            return arrays, average_factor(size) * scale, lambda sums: sums
        shares = mx.full((size,), average_factor(size))
    units = [1.0] * len(arrays)
    if compression == "int8":  # the largest sent on any rank in 127 // N levels: no sum overflows
        steps = mx.max(maxima * shares[:, None], axis=0) / (127 // size)
        units = [mx.where(s == 0, 1.0, s) for s in steps]  # zeros: any unit; NaN, inf: none finite
    sent = [_scaled(g, shares[rank] / unit, _wire(g, compression)) for g, unit in zip(arrays, units)]

    def decode(sums):
        return [_scaled(piece, unit * scale, g.dtype) for piece, unit, g in zip(sums, units, arrays)]

    return sent, 1.0, decode


def _wire(g, compression):
    """The dtype ``g`` travels in when not as it is (weighted, or compressed; complex: as it is, whole)."""
    narrow = g.dtype in NARROW_FLOATS
    if compression is None or g.dtype == mx.complex64:
        return mx.float32 if narrow else g.dtype
    return g.dtype if narrow and compression != "int8" else compression


class Pending:
    """A reduction begun by ``Reduction.reduce``: ``wait()`` (collective, the first time) gives its tree."""

    def __init__(self, finish):
        self.wait = functools.cache(finish)


def check_weights(weights: list, what: str):
    """ValueError (on every rank: each has every rank's ``weights``) unless each is a number >= 0."""
    bad = [r for r, w in enumerate(weights) if not 0 <= w < float("inf")]
    if bad:
        raise ValueError(
            f"{what}: weight must be one number >= 0 per rank (a count of tokens, say); ranks {bad} "
            f"passed {[weights[r] for r in bad]} (nan: no number, or an array of another shape)"
        )


def weighted_shares(weights: mx.array) -> mx.array:
    """Every rank's ``w_r / sum w`` (zeros if all are 0), over the largest weight first: nothing overflows."""
    top = mx.max(weights)  # (divided by a power of two near it: exactly, so usual weights keep their bits)
    power = mx.maximum(mx.floor(mx.log2(mx.where(top > 0, top, 1.0))), -149)
    relative = weights / mx.power(2.0, power)
    return relative * inverse(relative.sum())


def inverse(total_weight: mx.array) -> mx.array:
    return mx.where(total_weight > 0, 1 / total_weight, 0.0)


def as_weight(weight) -> mx.array:
    """A rank's weight as a 0-d float32 mx.array; NaN for what is not one number (a string, an array
    of another shape): ``Reduction`` then raises on every rank, not on this one alone."""
    if isinstance(weight, mx.array) and weight.ndim == 0:
        return weight.astype(mx.float32)
    number = isinstance(weight, (int, float, np.number)) and not isinstance(weight, bool)
    return mx.array(float(weight) if number else float("nan"), mx.float32)


def _scaled(x, s, dtype):
    return _fused(dtype)(x, s if isinstance(s, mx.array) else mx.array(s, mx.float32))


@functools.cache
def _fused(dtype):  # shapeless, and the scale an array: one trace for every shape and scale
    def scaled(x, s):
        if dtype == "int8":
            return mx.round(x * s).astype(mx.int8)
        return (x * s).astype(dtype)

    return mx.compile(scaled, shapeless=True)
