"""DistributedOptimizer: any ``mlx.optimizers.Optimizer``, with gradients reduced across ranks
before the update (Lux's ``DistributedOptimizer``, Horovod's ``DistributedOptimizer``)."""

import functools
import itertools
import operator

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from .backends import AbstractBackend
from .tree import describe, verify_same_structure

#: ``bucket_bytes`` when none is given. Packing costs a memory pass, but every collective call
#: waits for the slowest rank once; with 2 ranks on 2 cores (benchmarks/gradient_reduction.py)
#: 32 MiB did best or within noise of best on MPIBackend, RingBackend and MLXMPIBackend alike
#: (mlx.nn.average_gradients uses 32 MiB too).
DEFAULT_BUCKET_BYTES = 32 * 2**20

_OPS = {"avg": "avg", "sum": "sum", operator.add: "sum"}


class DistributedOptimizer(optim.Optimizer):
    """Wraps ``optimizer`` so that every update first reduces the gradients across all ranks.

    A drop-in for the wrapped optimizer: ``update``, ``apply_gradients``, ``init``, ``state``
    (the wrapped optimizer's own state, so ``du.synchronize`` and
    ``mx.compile(step, inputs=state, outputs=state)`` see it), ``step``, ``learning_rate``,
    and any other attribute, read through to ``optimizer``.

    Collective: every rank calls ``update`` (or ``apply_gradients``, ``reduce_gradients``) as
    often and in the same order as the others, with trees of the same keys, shapes and dtypes
    (frozen parameters: frozen on every rank). The first reduction verifies that, and raises
    ``du.tree.TreeMismatchError`` on every rank otherwise. Later reductions verify again when
    this rank's tree changed, which catches a change made on every rank; a change made on some
    ranks only, after the first reduction, is not caught. Non-array leaves pass through.

    Args:
        backend: the backend the ranks share (``du.get_distributed_backend(...)``).
        optimizer: any ``mlx.optimizers.Optimizer``, ``MultiOptimizer`` and schedules included.
        op: ``"avg"`` (``du.avg``, the default) or ``"sum"``. With a mean-reduced loss, "avg"
            makes N ranks at batch B step like one process at batch N*B.
        accumulate_steps: k > 1 adds up the gradients of k calls locally and reduces once, on
            the k-th call, their mean (op "avg": like one process at batch k*N*B) or sum. The
            other calls send nothing and leave the model, the step and the state as they are
            (``apply_gradients`` returns the parameters). The count lives in Python, so keep
            ``update`` out of ``mx.compile`` then.
        compression: ``mx.bfloat16`` or ``mx.float16``: wider float gradients travel in that
            dtype, divided by the world size first (so the sum cannot overflow) and cast back
            after. MPI has no 16-bit float type, so MPIBackend sends float32 (rounding only).
            On CPUs without float16 arithmetic (x86) MLX sums float16 slowly: use bfloat16.
        bucket_bytes: arrays smaller than this travel packed together, up to this many bytes
            a collective (packing costs a memory pass); 0 sends every array alone. Default:
            ``DEFAULT_BUCKET_BYTES`` (32 MiB).

    Speed: on MLX backends the reduction is lazy (``mx.distributed.all_sum``) and composes with
    ``mx.compile``; the structure check runs when the step is traced. MPIBackend is eager, so it
    cannot run inside ``mx.compile``: it evaluates the gradients and reduces them in their own
    memory (zero-copy numpy views; no copy), so afterwards the arrays in ``gradients`` hold the
    result, as does any array sharing their memory (``mx.array(g)`` does) or any lazy graph that
    reads them and is evaluated later. Leaves that share memory with one another or are not
    contiguous are reduced in copies. The first reduction raises MLX's cache limit to 4x the
    gradient bytes (``mx.set_cache_limit``; never lowered): on CPU it is 32 MiB by default, and
    every larger buffer a step frees is unmapped and mapped anew the next step, at the cost of
    page faults and zeroing (several times a memory pass).
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
        bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
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
        groups, open_ = [], {}  # open_: the bucket being filled, and its bytes, by dtype
        for i, a in enumerate(arrays):
            if a.nbytes >= self.bucket_bytes:
                groups.append([i])
                continue
            bucket, nbytes = open_.get(a.dtype, (None, 0))
            if bucket is None or nbytes + a.nbytes > self.bucket_bytes:
                bucket, nbytes = [], 0
                groups.append(bucket)
            bucket.append(i)
            open_[a.dtype] = (bucket, nbytes + a.nbytes)
        flat = [arrays[g[0]] if len(g) == 1 else mx.concatenate([arrays[i].reshape(-1) for i in g]) for g in groups]
        out = [None] * len(arrays)
        for group, r in zip(groups, self.backend.allreduce_arrays(flat, op, in_place=True)):
            if len(group) == 1:
                out[group[0]] = r
                continue
            cuts = list(itertools.accumulate(arrays[i].size for i in group))[:-1]
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
