"""What an optimizer's state is, whoever holds it: the protocol that ``synchronize`` and
checkpoints use. The library's optimizers (``DistributedOptimizer``, ``DiLoCo``) implement
``OptimizerState``; ``of(optimizer)`` meets a plain ``mlx.optimizers`` optimizer with ``PlainOptimizerState``.

A state is a tree of **scalars** (``step``, ``learning_rate``: the entries that are not dicts or
lists) and **per-parameter entries**, each at its parameter's key: ``at_key(state,
"layers.0.weight") == {"m": ..., "v": ...}``."""

from mlx.optimizers import MultiOptimizer, Optimizer


class OptimizerState:
    """What ``synchronize`` and checkpoints ask of an optimizer. Each subclass defines ``rule_name`` (the
    update rule's class name, which a checkpoint records and checks at load) and ``initialized`` (whether the
    state holds its per-parameter entries: after ``init`` or an update); the others default to a state
    replicated in ``self.state``, the same on every rank."""

    def shared_state(self) -> dict:
        """The part of the state that every rank holds alike (``synchronize`` sends root's)."""
        return self.state

    def set_shared_state(self, state: dict):
        self.state = state

    def whole_state(self) -> dict:
        """Collective: the whole state, the same on every rank, as a checkpoint holds it (it loads
        at any world size); before the first update too."""
        return self.state

    def held_state(self) -> tuple:
        """``(this rank's state as it holds it, its shard layout)``: the layout ``{parameter key: (whole
        shape, backend)}`` names the parameters whose entries this rank holds as its shards (``fsdp.shard_of``:
        ZeRO-1's, a fully sharded model's); ``fsdp.whole_tree`` of the two is ``whole_state()``. A checkpoint
        writes each rank's shards where they are."""
        return self.whole_state(), {}

    def load_whole_state(self, state: dict, model=None):
        """Set the state from ``whole_state()``'s form (``model``: for wrappers that set parameters)."""
        self.state = state

    def knows_its_shards(self) -> bool:
        """Whether ``held_state()``'s layout names every shard held (else the model must tell them)."""
        return False


def forwarded(name: str, to: str) -> property:
    """A wrapper's property read from and written to its wrapped optimizer's (attribute ``to``) ``name``:
    mlx.optimizers.Optimizer's own properties, which a wrapper's ``__getattr__`` never reaches."""
    return property(
        lambda self: getattr(getattr(self, to), name), lambda self, v: setattr(getattr(self, to), name, v)
    )


class PlainOptimizerState(OptimizerState):
    """A plain ``mlx.optimizers.Optimizer``'s state (``.optimizer``), the same whole state on every rank."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    state = forwarded("state", to="optimizer")

    def rule_name(self) -> str:
        return type(self.optimizer).__name__

    def initialized(self) -> bool:
        if isinstance(self.optimizer, MultiOptimizer):
            return all(PlainOptimizerState(o).initialized() for o in self.optimizer.optimizers)
        return has_entries(self.optimizer.state)


def rule_settings(optimizer) -> dict:
    """What makes two ranks' ``mlx.optimizers`` optimizers step alike, to compare across ranks: the class,
    its hyperparameters (betas, momentum, ...), and the learning rate (a schedule: its value now, and its
    name), those of a ``MultiOptimizer``'s optimizers in turn."""
    if isinstance(optimizer, MultiOptimizer):
        return {"optimizers": [rule_settings(o) for o in optimizer.optimizers]}
    settings = {k: _comparable(v) for k, v in sorted(vars(optimizer).items()) if not k.startswith("_")}
    schedules = {k: _comparable(f) for k, f in optimizer._schedulers.items()}
    learning_rate = optimizer.state.get("learning_rate")
    shown_rate = None if learning_rate is None else repr(learning_rate.item())
    return {"rule": type(optimizer).__name__, **settings, "learning_rate": shown_rate, "schedules": schedules}


def _comparable(value) -> str:
    """``value`` as text the same on every rank holding it (a function: its name, not its address)."""
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    shown = repr(value)
    return type(value).__name__ if " at 0x" in shown else shown


def of(optimizer) -> OptimizerState:
    return optimizer if isinstance(optimizer, OptimizerState) else PlainOptimizerState(optimizer)


def scalars(state: dict) -> dict:
    return {k: v for k, v in state.items() if not isinstance(v, (dict, list, tuple))}


def has_entries(state: dict) -> bool:
    return len(scalars(state)) < len(state)


def at_key(tree, key: str):
    for part in key.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def check_plain(optimizer, who: str, name: str = "the optimizer"):
    """TypeError unless ``optimizer`` is a plain ``mlx.optimizers`` one (one of ours would reduce twice)."""
    if isinstance(optimizer, OptimizerState):
        raise TypeError(
            f"{who}: {name} is already distributed ({type(optimizer).__name__}); pass the plain "
            "mlx.optimizers optimizer (wrap it once)"
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{who}: {name} must be an mlx.optimizers.Optimizer, got {optimizer!r}")
