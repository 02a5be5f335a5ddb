"""DiLoCo (Douillard et al., arXiv 2311.08105) and its streaming form (arXiv 2501.18512): data
parallelism for slow links. Each rank takes ``sync_every`` (H) steps of its inner optimizer
on its own, with no collective; then the ranks average the pseudo-gradient, the global
parameters minus their local ones, and an outer optimizer (SGD with Nesterov momentum by
default) takes one step on the global parameters, from which every rank continues.

With ``fragments=F`` the parameters are cut into F fragments of about equal bytes (whole
arrays, in ``tree_flatten`` order), and each fragment syncs every H steps, their syncs
staggered H/F steps apart: each sync moves 1/F of the bytes. Local SGD is DiLoCo with
``outer_optimizer=optim.SGD(1.0)``.
"""

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .api import allgather, check_backend
from .optimizer import DistributedOptimizer, check_same_parameters
from .reduction import as_compression, as_weight, reduce_gradients
from .sharded import at_key
from .tree import check_floating


class DiLoCo(optim.Optimizer):
    """Wraps ``inner_optimizer`` (any ``mlx.optimizers.Optimizer``, local to each rank) so that
    every ``sync_every`` steps the ranks agree on the parameters through ``outer_optimizer``.

    Collective like ``DistributedOptimizer``. A step that syncs no fragment makes no collective;
    a sync is one ``reduce_gradients`` of the fragment's pseudo-gradients, then the outer step,
    after which the synced parameters are bit for bit identical on every rank. The first update
    checks that the ranks start from the same parameters and settings.

    Args:
        backend: the backend the ranks share.
        inner_optimizer: the rule each rank applies to its own gradients (AdamW, say).
        outer_optimizer: the rule applied to the averaged pseudo-gradient; default
            ``optim.SGD(0.7, momentum=0.9, nesterov=True)``. Its state is keyed by the
            parameters' flat names; its step counts the syncs of every fragment.
        sync_every: H, the inner steps between two syncs of a fragment (an int >= 1).
        fragments: F, 1 <= F <= min(H, number of parameter arrays).
        compression: what the pseudo-gradients travel as (see ``reduce_gradients``): None,
            ``"bfloat16"``, ``"float16"`` or ``"int8"``.
        bucket_bytes: as for ``reduce_gradients``.

    ``update(model, grads, weight=w)``: the outer average is weighted by the sum of each rank's
    weights (tokens, say) since the fragment's last sync; pass it on every step or on none.

    Memory beyond the model and the inner state: the global parameters and the outer state
    (with the default, one momentum): twice the trainable parameters, all in ``state``.
    Checkpoints hold ``whole_state()``, which adds every rank's local parameters and inner state.
    """

    def __init__(self, backend, inner_optimizer, *, outer_optimizer=None, sync_every=100, fragments=1,
                 compression=None, bucket_bytes=None):  # fmt: skip
        check_backend(backend)
        for name, opt in (("inner_optimizer", inner_optimizer), ("outer_optimizer", outer_optimizer)):
            if isinstance(opt, (DistributedOptimizer, DiLoCo)):
                raise TypeError(f"DiLoCo: {name} is already distributed ({type(opt).__name__}); pass the plain "
                                "mlx.optimizers optimizer: DiLoCo does the communication")  # fmt: skip
            if not (opt is None and name == "outer_optimizer") and not isinstance(opt, optim.Optimizer):
                raise TypeError(f"DiLoCo: {name} must be an mlx.optimizers.Optimizer, got {opt!r}")
        for name, value in (("sync_every", sync_every), ("fragments", fragments)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DiLoCo: {name} must be an int >= 1, got {value!r}")
        if fragments > sync_every:
            raise ValueError(f"DiLoCo: fragments={fragments} is more than sync_every={sync_every}: each fragment "
                             "syncs once every sync_every steps, at its own step")  # fmt: skip
        self.backend, self.inner_optimizer = backend, inner_optimizer
        self.outer_optimizer = optim.SGD(0.7, momentum=0.9, nesterov=True) if outer_optimizer is None else outer_optimizer
        self.sync_every, self.fragments = sync_every, fragments
        self.compression, self.bucket_bytes = as_compression(compression), bucket_bytes
        self._global = None  # {flat key: the global parameters}, once initialized
        self._steps = 0  # inner steps taken
        self._weights = None  # per fragment: this rank's weight since its last sync (None: unweighted)
        self._local = {}  # {flat key: this rank's latest local parameters}

    # --- the state -----------------------------------------------------------------------

    @property
    def state(self) -> dict:
        """This rank's state: ``{}`` before the first update or ``init``, then the inner and
        outer optimizers' states, the global parameters and the step count."""
        if self._global is None:
            return {}
        return {"inner": self.inner_optimizer.state, "outer": self.outer_optimizer.state, "global": self._global,
                "steps": mx.array(self._steps, mx.int64)}  # fmt: skip

    @state.setter
    def state(self, state: dict):
        self._global = dict(tree_flatten(state["global"]))  # flat keys again, however it was nested
        self.inner_optimizer.state = state["inner"]
        outer = state["outer"]
        self.outer_optimizer.state = {**{k: v for k, v in outer.items() if not isinstance(v, (dict, list))},
                                      **{key: at_key(outer, key) for key in self._global}}  # fmt: skip
        self._steps = int(state["steps"].item())
        self._fragment_keys = _fragments(list(self._global.items()), self.fragments)

    @property
    def step(self) -> mx.array:
        return mx.array(self._steps, mx.int64)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    def init(self, parameters):
        """Start from ``parameters`` (a tree; those with gradients): the global copy, and the
        inner and outer optimizers' states. Local; ``update`` calls it the first time."""
        leaves = [(k, p) for k, p in tree_flatten(parameters) if isinstance(p, mx.array)]
        check_floating(leaves, "DiLoCo.init(parameters)")
        if len(leaves) < self.fragments:
            raise ValueError(f"DiLoCo: fragments={self.fragments} but the model has only {len(leaves)} "
                             "parameter arrays; a fragment is at least one array")  # fmt: skip
        self._global = dict(leaves)  # (no copy: MLX arrays do not change; the local ones become new arrays)
        self._local = dict(leaves)
        self._fragment_keys = _fragments(leaves, self.fragments)
        self.inner_optimizer.init(parameters)
        self.outer_optimizer.init(self._global)
        mx.eval(self._global, self.inner_optimizer.state, self.outer_optimizer.state)

    def whole_state(self) -> dict:
        """Collective: ``state`` plus every rank's local parameters, inner state and weights
        since the last syncs, stacked along a new first axis in rank order: what a checkpoint
        holds ({} before the first update or ``init``, on every rank alike)."""
        if self._global is None:
            return {}
        weights = mx.zeros((0,)) if self._weights is None else mx.stack(self._weights)
        mine = {"inner": self.inner_optimizer.state, "local": self._local, "weights": weights}
        return {**self.state, "ranks": tree_map(lambda a: allgather(self.backend, a[None]), mine)}

    def load_whole_state(self, state: dict, model=None):
        """Set the state from ``whole_state()``'s form, and ``model``'s parameters to this
        rank's local ones. Rank r takes saved rank r's part; at another world size, saved rank
        r % N's (at a step where every fragment has just synced, the global parameters)."""
        ranks = state["ranks"]
        row = self.backend.rank % int(ranks["weights"].shape[0])
        self.state = {**state, "inner": tree_map(lambda a: a[row], ranks["inner"])}
        self._weights = [w for w in ranks["weights"][row]] if ranks["weights"].shape[1] else None
        self._local = {k: v[row] for k, v in tree_flatten(ranks["local"])}
        if model is not None:
            model.update(tree_unflatten(list(self._local.items())))

    # --- the steps -----------------------------------------------------------------------

    def update(self, model, gradients, weight=None):
        """An inner step on ``model``; then the syncs due at this step (collective)."""
        model.update(self._step(gradients, model, weight))

    def apply_gradients(self, gradients, parameters, weight=None):
        """The updated ``parameters`` (for the keys of ``gradients``): an inner step, then the
        syncs due at this step (collective)."""
        return self._step(gradients, parameters, weight)

    def _step(self, gradients, parameters, weight):
        if self._global is None:
            if self.backend.size > 1:
                check_same_parameters(self.backend, parameters, "DiLoCo")
                self._check_same_settings()
            self.init(tree_map(lambda _, p: p, gradients, parameters))
        if self._steps == 0 and weight is not None:
            self._weights = [mx.array(0.0)] * self.fragments
        if (weight is None) != (self._weights is None):
            raise ValueError("DiLoCo: pass weight= to every update or to none")
        local = dict(tree_flatten(self.inner_optimizer.apply_gradients(gradients, parameters)))
        self._steps += 1
        for f, keys in enumerate(self._fragment_keys):
            if weight is not None:
                self._weights[f] = self._weights[f] + as_weight(weight)
            if self._steps % self.sync_every == (f + 1) * self.sync_every // self.fragments % self.sync_every:
                local.update(self._sync(f, keys, local))
        self._local = local
        return tree_unflatten(list(local.items()))

    def _check_same_settings(self):
        """Collective, at the first update: ranks that sync at other steps would wait for each
        other until the watchdog ends the job; raise ValueError on every rank instead."""
        mine = (self.sync_every, self.fragments, str(self.compression))
        everyone = allgather(self.backend, mine)
        differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differ:
            raise ValueError(f"DiLoCo: ranks {differ} have other (sync_every, fragments, compression) than rank 0: "
                             + ", ".join(f"rank {r}: {theirs}" for r, theirs in enumerate(everyone)))  # fmt: skip

    def _sync(self, f, keys, local) -> dict:
        """Collective: fragment ``f``'s new global parameters (every rank's alike)."""
        pseudo = {k: self._global[k] - local[k] for k in keys}
        weight = None if self._weights is None else self._weights[f]
        averaged = reduce_gradients(self.backend, pseudo, weight=weight, compression=self.compression,
                                    bucket_bytes=self.bucket_bytes)  # fmt: skip
        updated = self.outer_optimizer.apply_gradients(averaged, {k: self._global[k] for k in keys})
        mx.eval(updated, self.outer_optimizer.state)
        self._global.update(updated)
        if self._weights is not None:
            self._weights[f] = mx.array(0.0)
        return updated


def _fragments(leaves, count) -> list:
    """The flat keys of ``leaves`` (``[(key, array)]``) cut into ``count`` runs of about equal bytes."""
    total, out, run, filled = sum(a.nbytes for _, a in leaves), [], [], 0
    for i, (key, a) in enumerate(leaves):
        run.append(key)
        filled += a.nbytes
        left = len(leaves) - i - 1  # every later run needs an array
        if len(out) < count - 1 and (filled >= total * (len(out) + 1) / count or left == count - 1 - len(out)):
            out.append(run)
            run = []
    return out + [run]
