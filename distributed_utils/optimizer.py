"""DistributedOptimizer: any ``mlx.optimizers.Optimizer``, with gradients reduced across ranks
before the update (Lux's ``DistributedOptimizer``, Horovod's ``DistributedOptimizer``)."""

import functools
import operator

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from .backends import AbstractBackend, MPIBackend
from .tree import describe, verify_same_structure

#: ``bucket_bytes`` when none is given, by transport (benchmarks/gradient_reduction.py): MPI
#: reduces arrays in place, where packing costs a memory pass, so only tiny arrays are packed;
#: MLX's collectives pay per call, so arrays up to a few MiB travel together.
DEFAULT_BUCKET_BYTES = {MPIBackend: 64 * 1024, AbstractBackend: 8 * 1024**2}

_OPS = {"avg": "avg", "sum": "sum", operator.add: "sum"}


class DistributedOptimizer(optim.Optimizer):
    """Wraps ``optimizer`` so that every update first reduces the gradients across all ranks.

    A drop-in for the wrapped optimizer: ``update``, ``apply_gradients``, ``init``, ``state``
    (the wrapped optimizer's own state, so ``du.synchronize`` and
    ``mx.compile(step, inputs=state, outputs=state)`` see it), ``step``, ``learning_rate``
    and any other attribute read through to ``optimizer``.

    Collective: every rank calls ``update`` (or ``apply_gradients`` or ``reduce_gradients``)
    as often and in the same order as the others, with a tree of the same keys, shapes and
    dtypes. The first reduction checks that, and so does any reduction whose tree differs from
    the last one checked: a mismatch raises ``du.tree.TreeMismatchError`` on every rank.

    Args:
        backend: the ``du`` backend the ranks share.
        optimizer: any ``mlx.optimizers.Optimizer`` (``MultiOptimizer`` and schedules included).
        op: ``"avg"`` (``du.avg``, the default: the mean over ranks, which with a mean-reduced
            loss makes N ranks at batch B step like one process at batch N*B) or ``"sum"``.
        accumulate_steps: k > 1 adds the gradients of k calls locally and reduces once, on the
            k-th call, the mean (op "avg") or the sum of the k. The other calls communicate
            nothing and leave the model and the optimizer state as they are. The count lives
            in Python, so keep ``update`` outside ``mx.compile`` then.
        compression: ``mx.float16`` or ``mx.bfloat16`` to send wider float gradients in that
            dtype: divided by the world size first (no overflow in the sum), cast back after.
            MPI has no 16-bit float type: MPIBackend rounds as asked but sends float32.
        bucket_bytes: arrays smaller than this travel packed together, up to this many bytes
            per collective; 0 sends each array alone. Default: ``DEFAULT_BUCKET_BYTES``.

    Speed: on MLX backends the reduction is lazy (``mx.distributed.all_sum``) and composes
    with ``mx.compile``; the structure check runs when the step is traced. MPIBackend is
    eager: it evaluates the gradients and reduces them **in place**, through zero-copy numpy
    views, so after the call ``grads`` holds the reduced values; an array that shares memory
    with another leaf, or is not contiguous, is reduced into a new array instead. The first
    reduction raises MLX's cache limit (``mx.set_cache_limit``, never lowered) to 4x the
    gradient bytes, so that the step's large buffers are reused instead of freshly mapped.
    """

    def __init__(self, backend, optimizer, *, op="avg", accumulate_steps=1, compression=None, bucket_bytes=None):
        if not isinstance(backend, AbstractBackend):
            raise TypeError(f"expected a backend object (du.get_distributed_backend(...)), got {backend!r}")
        if not isinstance(optimizer, optim.Optimizer):
            raise TypeError(f"expected an mlx.optimizers.Optimizer, got {optimizer!r}")
        if op not in _OPS:
            raise ValueError(f"op must be 'avg' (du.avg) or 'sum', got {op!r}")
        if not (isinstance(accumulate_steps, int) and accumulate_steps >= 1):
            raise ValueError(f"accumulate_steps must be a positive int, got {accumulate_steps!r}")
        if compression is not None and compression not in (mx.float16, mx.bfloat16):
            raise ValueError(f"compression must be None, mx.float16 or mx.bfloat16, got {compression!r}")
        if bucket_bytes is None:
            bucket_bytes = next(v for t, v in DEFAULT_BUCKET_BYTES.items() if isinstance(backend, t))
        self.backend, self.optimizer, self.op = backend, optimizer, _OPS[op]
        self.accumulate_steps, self.compression, self.bucket_bytes = accumulate_steps, compression, bucket_bytes
        self._checked = None  # the description of the tree last verified across ranks
        self._sum, self._calls = None, 0  # the local gradient sum of this accumulation cycle

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
        """The wrapped optimizer's ``init``; local (state is not reduced: ``du.synchronize`` it)."""
        self.optimizer.init(parameters)

    def update(self, model, gradients):
        """Reduce ``gradients`` across ranks, then the wrapped optimizer updates ``model``.
        With ``accumulate_steps=k``, only the k-th call of each cycle does either."""
        reduced = self._accumulate(gradients)
        if reduced is not None:
            model.update(self.optimizer.apply_gradients(reduced, model))

    def apply_gradients(self, gradients, parameters):
        """The wrapped optimizer's ``apply_gradients`` on the reduced ``gradients``. With
        ``accumulate_steps=k``, the other calls return ``parameters`` (restricted to the keys
        of ``gradients``) unchanged."""
        reduced = self._accumulate(gradients)
        if reduced is None:
            return tree_map(lambda _, p: p, gradients, parameters)
        return self.optimizer.apply_gradients(reduced, parameters)

    def reduce_gradients(self, gradients):
        """Collective: ``gradients`` reduced across ranks now (op, compression, buckets as
        configured; ``accumulate_steps`` does not apply), as a tree of the same structure.
        For clipping or inspecting the averaged gradients before
        ``opt.optimizer.update(model, reduced)``. Non-array leaves pass through."""
        return self._reduce(gradients, 1, "DistributedOptimizer.reduce_gradients(grads)")

    def _accumulate(self, gradients):
        k = self.accumulate_steps
        if k == 1:
            return self._reduce(gradients, 1, "DistributedOptimizer.update(grads)")
        self._calls += 1
        total = gradients if self._sum is None else tree_map(_add, self._sum, gradients)
        if self._calls < k:
            self._sum = total
            mx.async_eval([a for _, a in tree_flatten(total) if isinstance(a, mx.array)])  # drop the graphs
            return None
        self._sum, self._calls = None, 0
        return self._reduce(total, k, "DistributedOptimizer.update(grads)")

    def _reduce(self, grads, k, what):
        """``grads`` (the sum of k calls' gradients) reduced with ``self.op`` across ranks."""
        n, avg = self.backend.size, self.op == "avg"
        description = describe(grads)
        if n > 1 and description != self._checked:
            verify_same_structure(self.backend, description, what=what)
        flat = [(key, g) for key, g in tree_flatten(grads) if isinstance(g, mx.array)]
        if self._checked is None:
            _raise_cache_limit(4 * sum(g.nbytes for _, g in flat))
        self._checked = description
        for key, g in flat:  # the same on every rank: the dtypes were just verified
            if not mx.issubdtype(g.dtype, mx.inexact):
                raise TypeError(f"{what}: gradient '{key}' has dtype {g.dtype}; gradients are floating")
        leaves = [g for _, g in flat]
        if n == 1:
            if k == 1 or not avg:
                return grads
            return tree_map(lambda g: _scaled(g.dtype)(g, mx.array(1 / k)) if isinstance(g, mx.array) else g, grads)
        if self.compression is None and k == 1:  # the transport does "avg" its own fastest way
            reduced = self._bucketed(leaves, self.op)
        else:  # new arrays anyway: fold every scale into the one pass that makes them, and sum
            wires = [self.compression if self.compression is not None and g.dtype.size > 2 else g.dtype for g in leaves]
            sends = []
            for g, wire in zip(leaves, wires):
                scale = 1 / (n * k) if avg else (1 / n if wire != g.dtype else 1.0)
                sends.append(g if scale == 1 and wire == g.dtype else _scaled(wire)(g, mx.array(scale)))
            reduced = self._bucketed(sends, "sum")
            back = mx.array(1.0 if avg else float(n))  # undo the pre-divide of a compressed sum
            reduced = [r if w == g.dtype else _scaled(g.dtype)(r, back) for r, g, w in zip(reduced, leaves, wires)]
        it = iter(reduced)
        return tree_map(lambda g: next(it) if isinstance(g, mx.array) else g, grads)

    def _bucketed(self, arrays, op):
        """``backend.allreduce_arrays`` on ``arrays``, the small ones packed by dtype into
        buckets of up to ``bucket_bytes``; the results in the order of ``arrays``."""
        groups, open_ = [], {}
        for i, a in enumerate(arrays):
            if a.nbytes >= self.bucket_bytes:
                groups.append([i])
                continue
            bucket = open_.get(a.dtype)
            if bucket is None or sum(arrays[j].nbytes for j in bucket) + a.nbytes > self.bucket_bytes:
                bucket = open_[a.dtype] = []
                groups.append(bucket)
            bucket.append(i)
        flat = [arrays[g[0]] if len(g) == 1 else mx.concatenate([arrays[i].reshape(-1) for i in g]) for g in groups]
        out = [None] * len(arrays)
        for group, r in zip(groups, self.backend.allreduce_arrays(flat, op, in_place=True)):
            if len(group) == 1:
                out[group[0]] = r
                continue
            sizes = [arrays[i].size for i in group]
            cuts = [sum(sizes[: j + 1]) for j in range(len(sizes) - 1)]
            for i, part in zip(group, mx.split(r, cuts)):
                out[i] = part.reshape(arrays[i].shape)
        return out


def _add(a, b):
    return a + b if isinstance(a, mx.array) else a


@functools.cache
def _scaled(dtype):
    """``(x * s).astype(dtype)`` in one fused pass (shapeless: one trace for every shape)."""
    return mx.compile(lambda x, s: (x * s).astype(dtype), shapeless=True)


def _raise_cache_limit(nbytes: int):
    previous = mx.set_cache_limit(nbytes)
    if previous > nbytes:
        mx.set_cache_limit(previous)
