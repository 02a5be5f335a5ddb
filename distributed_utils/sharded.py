"""Sharded optimizer state (ZeRO stage 1), exact for element-by-element optimizers. With the
parameters laid out as one flat vector per dtype, padded to a multiple of N, rank r owns shard
r, and a step is: the gradients reduced and this rank's shard taken (one reduce-scatter where
the transport has its own; elsewhere the all-reduce, then the slice: Open MPI's reduce-scatter
was measured slower); its optimizer updates its shard; the shards are all-gathered.
"""

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .collectives import allgather
from .state import at_key, has_entries, scalars
from .tree import floating_leaves

#: Optimizers whose update is element by element: their state can be split anywhere.
ELEMENTWISE = (optim.SGD, optim.Adam, optim.Lion, optim.RMSprop, optim.Adagrad, optim.AdaDelta, optim.Adamax)


def check_elementwise(optimizer):
    """Raise ValueError unless ``optimizer``'s state can be sharded element by element."""
    if isinstance(optimizer, ELEMENTWISE) and not isinstance(optimizer, optim.MultiOptimizer):
        return
    why = {
        "Adafactor": "it factors each matrix's second moment into row and column statistics",
        "MultiOptimizer": "it picks an optimizer for each parameter by its name",
        "Muon": "it orthogonalizes each matrix's update as a whole",
    }.get(type(optimizer).__name__, "it is not known to update each element on its own")
    names = ", ".join(c.__name__ for c in ELEMENTWISE) + " (and AdamW, a subclass of Adam)"
    raise ValueError(
        f"shard_optimizer_state=True splits the optimizer state element by element, which is exact "
        f"only for {names}; {type(optimizer).__name__} cannot be split so: {why}. Use "
        "shard_optimizer_state=False"
    )


