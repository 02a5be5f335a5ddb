"""Gradients reduced across ranks: ``reduce_gradients``, a free function over a tree (like
``mlx.nn.average_gradients``), and ``DistributedOptimizer``, a thin drop-in over it (Lux's
and Horovod's ``DistributedOptimizer``)."""

import functools
import hashlib

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from .api import allgather, allreduce_arrays, total_workers
from .arrays import UINT_BY_SIZE
from .backends import AbstractBackend
from .sharded import ShardedState
from .tree import GRADIENT_BUCKET_BYTES, buckets, check_floating, describe, pack, replace_arrays, unpack
from .tree import verify_same_structure
from .watchdog import evaluate


def reduce_gradients(backend, gradients, *, op="avg", scale=1.0, weight=None, compression=None, bucket_bytes=None,
                     verify=True):  # fmt: skip
    """Collective: ``gradients`` (a tree) reduced across ranks, as a tree of the same structure.

    Args:
        backend: the backend the ranks share.
        gradients: a tree of floating mx.arrays; other leaves pass through.
        op: ``"avg"`` (the default: with a mean-reduced loss, N ranks at batch B step like one
            process at batch N*B) or ``"sum"``.
        scale: a factor folded into the same pass (``reduce_gradients(g, scale=1/k)`` averages
            the sum of k accumulated steps). Default 1.
        weight: this rank's weight (a number or a 0-d mx.array, such as its count of tokens):
            the result is the weighted mean ``sum_r weight_r * g_r / sum_r weight_r`` (op
            "avg" only), so that with per-token-mean losses N ranks step exactly like one
            process on the union of their tokens. The weights travel packed with the gradients
            (in the same collective as the float32 ones). If every rank's weight is 0 the
            gradients are 0. Default None.
        compression: what travels (``as_compression``). ``mx.bfloat16`` or ``mx.float16``
            (or their names): wider gradients travel in that dtype, pre-divided by the world
            size (so the sum cannot overflow), cast back after; MPIBackend has no 16-bit float
            type and sends float32 (rounding only). ``"int8"``: each array travels as int8
            with a scale of its own (its largest magnitude over the ranks, found in one small
            allgather first), in ``127 // N`` levels each side so that the int8 sum of N ranks
            cannot overflow: a quarter of float32's bytes, about 6 bits of precision at
            2 ranks and 4 at 8 (meant for DiLoCo's pseudo-gradients). Default None.
        bucket_bytes: arrays smaller than this travel packed by dtype, up to this many bytes a
            collective; 0 sends each alone. Default (None): ``GRADIENT_BUCKET_BYTES`` (32 MiB).
        verify: first check that every rank passes the same tree (keys, shapes, dtypes; one
            32-byte allgather), and raise ``TreeMismatchError`` on every rank if not; skipped
            while MLX traces a function. Default True.

    On MPIBackend the gradients are reduced in their own memory when they can be (evaluated,
    contiguous, not sharing memory with each other): afterwards those arrays hold the result.
    In a world of one, ``gradients`` come back as they are (scaled if ``scale`` is not 1).
    """
    what = "reduce_gradients(grads)"
    compression = as_compression(compression)
    flat = [(key, g) for key, g in tree_flatten(gradients) if isinstance(g, mx.array)]
    # While MLX traces (mx.compile) nothing may talk eagerly: ranks may trace at different times.
    if verify and total_workers(backend) > 1 and evaluate([g for _, g in flat]):
        verify_same_structure(backend, describe_reduction(gradients, weight), what)
    check_floating(flat, what)  # after the check: the same on every rank, as the dtypes agree
    leaves = [g for _, g in flat]
    if weight is not None:
        if op != "avg":
            raise ValueError(f"{what}: weight= gives a weighted mean, so op must be 'avg', not {op!r}")
        weight = as_weight(weight)
        leaves = [_times(g, weight) for g in leaves]
    reduced = reduce_leaves(backend, leaves, op=op, scale=scale, weight=weight, compression=compression,
                            bucket_bytes=bucket_bytes)  # fmt: skip
    return replace_arrays(gradients, reduced)


