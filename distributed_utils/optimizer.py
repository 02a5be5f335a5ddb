"""``DistributedOptimizer`` (Lux's and Horovod's): any MLX optimizer, with gradients reduced across ranks."""

import hashlib

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import fsdp, watchdog
from .arrays import bits, evaluate, widened
from .collectives import check_backend, check_count, check_same
from .reduction import Reduction, as_weight, inverse
from .state import PlainOptimizerState, check_plain, forwarded, has_entries, rule_settings, scalars


class DistributedOptimizer(PlainOptimizerState, optim.Optimizer):
    """Wraps ``optimizer`` so that every update first reduces the gradients across all ranks
    (``reduce_gradients``). A drop-in: ``update``, ``apply_gradients``, ``init``, ``state`` (the
    wrapped one's, which ``mx.compile(..., inputs=state)`` sees) and every other attribute
    read through to ``optimizer``.

    Collective: every rank calls ``update`` (or ``apply_gradients``, ``reduce_gradients``) as
    often, in the same order, with trees of the same keys, shapes and dtypes (checked, else
    ``du.TreeMismatchError`` on every rank); the first update checks that the ranks start from
    the same parameters, with the same settings (else ValueError on every rank).

    Args:
        optimizer: any ``mlx.optimizers.Optimizer``, ``MultiOptimizer`` and schedules included.
        op, compression, bucket_bytes: as for ``reduce_gradients`` (op "avg" or "sum").
        accumulate_steps: k > 1 sums k calls' gradients locally and reduces, at the k-th call,
            their mean (op "avg": like one process at batch k*N*B) or sum; the other calls send
            nothing and change nothing. The count lives in Python: keep ``update`` out of ``mx.compile``.
        shard_optimizer_state: each rank keeps the state of its shard of each parameter (ZeRO-1:
            reduce, step this rank's shards, all-gather the parameters); checkpoints hold the whole
            state. For the element-by-element optimizers (``fsdp.ELEMENTWISE``)."""

    def __init__(
        self,
        backend,
        optimizer,
        *,
        op="avg",
        accumulate_steps=1,
        compression=None,
        bucket_bytes=None,
        shard_optimizer_state=False,
    ):
        check_backend(backend)
        check_plain(optimizer, "DistributedOptimizer")
        k = check_count(accumulate_steps, 1, "DistributedOptimizer: accumulate_steps")
        self.backend, self.optimizer, self.accumulate_steps = backend, optimizer, k
        self.reduction = Reduction(backend, op, compression, bucket_bytes)
        self.sharded = bool(shard_optimizer_state)
        if self.sharded:
            fsdp.check_elementwise(optimizer, "DistributedOptimizer(shard_optimizer_state=True)")
        self._layout = {}  # held_state's layout: ZeRO-1's (init, each step) or a fully sharded model's (first update)
        self._fully_sharded = None  # the model's fully sharded parameters (fsdp.sharded), at the first update
        self._checked = False  # the ranks' parameters and settings, at the first update
        self._sum, self._weight, self._calls = None, None, 0  # this accumulation cycle's, on this rank

    def __getattr__(self, name):  # only for names not found on the wrapper itself
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    step = forwarded("step", to="optimizer")  # (read alone: the wrapped optimizer's is)
    learning_rate = forwarded("learning_rate", to="optimizer")

    def init(self, parameters):
        """The wrapped optimizer's ``init`` (of this rank's shards when sharded); local."""
        self.optimizer.init(self._my_shards(tree_flatten(parameters)) if self.sharded else parameters)

    def _my_shards(self, flat):  # (flat: [(key, parameter)]; a parameter frozen since keeps its entry)
        self._layout.update({k: (a.shape, self.backend) for k, a in flat})
        return tree_unflatten([(k, fsdp.shard_of(a, self.backend.size, self.backend.rank)) for k, a in flat])

    def shared_state(self) -> dict:  # (the entries of shards: each rank its own)
        return tree_unflatten(fsdp.split_at_shards(self.state, self._layout)[1])

    def set_shared_state(self, state: dict):
        merged = {**dict(tree_flatten(self.state)), **dict(tree_flatten(state))}
        self.state = tree_unflatten(list(merged.items()))

    def whole_state(self) -> dict:
        fix = "update first, or save_checkpoint(model=, optimizer=)"  # (it learns the shards at its first update)
        if self.initialized():
            fsdp.state_shards(self, None, "DistributedOptimizer.whole_state()", fix)
        return fsdp.whole_tree(*self.held_state())

    def held_state(self) -> tuple:
        if self._calls:  # (each rank's sum of the cycle's gradients so far is in no state)
            raise ValueError(
                f"DistributedOptimizer: at call {self._calls} of an accumulation cycle of {self.accumulate_steps}"
                " its state would lose the gradients summed so far: save it after the cycle's last call"
            )
        return self.state, self._layout

    def knows_its_shards(self) -> bool:  # (ZeRO-1's never are a fully sharded model's)
        return self._fully_sharded is not None or self.sharded

    def load_whole_state(self, state: dict, model=None):
        """Set from whole_state()'s form, each rank keeping its shards (a checkpoint's come as shards)."""
        self._sum, self._weight, self._calls = None, None, 0  # (a cycle begun before is not this state's)
        if fsdp.state_shards(self, model, "DistributedOptimizer.load_whole_state"):
            self._take_fully_sharded(model)
        elif self.sharded and has_entries(state):  # (the shapes of the whole state's entries)
            entries = tree_flatten({k: v for k, v in state.items() if k not in scalars(state)})
            self._layout = {k: (a.shape, self.backend) for k, a in entries}  # (at the entries' keys)
        self.state = fsdp.shard_tree(state, self._layout)

    def update(self, model, gradients, weight=None):
        """Reduce ``gradients`` across ranks, then the wrapped optimizer updates ``model``.
        ``weight``: this rank's (its tokens, say), on every rank or none: the weighted mean
        (``reduce_gradients``), over the cycle's calls too with ``accumulate_steps``."""
        updated = self._step(gradients, model.parameters(), model, weight)
        if updated is not None:
            model.update(updated)

    def apply_gradients(self, gradients, parameters, weight=None):
        """The wrapped optimizer's ``apply_gradients`` on the reduced ``gradients`` (``weight``:
        as for ``update``); while accumulating, ``parameters`` (at the gradients' keys)."""
        updated = self._step(gradients, parameters, parameters, weight)
        return tree_map(lambda _, p: p, gradients, parameters) if updated is None else updated

    def reduce_gradients(self, gradients, weight=None):
        """Collective: ``gradients`` reduced now, as ``update`` would (``accumulate_steps`` aside)."""
        what = "DistributedOptimizer.reduce_gradients(grads)"
        watchdog.stepped()  # (as update would: a step, for du-launch's account)
        return self.reduction.reduce(gradients, weight=weight, what=what).wait()

    def _step(self, gradients, parameters, target, weight):
        """The updated parameters (of ``target``: the model or ``parameters``), or None while accumulating."""
        if self._fully_sharded is None:  # the path, decided at the first update (a traced one too)
            self._take_fully_sharded(target)
        options = {"op='sum'": self.reduction.op != "avg", "shard_optimizer_state=True": self.sharded}
        bad = [name for name, yes in {**options, "weight=": weight is not None}.items() if yes]
        if self._fully_sharded and bad:
            raise ValueError(
                f"DistributedOptimizer: a fully sharded model's gradients are averaged in its backward pass, "
                f"before update() sees them: {bad[0]} cannot apply (to weight the ranks, scale each rank's "
                "loss by N * w_r / sum(w): docs/guides/fsdp.md)"
            )
        shards = {k for k, (_, backend) in self._fully_sharded.items() if backend is self.backend}  # reduced
        if not self._checked and evaluate(parameters):  # every rank starts alike (not while MLX traces)
            fsdp.check_mlx_sharding(self.backend, target, "DistributedOptimizer")
            mine = dict(optimizer=rule_settings(self.optimizer), accumulate_steps=self.accumulate_steps)
            settings = {**mine, "shard_optimizer_state": self.sharded}
            held = "shards ((rank, size) in each du.fully_shard backend: give the optimizer one across the ranks of a shard)"
            others = dict.fromkeys(b for _, b in self._fully_sharded.values() if b is not self.backend)
            settings[held] = [(b.rank, b.size) for b in others]  # (one per backend, in the model's order)
            replicated = {k: p for k, p in tree_flatten(parameters) if k not in shards}
            check_start(self.reduction, "DistributedOptimizer", replicated, settings)
            self._checked = True
        cycle = self._accumulate(gradients, weight)
        if cycle is None:
            return None
        watchdog.stepped()
        gradients, weight = cycle
        what = "DistributedOptimizer.update(grads)"
        if self.sharded:
            return self._sharded_step(gradients, parameters, weight, what)
        flat = dict(tree_flatten(gradients))  # (the shards' gradients: reduced in the backward pass)
        replicated = {k: g for k, g in flat.items() if k not in shards}
        if replicated:
            flat.update(self.reduction.reduce(replicated, weight=weight, what=what).wait())
        return self.optimizer.apply_gradients(tree_unflatten(list(flat.items())), target)

    def _take_fully_sharded(self, target):
        """``target``'s fully sharded parameters (a model's: ``fsdp.sharded``): the layout of their state;
        those of this backend's units are reduced in their backward pass, not here."""
        every = fsdp.sharded(target, "DistributedOptimizer.apply_gradients", "use update(model, ...)")
        if every:
            fsdp.check_elementwise(self.optimizer, "DistributedOptimizer over a fully sharded model")
            self._layout = every
        self._fully_sharded = every

    def _sharded_step(self, gradients, parameters, weight, what):
        """ZeRO-1: this rank's shards of the reduced gradients step its parameters' shards, all-gathered."""
        grads = dict(self.reduction.check(gradients, weight, what))  # (the same tree everywhere)
        mine = self._my_shards([(k, p) for k, p in tree_flatten(parameters) if k in grads])
        # (where the transport has no reduce-scatter of its own, all-reduced as unsharded: the same bits)
        if self.backend.native_reduce_scatter:
            grads = fsdp.reduce_scatter(self.reduction, grads, what=what, weight=weight)
        else:
            grads = self.reduction.reduce(grads, weight=weight, verify=False, what=what).wait()
            grads = {k: fsdp.shard_of(g, self.backend.size, self.backend.rank) for k, g in grads.items()}
        updated = self.optimizer.apply_gradients(tree_unflatten(list(grads.items())), mine)
        return fsdp.whole_tree(updated, self._layout)

    def _accumulate(self, gradients, weight):
        """``(gradients, weight)`` to reduce at the cycle's k-th call (the mean over the calls, for "avg", or
        their sum; weighted: the weighted mean and the summed weight), else None."""
        k = self.accumulate_steps
        if k == 1:
            return gradients, weight
        if self._calls and (weight is None) != (self._weight is None):
            raise ValueError(
                "DistributedOptimizer: pass weight= to every call of an accumulation cycle, or to none"
            )
        if self._calls:  # (a key new or gone: the sum below would drop, or miss, its gradients)
            changed = dict(tree_flatten(gradients)).keys() ^ dict(tree_flatten(self._sum)).keys()
            if changed:
                raise ValueError(
                    f"DistributedOptimizer: {sorted(changed)} gained or lost their gradients within an "
                    "accumulation cycle: freeze or unfreeze parameters after a cycle's last call"
                )
        w = mx.array(1.0) if weight is None else as_weight(weight)  # (summed in float32: float16 overflows)
        summed = tree_map(lambda g: widened(g) * w if isinstance(g, mx.array) else g, gradients)
        if self._sum is None:
            self._sum, self._weight = summed, None if weight is None else w
        else:  # (leaves that are not arrays: the first call's)
            self._sum = tree_map(lambda a, b: a + b if isinstance(a, mx.array) else a, self._sum, summed)
            self._weight = None if weight is None else self._weight + w
        self._calls += 1
        if self._calls < k:  # (evaluated now: the graphs of the calls go)
            mx.async_eval([a for _, a in tree_flatten(self._sum) if isinstance(a, mx.array)])
            return None
        total, weight, self._sum, self._weight, self._calls = self._sum, self._weight, None, None, 0
        factor = 1 / k if self.reduction.op == "avg" else 1.0
        if weight is not None:
            factor = inverse(weight)

        def mean(s, g):  # (in the gradients' dtypes; other leaves as they are)
            return (s * factor).astype(g.dtype) if isinstance(s, mx.array) else s

        return tree_map(mean, total, gradients), weight


def check_start(reduction, who, parameters, settings: dict):
    """Collective: ValueError on every rank unless every rank holds rank 0's parameters (by digest),
    ``settings`` and ``reduction``'s (they decide which collectives a rank makes, and how it steps)."""
    digest = hashlib.sha256()
    for _, p in tree_flatten(parameters):
        if isinstance(p, mx.array):
            digest.update(np.asarray(bits(p)))
    name = "parameters at the first update (call du.synchronize(backend, model) on every rank first; fully sharded: before du.fully_shard), digest"
    check_same(reduction.backend, who, {**settings, **reduction.settings(), name: digest.hexdigest()[:16]})