class Layout:
    """Where each leaf lies in one flat vector per dtype, padded to a multiple of the world size.
    Rank r's **shard** is a vector's r-th part; a **slice**, a shard's overlap with one leaf
    (``slices``: key -> (dtype name, start, stop) in the flat leaf)."""

    def __init__(self, leaves, size, rank):
        self.signature = [(key, a.shape, a.dtype) for key, a in leaves]
        self.groups = {}  # dtype name -> [(key, shape, start, stop)] in the flat vector
        for key, a in leaves:
            entries = self.groups.setdefault(str(a.dtype).removeprefix("mlx.core."), [])
            start = entries[-1][3] if entries else 0
            entries.append((key, a.shape, start, start + a.size))
        self.size, self.rank = size, rank
        self.shard_size = {name: -(-entries[-1][3] // size) for name, entries in self.groups.items()}
        self.slices = {}
        for name, entries in self.groups.items():
            lo, hi = rank * self.shard_size[name], (rank + 1) * self.shard_size[name]
            for key, _, start, stop in entries:
                if start < hi and lo < stop:
                    self.slices[key] = (name, max(lo, start) - start, min(hi, stop) - start)

    def fits(self, leaves) -> bool:
        return self.signature == [(key, a.shape, a.dtype) for key, a in leaves]

    def my_slices(self, arrays: dict) -> dict:
        """``{key: this rank's slice of arrays[key]}``, 1-d."""
        return {key: arrays[key].reshape(-1)[a:b] for key, (_, a, b) in self.slices.items()}

    def flatten(self, arrays: dict, name: str) -> mx.array:
        """The flat, padded vector of group ``name`` from ``arrays`` (by key)."""
        flat = [arrays[key].reshape(-1) for key, *_ in self.groups[name]]
        return _padded(flat, self.shard_size[name] * self.size, name)

    def shard(self, slices: dict, name: str) -> mx.array:
        """This rank's shard of group ``name``, from its slices (``my_slices``'s form)."""
        return _padded(
            [slices[key] for key, *_ in self.groups[name] if key in self.slices], self.shard_size[name], name
        )

    def slices_of(self, shard: mx.array, name: str) -> dict:
        """The slices of this rank's ``shard`` of group ``name`` (``shard``'s inverse)."""
        out, at = {}, 0
        for key, *_ in self.groups[name]:
            if key in self.slices:
                _, a, b = self.slices[key]
                out[key], at = shard[at : at + b - a], at + b - a
        return out

    def unflatten(self, flat: mx.array, name: str) -> dict:
        """``{key: array}`` from group ``name``'s flat vector (padded or not)."""
        return {key: flat[start:stop].reshape(shape) for key, shape, start, stop in self.groups[name]}


def _padded(parts, length, dtype_name) -> mx.array:
    """``parts`` (1-d) concatenated, and zeros after them up to ``length``."""
    pad = length - sum(p.size for p in parts)
    if pad or not parts:
        parts = parts + [mx.zeros((pad,), getattr(mx, dtype_name))]
    return mx.concatenate(parts) if len(parts) > 1 else parts[0]


class ShardedState:
    """The sharded update of one ``DistributedOptimizer``, whose ``optimizer`` holds the state
    of this rank's 1-d slices by the parameters' names (``opt.state["layers.0.weight"]["m"]``)."""

    def __init__(self, backend, optimizer, reduction):
        """``reduction``: how the gradients are reduced (the owner's ``Reduction``)."""
        check_elementwise(optimizer)
        self.backend, self.optimizer, self.reduction = backend, optimizer, reduction
        self.layout = None
        self._pending = None  # a whole state loaded before the layout was known
        # Whether the state has its per-parameter entries: on every rank alike (a rank may hold no slice)
        self.initialized = False

    def step(self, gradients, parameters, scale, weight, what):
        """Collective: the updated parameters at the keys of ``gradients``, reduced by ``reduction``."""
        mine, self.initialized = self._my_gradients(gradients, scale, weight, what), True
        # Nothing here holds the slices while the all-gather evaluates the update: MLX can then
        # reuse their buffers for its results (as it does for an unsharded optimizer).
        updated = self.optimizer.apply_gradients(mine, self.layout.my_slices(dict(tree_flatten(parameters))))
        whole = {}
        for name in self.layout.groups:
            whole.update(
                self.layout.unflatten(allgather(self.backend, self.layout.shard(updated, name)), name)
            )
        return tree_unflatten([(key, whole[key]) for key, *_ in self.layout.signature])

    def init(self, parameters):
        """Initialize the state of this rank's slices of ``parameters`` (a tree)."""
        layout = self._layout(floating_leaves(parameters, "DistributedOptimizer.init(parameters)"))
        self.optimizer.init(layout.my_slices(dict(tree_flatten(parameters))))
        self.initialized = True

    def whole_state(self) -> dict:
        """Collective: the state as it would be unsharded, gathered from every rank's slices."""
        if self.layout is None or self._pending is not None:
            return self._pending if self._pending is not None else self.optimizer.state
        layout, state = self.layout, self.optimizer.state
        whole = scalars(state)
        per_key = {key: {} for key, *_ in layout.signature}
        mine = {entry for key in layout.slices for entry in state.get(key, {})}
        entries = sorted(set().union(*allgather(self.backend, mine)))  # (a rank may hold no slice)
        for name in layout.groups:
            for entry in entries:
                shard = layout.shard(
                    {key: s[entry] for key, s in state.items() if key in layout.slices}, name
                )
                for key, a in layout.unflatten(allgather(self.backend, shard), name).items():
                    per_key[key][entry] = a
        return {**whole, **tree_unflatten(list(per_key.items()))}

    def load_whole_state(self, state: dict):
        """Take this rank's slices of ``state`` (``whole_state``'s form), once the layout is known."""
        self._pending, self.initialized = state, has_entries(state)
        if self.layout is not None:
            self._apply_pending()

    def _layout(self, leaves) -> Layout:
        if self.layout is None:
            self.layout = Layout(leaves, self.backend.size, self.backend.rank)
            if self._pending is not None:
                self._apply_pending()
        elif not self.layout.fits(leaves):
            raise ValueError(
                "DistributedOptimizer(shard_optimizer_state=True): the gradient tree changed (keys, "
                "shapes or dtypes) since the state was sharded; its slices no longer fit. Keep the same "
                "trainable parameters, or save a checkpoint and load it into a new DistributedOptimizer"
            )
        return self.layout

    def _apply_pending(self):
        state, self._pending = self._pending, None
        mine = scalars(state)
        for key, (_, a, b) in self.layout.slices.items() if has_entries(state) else ():  # (else: unused yet)
            mine[key] = {entry: v.reshape(-1)[a:b] for entry, v in at_key(state, key).items()}
        self.optimizer.state = mine

    def _my_gradients(self, gradients, scale, weight, what) -> dict:
        """This rank's slices of the reduced gradients: a reduce-scatter of the flat vectors where
        the transport has its own (half the traffic; int8 keeps a unit per array: all-reduce),
        else the all-reduce, then the slices."""
        reduction, grads = self.reduction, dict(tree_flatten(gradients))
        if not (self.backend.native_reduce_scatter and reduction.compression != "int8"):
            reduced = reduction.reduce(grads, scale=scale, weight=weight, what=what).wait()
            return self._layout(floating_leaves(grads, what)).my_slices(reduced)
        layout = self._layout(reduction.check(grads, weight, what, scale=scale))
        flats = {name: layout.flatten(grads, name) for name in layout.groups}
        shards = reduction.reduce(
            flats, scale=scale, weight=weight, scatter=True, verify=False, what=what
        ).wait()
        return {key: s for name, shard in shards.items() for key, s in layout.slices_of(shard, name).items()}