def reduce_leaves(backend, leaves, *, op="avg", scale=1.0, weight=None, compression=None, bucket_bytes=None):
    """Collective: the reduction of ``leaves`` (a list of floating mx.arrays), as
    ``reduce_gradients`` (no checks). With ``weight`` (this rank's, a float32 mx.array) the
    leaves are already multiplied by it, and the result is their sum over the ranks divided by
    the sum of the weights, times ``scale``."""
    n = total_workers(backend)
    weights = [] if weight is None else [weight.reshape(1)]  # travels with the gradients
    if n == 1 and weight is None:
        return leaves if scale == 1.0 else [g * scale for g in leaves]
    if weight is None and op == "avg":
        scale = scale / n
    if compression == "int8":
        return _reduce_int8(backend, leaves, scale, weight, bucket_bytes)
    if compression is None:
        reduced = _bucketed(backend, leaves + weights, scale if weight is None else 1.0, bucket_bytes)
    else:  # pre-divided by n, so that the sum of 16-bit floats cannot overflow
        sent = [_scaled(compression if g.dtype.size > 2 else g.dtype)(g, mx.array(1 / n)) for g in leaves]
        reduced = _bucketed(backend, sent + [w / n for w in weights], 1.0, bucket_bytes)
        back = 1.0 if weight is not None else scale * n
        reduced = [_scaled(g.dtype)(r, mx.array(back)) for r, g in zip(reduced, leaves)] + reduced[len(leaves) :]
    if weight is None:
        return reduced
    factor = scale / mx.maximum(reduced[-1], mx.array(1e-30, mx.float32))  # all weights 0: gradients 0
    return [(r * factor).astype(r.dtype) for r in reduced[:-1]]


def _reduce_int8(backend, leaves, scale, weight, bucket_bytes):
    """``reduce_leaves`` with every array travelling as int8 (see ``reduce_gradients``)."""
    levels = 127 // total_workers(backend)
    local = [mx.max(mx.abs(g)).astype(mx.float32) if g.size else mx.array(0.0) for g in leaves]
    both = allgather(backend, mx.stack(local + [mx.array(0.0) if weight is None else weight])[None])
    largest, weights = mx.max(both[:, :-1], axis=0), mx.sum(both[:, -1])
    step = mx.where(largest > 0, largest / levels, 0)  # the value of one level, per array
    sent = [mx.round(g.astype(mx.float32) / mx.where(s > 0, s, 1)).astype(mx.int8) for g, s in zip(leaves, step)]
    sums = _bucketed(backend, sent, 1.0, bucket_bytes)
    if weight is not None:  # all weights 0: gradients 0
        scale = scale / mx.maximum(weights, mx.array(1e-30, mx.float32))
    return [(q.astype(mx.float32) * (s * scale)).astype(g.dtype) for q, s, g in zip(sums, step, leaves)]


def as_compression(compression):
    """None, ``mx.bfloat16``, ``mx.float16`` or ``"int8"``, from those or their names (a
    ValueError for anything else)."""
    name = compression if compression is None or isinstance(compression, str) else str(compression)
    name = name if name is None else name.removeprefix("mlx.core.")
    if name not in (None, "bfloat16", "float16", "int8"):
        raise ValueError(f"compression must be None, 'bfloat16', 'float16' or 'int8', got {compression!r}")
    return getattr(mx, name) if name in ("bfloat16", "float16") else name


def as_weight(weight) -> mx.array:
    """A rank's weight as a 0-d float32 mx.array."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number, mx.array)):
        raise TypeError(f"weight must be a number or a 0-d mx.array (such as a count of tokens), got {weight!r}")
    weight = mx.array(weight, mx.float32) if not isinstance(weight, mx.array) else weight.astype(mx.float32)
    if weight.ndim != 0:
        raise ValueError(f"weight must be 0-d (one number per rank), got shape {weight.shape}")
    return weight


def describe_reduction(gradients, weight) -> list:
    """What every rank's reduction must agree on: the tree, and whether it is weighted."""
    return describe(gradients) + ([("(weight)", "weighted")] if weight is not None else [])


