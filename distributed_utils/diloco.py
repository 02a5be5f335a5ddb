"""DiLoCo (Douillard et al., arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512): data
parallelism for slow links. Each rank takes ``sync_every`` (H) steps of its inner optimizer
alone; then the ranks average the pseudo-gradient (global minus local parameters), and an
outer optimizer takes one step on the global parameters, from which every rank continues.
With ``fragments=F``, F runs of whole arrays of about equal bytes sync in turn, H/F steps
apart: each sync moves 1/F of the bytes. Local SGD is ``outer_optimizer=optim.SGD(1.0)``.
With ``compression="sparse"`` (or a ``SparseCodec``: sparse.py) the pseudo-gradients go through
error feedback and travel as a few quantized values of each chunk, in one all-gather (SparseLoCo)."""

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import fsdp, sparse, watchdog
from .collectives import allgather, check_backend, check_count
from .optimizer import check_start
from .reduction import Pending, Reduction, as_weight
from .state import OptimizerState, at_key, check_plain, forwarded, rule_settings, scalars
from .tree import floating_leaves


class DiLoCo(OptimizerState, optim.Optimizer):
    """The module's algorithm around ``inner_optimizer`` (a plain ``mlx.optimizers`` optimizer, each
    rank's). Collective like ``DistributedOptimizer`` (its first update's check too), but a step that syncs
    no fragment makes none; after a sync the fragment's parameters are bit for bit the same on every rank.

    Args:
        outer_optimizer: default ``optim.SGD(0.7, momentum=0.9, nesterov=True)``; its state is
            keyed by the parameters' flat names.
        sync_every: H >= 1; fragments: F, 1 <= F <= min(H, number of parameter arrays).
        compression, bucket_bytes: what the pseudo-gradients travel as (``reduce_gradients``); or
            "sparse" / ``du.SparseCodec(k, chunk, bits, decay)`` (sparse.py): then the default outer
            optimizer is ``optim.SGD(1.0)`` and a delayed fragment's all-gather is made at its start.
        fragment_sync_delay: tau < H // F: a fragment's all-reduce starts tau steps before its
            sync and travels while the ranks compute (MLX: on the group's stream; MPIBackend's is summed at once).
        fragment_update_alpha: after a sync a rank's fragment is ``global + alpha * (local - global)``.

    ``update(model, grads, weight=w)`` weights the outer average by each rank's weights since
    the fragment's last sync (pass it on every step or none)."""

    def __init__(
        self,
        backend,
        inner_optimizer,
        *,
        outer_optimizer=None,
        sync_every=100,
        fragments=1,
        compression=None,
        bucket_bytes=None,
        fragment_sync_delay=0,
        fragment_update_alpha=0.0,
    ):
        check_backend(backend)
        check_plain(inner_optimizer, "DiLoCo", "inner_optimizer")
        if outer_optimizer is not None:
            check_plain(outer_optimizer, "DiLoCo", "outer_optimizer")
        check_count(sync_every, 1, "DiLoCo: sync_every")
        each = "DiLoCo: fragments (each syncs once every sync_every steps, at its own)"
        check_count(fragments, 1, each, sync_every)
        steps = sync_every // fragments  # between two fragments' syncs
        delay = f"DiLoCo: fragment_sync_delay (less than sync_every // fragments = {steps})"
        check_count(fragment_sync_delay, 0, delay, steps - 1)
        if not 0 <= fragment_update_alpha <= 1:
            raise ValueError(f"DiLoCo: fragment_update_alpha must be in [0, 1], got {fragment_update_alpha}")
        self.backend, self.inner_optimizer = backend, inner_optimizer
        if isinstance(compression, str) and compression == "sparse":
            compression = sparse.SparseCodec()  # (the defaults)
        self.codec = compression if isinstance(compression, sparse.SparseCodec) else None
        nesterov = optim.SGD(0.7, momentum=0.9, nesterov=True)
        self.outer_optimizer = outer_optimizer or (optim.SGD(1.0) if self.codec else nesterov)
        self.sync_every, self.fragments = sync_every, fragments
        self.delay, self.alpha = fragment_sync_delay, float(fragment_update_alpha)
        self.reduction = Reduction(backend, "avg", None if self.codec else compression, bucket_bytes)
        self._started = {}  # fragment -> the Pending reduction of its pseudo-gradient, in flight
        self._global = None  # {flat key: the global parameters}, once initialized
        self._steps = 0  # inner steps taken
        self._weights = None  # per fragment: this rank's weight since its last sync (None: unweighted)
        self._local = {}  # {flat key: this rank's latest local parameters}
        self._feedback = {}  # {flat key: this rank's error feedback (float32; none yet: zeros)}, with a codec
        self._checked = False  # the ranks' settings and parameters, at the first update (a resumed job's too)

    @property
    def state(self) -> dict:
        """This rank's inner and outer states and step count, and once initialized the global parameters."""
        state = {"inner": self.inner_optimizer.state, "outer": self.outer_optimizer.state, "steps": self.step}
        return state if self._global is None else {**state, "global": self._global}

    @state.setter
    def state(self, state: dict):
        self.inner_optimizer.state, outer = state["inner"], state["outer"]
        self._steps = int(state["steps"].item())
        self._global = None if "global" not in state else dict(tree_flatten(state["global"]))  # (flat keys)
        if self._global is not None:  # (the outer state is keyed by flat keys too)
            outer = {**scalars(outer), **{key: at_key(outer, key) for key in self._global}}
            self._fragment_keys = _fragments(list(self._global.items()), self.fragments)
        self.outer_optimizer.state = outer

    step = property(lambda self: mx.array(self._steps, mx.int64))

    learning_rate = forwarded("learning_rate", to="inner_optimizer")

    def rule_name(self) -> str:  # (other optimizers' state is refused at load)
        return f"DiLoCo({type(self.inner_optimizer).__name__}, {type(self.outer_optimizer).__name__})"

    def initialized(self) -> bool:
        return self._global is not None

    def init(self, parameters):
        """Local: start from ``parameters`` (those with gradients); the first ``update`` calls it."""
        leaves = floating_leaves(parameters, "DiLoCo.init(parameters)")
        if len(leaves) < self.fragments:
            raise ValueError(
                f"DiLoCo: fragments={self.fragments} but the model has only {len(leaves)} "
                "parameter arrays; a fragment is at least one array"
            )
        self._global, self._local = dict(leaves), dict(leaves)  # (no copy: MLX arrays do not change)
        self._fragment_keys = _fragments(leaves, self.fragments)
        self.inner_optimizer.init(parameters)
        self.outer_optimizer.init(self._global)
        mx.eval(self._global, self.inner_optimizer.state, self.outer_optimizer.state)

    def whole_state(self) -> dict:
        """Collective: what a checkpoint holds: ``state``, the average of a fragment in flight,
        and every rank's local parameters, inner state, weights and feedback, stacked in rank order."""
        if self._global is None:
            return self.state
        started = {k: a for pending in self._started.values() for k, a in pending.wait().items()}
        weights = mx.zeros((0,)) if self._weights is None else mx.stack(self._weights)
        mine = {"inner": self.inner_optimizer.state, "local": self._local, "weights": weights}
        mine["feedback"] = self._feedback
        ranks = tree_map(lambda a: allgather(self.backend, a[None]), mine)
        return {**self.state, "started": started, "ranks": ranks}

    def load_whole_state(self, state: dict, model=None):
        """Set the state from ``whole_state()``'s form, and ``model``'s parameters to this rank's
        local ones: saved rank r's, or at another world size r % N's."""
        if "ranks" not in state:  # saved before the first update
            self.state = state
            return
        ranks = state["ranks"]
        row = self.backend.rank % int(ranks["weights"].shape[0])
        self.state = {**state, "inner": tree_map(lambda a: a[row], ranks["inner"])}
        self._weights = [w for w in ranks["weights"][row]] if ranks["weights"].shape[1] else None
        self._local = {k: v[row] for k, v in tree_flatten(ranks["local"])}
        self._feedback = {k: v[row] for k, v in tree_flatten(ranks.get("feedback", {}))}
        started = dict(tree_flatten(state.get("started", {})))
        in_flight = [(f, keys) for f, keys in enumerate(self._fragment_keys) if keys[0] in started]
        self._started = {f: Pending(lambda keys=keys: {k: started[k] for k in keys}) for f, keys in in_flight}
        if model is not None:
            model.update(tree_unflatten(list(self._local.items())))

    def update(self, model, gradients, weight=None):
        """An inner step on ``model``; then the syncs due at this step (collective)."""
        model.update(self.apply_gradients(gradients, model, weight))

    def apply_gradients(self, gradients, parameters, weight=None):
        """The updated ``parameters`` at the keys of ``gradients``: ``update``'s steps."""
        if not self._checked:  # the ranks start alike: at the first update, or a resumed job's first
            fsdp.check_mlx_sharding(self.backend, parameters, "DiLoCo")
            if fsdp.sharded(parameters, "DiLoCo", "use update(model, ...)"):  # (a model tells; else refused)
                raise ValueError("DiLoCo does not compose with du.fully_shard: use DistributedOptimizer")
            if self.backend.size > 1:  # (resumed: its global parameters are checked)
                settings = dict(
                    sync_every=self.sync_every,
                    fragments=self.fragments,
                    fragment_sync_delay=self.delay,
                    fragment_update_alpha=self.alpha,
                    inner=rule_settings(self.inner_optimizer),
                    outer=rule_settings(self.outer_optimizer),
                    codec=self.codec,
                )
                check_start(self.reduction, "DiLoCo", self._global or parameters, settings)
            self._checked = True
        if self._global is None:
            self.init(tree_map(lambda _, p: p, gradients, parameters))
        changed = {k for k, g in tree_flatten(gradients) if isinstance(g, mx.array)} ^ set(self._global)
        if changed:  # (its fragments, global parameters and outer state are of the first update's)
            raise ValueError(
                f"DiLoCo: {sorted(changed)} gained or lost their gradients since it started (its first update, "
                "init or load): freeze or unfreeze parameters before it"
            )
        if self._steps == 0 and weight is not None:
            self._weights = [mx.array(0.0)] * self.fragments
        if (weight is None) != (self._weights is None):
            raise ValueError("DiLoCo: pass weight= to every update or to none")
        local = dict(tree_flatten(self.inner_optimizer.apply_gradients(gradients, parameters)))
        self._steps += 1
        watchdog.stepped()
        for f, keys in enumerate(self._fragment_keys):
            if weight is not None:
                self._weights[f] = self._weights[f] + as_weight(weight)
            sync_at = (f + 1) * self.sync_every // self.fragments % self.sync_every
            if self._steps % self.sync_every == (sync_at - self.delay) % self.sync_every:
                self._start(f, keys, local)
            if self._steps % self.sync_every == sync_at:
                local.update(self._sync(f, local))
        self._local = local
        return tree_unflatten(list(local.items()))

    @watchdog.watch("DiLoCo sync: start", timeout=0)  # (regions of the timeline)
    def _start(self, f, keys, local):
        """Collective: start averaging fragment ``f``'s pseudo-gradient (global minus local)."""
        pseudo = {k: self._global[k] - local[k] for k in keys}
        w = None if self._weights is None else self._weights[f]
        if self.codec:
            averaged, feedback = self.codec.reduce(self.backend, pseudo, self._feedback, w)
            self._feedback.update(feedback)
            self._started[f] = Pending(lambda: averaged)
        else:
            self._started[f] = self.reduction.reduce(pseudo, weight=w, what="DiLoCo's sync")
        if self._weights is not None:
            self._weights[f] = mx.array(0.0)

    @watchdog.watch("DiLoCo sync: outer step", timeout=0)
    def _sync(self, f, local) -> dict:
        """Collective: fragment ``f``'s parameters after its outer step (global, or mixed: ``alpha``)."""
        averaged = self._started.pop(f).wait()
        updated = self.outer_optimizer.apply_gradients(averaged, {k: self._global[k] for k in averaged})
        mx.eval(updated, self.outer_optimizer.state)
        self._global.update(updated)
        return updated if not self.alpha else {k: g + self.alpha * (local[k] - g) for k, g in updated.items()}


def _fragments(leaves, count) -> list:
    """The flat keys of ``leaves`` (``[(key, array)]``) cut into ``count`` runs of about equal bytes."""
    total, out, run, filled = sum(a.nbytes for _, a in leaves), [], [], 0
    for i, (key, a) in enumerate(leaves):
        run.append(key)
        filled += a.nbytes
        need = count - 1 - len(out)  # runs still to close (each later run needs an array)
        if need > 0 and (filled >= total * (len(out) + 1) / count or len(leaves) - i - 1 == need):
            out.append(run)
            run = []
    return out + [run]