def _bucketed(backend, arrays, scale, bucket_bytes):
    """The sum of each of ``arrays`` across ranks times ``scale``, the small ones packed."""
    groups = buckets(arrays, GRADIENT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
    packed = [pack(arrays, g) for g in groups]
    # in place: the packer's copies, or the caller's own arrays (as documented)
    sums = allreduce_arrays(backend, packed, "sum", scale, in_place=True)
    out = [None] * len(arrays)
    for group, total in zip(groups, sums):
        for i, piece in zip(group, unpack(total, arrays, group)):
            out[i] = piece
    return out


@functools.cache
def _scaled(dtype):
    """``(x * s).astype(dtype)`` in one fused pass (shapeless: one trace for every shape)."""
    return mx.compile(lambda x, s: (x * s).astype(dtype), shapeless=True)


class DistributedOptimizer(optim.Optimizer):
    """Wraps ``optimizer`` so that every update first reduces the gradients across all ranks
    (``reduce_gradients``).

    A drop-in for the wrapped optimizer: ``update``, ``apply_gradients``, ``init``, ``state``
    (the wrapped optimizer's own state, so ``du.synchronize`` and
    ``mx.compile(step, inputs=state, outputs=state)`` see it), ``step``, ``learning_rate``,
    and any other attribute, read through to ``optimizer``.

    Collective: every rank calls ``update`` (or ``apply_gradients``, ``reduce_gradients``) as
    often and in the same order as the others, with trees of the same keys, shapes and dtypes
    (frozen parameters: frozen on every rank). Every reduction verifies that (one 32-byte
    allgather; not while MLX traces a function), and raises ``du.TreeMismatchError`` on every
    rank otherwise. The first update also checks, once, that every rank starts from the same
    parameters (a forgotten ``du.synchronize``), and raises ``ValueError`` on every rank if not.

    Args:
        backend: the backend the ranks share (``du.get_distributed_backend(...)``).
        optimizer: any ``mlx.optimizers.Optimizer``, ``MultiOptimizer`` and schedules included.
        op: ``"avg"`` (``du.avg``, the default) or ``"sum"``.
        accumulate_steps: k > 1 adds up the gradients of k calls locally and reduces once, on
            the k-th call, their mean (op "avg": like one process at batch k*N*B) or sum. The
            other calls send nothing and leave the model, the step and the state as they are
            (``apply_gradients`` returns the parameters). The count lives in Python, so keep
            ``update`` out of ``mx.compile`` then. Default 1.
        compression, bucket_bytes: as for ``reduce_gradients``.
        shard_optimizer_state: True keeps on each rank the optimizer state of its share (1/N)
            of the parameters (ZeRO stage 1, see ``sharded.py``): the gradients are reduced,
            each rank updates its share, and the parameters are all-gathered. ``state`` then
            holds this rank's pieces, keyed by parameter; checkpoints hold the whole state
            (``whole_state``), and load into any world size, sharded or not. For optimizers
            that work element by element (SGD, Adam, AdamW, Lion, RMSprop, Adagrad, AdaDelta,
            Adamax); others are a ValueError. Default False.

    Example: clip the averaged gradients before the rule::

        grads = opt.reduce_gradients(grads)
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        opt.optimizer.update(model, grads)
    """

    def __init__(self, backend, optimizer, *, op="avg", accumulate_steps=1, compression=None, bucket_bytes=None,
                 shard_optimizer_state=False):  # fmt: skip
        if not isinstance(backend, AbstractBackend):
            raise TypeError(f"expected a backend object (du.get_distributed_backend(...)), got {backend!r}")
        if not isinstance(optimizer, optim.Optimizer):
            raise TypeError(f"expected an mlx.optimizers.Optimizer, got {optimizer!r}")
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' (du.avg) or 'sum', got {op!r}")
        if not (isinstance(accumulate_steps, int) and accumulate_steps >= 1):
            raise ValueError(f"accumulate_steps must be a positive int, got {accumulate_steps!r}")
        compression = as_compression(compression)
        self.backend, self.optimizer, self.op = backend, optimizer, op
        self.accumulate_steps, self.compression, self.bucket_bytes = accumulate_steps, compression, bucket_bytes
        self._first = True  # no reduction yet
        self._parameters_checked = False
        self._sum, self._weight, self._calls = None, None, 0  # the local sums of this accumulation cycle
        self.shards = None  # the sharded update, when the state is sharded
        if shard_optimizer_state:
            self.shards = ShardedState(backend, optimizer, self._reduce_leaves, op == "avg", compression)

    def __getattr__(self, name):  # only for names not found on the wrapper itself
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state):
        self.optimizer.state = state

    @property
    def step(self):
        return self.optimizer.step

    @property
    def learning_rate(self):
        return self.optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.optimizer.learning_rate = learning_rate

    def init(self, parameters):
        """The wrapped optimizer's ``init`` (of this rank's share when sharded); local."""
        if self.shards is not None:
            self.shards.init(parameters)
        else:
            self.optimizer.init(parameters)

    def whole_state(self) -> dict:
        """The whole optimizer state, per parameter: ``state`` itself, or, when sharded,
        gathered from every rank's part (collective then). What checkpoints hold."""
        return self.state if self.shards is None else self.shards.whole_state()

    def load_whole_state(self, state: dict, model=None):
        """Set the state from ``whole_state()``'s form (when sharded, this rank takes its part);
        ``model`` is not used (``DiLoCo``'s takes it)."""
        if self.shards is None:
            self.state = state
        else:
            self.shards.load_whole_state(state)

    def update(self, model, gradients, weight=None):
        """Reduce ``gradients`` across ranks, then the wrapped optimizer updates ``model``.
        ``weight``: this rank's weight (its count of tokens, say): the update then uses the
        weighted mean of the ranks' gradients (see ``reduce_gradients``); pass it on every
        rank or on none. With ``accumulate_steps=k``, only the k-th call of each cycle
        reduces and updates (weighted: the weighted mean over the cycle's calls and ranks)."""
        updated = self._step(gradients, model.parameters(), model, weight)
        if updated is not None:
            model.update(updated)

    def apply_gradients(self, gradients, parameters, weight=None):
        """The wrapped optimizer's ``apply_gradients`` on the reduced ``gradients`` (``weight``:
        as for ``update``). With ``accumulate_steps=k``, the other calls return ``parameters``
        (restricted to the keys of ``gradients``) unchanged."""
        updated = self._step(gradients, parameters, parameters, weight)
        return tree_map(lambda _, p: p, gradients, parameters) if updated is None else updated

    def reduce_gradients(self, gradients, weight=None):
        """Collective: ``gradients`` reduced across ranks now, with this optimizer's op,
        compression and buckets, or their weighted mean (``accumulate_steps`` does not apply)."""
        weight = None if weight is None else as_weight(weight)
        weighted = gradients if weight is None else tree_map(lambda g: _times(g, weight), gradients)
        return self._reduce(weighted, 1.0, weight, "DistributedOptimizer.reduce_gradients(grads)")

    def _step(self, gradients, parameters, target, weight):
        """The updated parameters (``target``: what the wrapped optimizer updates, the model
        or ``parameters``), or None while an accumulation cycle goes on."""
        summed = self._accumulate(gradients, parameters, weight)
        if summed is None:
            return None
        total, scale, weight = summed
        what = "DistributedOptimizer.update(grads)"
        if self.shards is not None:
            self._first_reduction(total, weight, what)
            return self.shards.step(total, parameters, scale, weight)
        return self.optimizer.apply_gradients(self._reduce(total, scale, weight, what), target)

    def _reduce(self, gradients, scale, weight, what):
        """``gradients`` (already multiplied by ``weight`` when given) reduced across ranks."""
        self._first_reduction(gradients, weight, what)
        leaves = [g for _, g in tree_flatten(gradients) if isinstance(g, mx.array)]
        return replace_arrays(gradients, self._reduce_leaves(leaves, scale, weight))

    def _reduce_leaves(self, leaves, scale, weight):
        return reduce_leaves(self.backend, leaves, op=self.op if weight is None else "avg", scale=scale, weight=weight,
                             compression=self.compression, bucket_bytes=self.bucket_bytes)  # fmt: skip

    def _first_reduction(self, gradients, weight, what):
        """Before each reduction: the tree is the same on every rank (the first time, raise
        MLX's cache limit for the gradient buffers)."""
        if self._first:
            _raise_cache_limit(4 * sum(g.nbytes for _, g in tree_flatten(gradients) if isinstance(g, mx.array)))
            self._first = False
        if self.backend.size > 1 and evaluate(gradients):  # not while MLX traces (see reduce_gradients)
            verify_same_structure(self.backend, describe_reduction(gradients, weight), what)

    def _accumulate(self, gradients, parameters, weight):
        """``(the local gradients to reduce, their scale, the local weight)`` of this call
        (weighted: the gradients multiplied by the weight), or None while an accumulation
        cycle goes on."""
        if not self._parameters_checked and self.backend.size > 1 and evaluate(parameters):
            check_same_parameters(self.backend, parameters)
            self._parameters_checked = True
        if weight is not None:
            if self.op != "avg":
                raise ValueError(f"DistributedOptimizer(op={self.op!r}): weight= gives a weighted mean; use op='avg'")
            weight = as_weight(weight)
            gradients = tree_map(lambda g: _times(g, weight), gradients)
        k = self.accumulate_steps
        if k == 1:
            return gradients, 1.0, weight
        if self._calls and (weight is None) != (self._weight is None):
            raise ValueError("DistributedOptimizer: pass weight= to every call of an accumulation cycle, or to none")
        self._calls += 1
        total = gradients if self._sum is None else tree_map(_add, self._sum, gradients)
        weights = weight if self._weight is None or weight is None else self._weight + weight
        if self._calls < k:
            self._sum, self._weight = total, weights
            mx.async_eval([a for _, a in tree_flatten(total) if isinstance(a, mx.array)])  # drop the graphs
            return None
        self._sum, self._weight, self._calls = None, None, 0
        return total, (1 / k if self.op == "avg" and weights is None else 1.0), weights


def check_same_parameters(backend, parameters, who="DistributedOptimizer"):
    """Collective, once: raise ValueError on every rank unless every rank holds rank 0's
    parameters (one 32-byte allgather of a digest of their bits)."""
    digest = hashlib.sha256()
    for _, p in tree_flatten(parameters):
        if isinstance(p, mx.array):
            digest.update(memoryview(np.asarray(p.reshape(-1).view(UINT_BY_SIZE[p.dtype.size]))))
    digests = allgather(backend, np.frombuffer(digest.digest(), np.uint8)).reshape(backend.size, -1)
    differ = [r for r in range(backend.size) if (digests[r] != digests[0]).any()]
    if differ:
        raise ValueError(
            f"{who}: at the first update, ranks {differ} hold other parameters than "
            "rank 0: call du.synchronize(backend, model) on every rank before training"
        )


def _add(a, b):
    return a + b if isinstance(a, mx.array) else a


def _times(g, weight):
    return g * weight.astype(g.dtype) if isinstance(g, mx.array) else g


def _raise_cache_limit(nbytes: int):
    """MLX's CPU cache keeps 32 MiB by default: every larger buffer a step frees is unmapped
    and mapped anew the next step (page faults and zeroing, several memory passes)."""
    previous = mx.set_cache_limit(nbytes)
    if previous > nbytes:
        mx.set_cache_limit(previous)
