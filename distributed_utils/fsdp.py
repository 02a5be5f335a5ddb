"""Fully sharded models (FSDP, ZeRO stage 3) on every backend. A parameter of n elements, flattened
and zero-padded to N * c (c = ceil(n / N)), is cut into N **shards** of c; rank r keeps shard r, at
the parameter's key. A unit's own parameters (those of no fully sharded submodule) are all-gathered
for its forward pass, their gradients reduce-scattered (``Reduction.reduce(scatter=True)``) in the
backward pass. ZeRO-1 (the sharded optimizer state) and checkpoints use the same shards."""

import functools
import math

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx import optimizers as optim
from mlx.nn.layers import distributed as mlx_sharded
from mlx.utils import tree_flatten, tree_unflatten

from .arrays import bits, dtype_name, evaluate, is_floating, to_mx, to_numpy
from .collectives import allgather, allreduce, bcast, check_backend, check_same
from .reduction import Reduction
from .tree import columns, replace_arrays

#: Whether ``du.fully_shard`` ran in this process (over any backend; it stays set): see ``sharded``.
fully_sharded_in_process = False


class FullyShardedModule(nn.Module):
    """What ``fully_shard`` makes a module's class (a subclass of its own): it gathers at each call."""

    def __call__(self, *args, **kwargs):
        return _call(self, super().__call__, args, kwargs)


class _Unit:
    """What ``fully_shard`` keeps of a module, outside its parameters: ``shapes``, the whole ones by key;
    ``index``, its number among its backend's units (``backend.fully_sharded_units``: groups number their
    own); ``calls``, how often it gathered where checked (not while MLX traces: on one rank alone, maybe)."""

    def __init__(self, backend, name, shapes, compute_dtype, recompute):
        self.backend, self.shapes, self.calls = backend, shapes, 0
        self.compute_dtype, self.recompute = compute_dtype, recompute
        self.reduction = Reduction(backend, "avg")
        self.index = len(backend.fully_sharded_units)
        backend.fully_sharded_units.append(name)


def fully_shard(backend, module, *, compute_dtype=None, reshard_after_forward=True):
    """Collective: ``module`` (in place, returned) keeps of each of its own parameters this rank's shard of
    rank 0's values, gathered whole (in ``compute_dtype``) at each call; its backward pass gives the
    shards' gradients, averaged over the ranks. Blocks first, then the root. docs/guides/fsdp.md: the details."""
    check_backend(backend)
    if not isinstance(module, nn.Module):
        raise TypeError(f"du.fully_shard: expected an mlx.nn.Module, got {type(module).__name__}")
    check_mlx_sharding(backend, module, "du.fully_shard", replicated_ok=False)
    if isinstance(module, FullyShardedModule):
        return module
    if getattr(type(module).__call__, "__qualname__", "").startswith("grad_checkpoint."):
        raise ValueError(
            f"du.fully_shard: {type(module).__name__} runs through mlx-lm's grad_checkpoint, applied before "
            "du.fully_shard: its recomputation would run on the shards. reshard_after_forward=True already "
            "recomputes each unit in the backward pass; with False, apply grad_checkpoint after du.fully_shard"
        )
    named = module.named_modules()  # (a module two paths reach: at each)
    units = tuple(f"{p}." for p, m in named if isinstance(m, FullyShardedModule))  # (theirs are marked)
    inside = [p for p, m in named if getattr(m, "_du_inside", False) and not f"{p}.".startswith(units)]
    if inside:  # (its parameters would be sharded twice: it, or one it shares with a fully sharded module)
        which = f"its '{inside[0]}'" if inside[0] else "the module"
        raise ValueError(f"du.fully_shard: {which} is inside a fully sharded one; shard blocks first")
    own, nested = _own(module), bool(units)
    layout = [(k, a.shape, dtype_name(a.dtype)) for k, a in own]
    settings = {"parameters (key, shape, dtype)": layout, "compute_dtype": str(compute_dtype)}
    check_same(backend, "du.fully_shard", {**settings, "reshard_after_forward": reshard_after_forward})
    # one parameter whole at a time: own_shard evaluates and copies this rank's shard before the next
    module.update(tree_unflatten([(key, own_shard(bcast(backend, a), backend)) for key, a in own]))
    shapes = {key: a.shape for key, a in own}
    recompute = reshard_after_forward and not nested  # (a unit holding units keeps its own, as FSDP2's root)
    unit = _Unit(backend, type(module).__name__, shapes, compute_dtype, recompute)
    object.__setattr__(module, "_du_unit", unit)
    module.__class__ = _sharded_class(type(module))
    for _, m in named:  # (marked: a module inside is refused, even once this one is gone)
        object.__setattr__(m, "_du_inside", True)
    global fully_sharded_in_process
    fully_sharded_in_process = True
    return module


@functools.cache
def _sharded_class(cls):
    return type(f"FullySharded{cls.__name__}", (FullyShardedModule, cls), {})


def _own(module, parameter_filter=nn.Module.valid_parameter_filter) -> list:
    def keep(m, k, v):
        return not isinstance(v, FullyShardedModule) and parameter_filter(m, k, v)

    return tree_flatten(module.filter_and_map(keep))


def shard_of(a, size: int, rank: int) -> mx.array:
    """Rank's shard of ``a``: elements r * c .. (r + 1) * c - 1 of it, flattened and zero-padded (a view)."""
    flat = _padded(a.reshape(-1), size)
    c = flat.size // size
    return flat[rank * c : (rank + 1) * c]


def _padded(flat, size: int):
    pad = -flat.size % size
    return mx.concatenate([flat, mx.zeros((pad,), flat.dtype)]) if pad else flat


def gather(backend, shards: list, shapes: list, unit=None) -> list:
    """Collective, one all-gather: the whole arrays of ``shapes`` from every rank's 1-d ``shards`` (any
    dtypes: their bytes travel packed). ``unit``: the ``_Unit`` they are of, whose tag travels with them:
    ValueError on every rank unless every rank gathers the same unit's same call (traced: NaN values)."""
    if not shards:
        return []
    tag = []
    if unit is not None:  # (which unit, and which call of it, this rank gathers)
        tag = [mx.array([unit.index, unit.calls + 1], mx.int64).view(mx.uint8)]
    sent = [s.view(mx.uint8) for s in shards if s.size] + tag
    if not sent:  # (0-element arrays: nothing travels; MLX makes them)
        return [mx.zeros(shape, s.dtype) for s, shape in zip(shards, shapes)]
    rows = allgather(backend, mx.concatenate(sent)[None])  # (one row of bytes per rank)
    if unit is not None and evaluate(rows):
        unit.calls += 1
        _check_tags(to_numpy(rows[:, -16:]).view(np.int64), backend.fully_sharded_units)
    elif unit is not None:  # (traced: no error can be raised while the graph runs; every byte 0xff is NaN)
        rows = mx.where((rows[:, -16:] == rows[0, -16:]).all(), rows, mx.array(255, mx.uint8))
    wholes, widths = [], [s.nbytes for s in shards] + [t.nbytes for t in tag]
    for part, s, shape in zip(columns(rows, widths), shards, shapes):
        wholes.append(part.reshape(-1).view(s.dtype)[: math.prod(shape)].reshape(shape))
    return wholes


def _check_tags(tags, names: list):
    """ValueError on every rank (each sees every rank's tag) unless they gather the same unit's same call."""
    if (tags == tags[0]).all():
        return
    named = dict(enumerate(names))  # (?: a unit this rank never made, made on some ranks only)
    doing = "; ".join(f"rank {r}: unit {i} ({named.get(i, '?')}), call {c}" for r, (i, c) in enumerate(tags))
    raise ValueError(
        f"du.fully_shard: the ranks gather different fully sharded units ({doing}): every rank must call its "
        "fully sharded modules in the same order, as often (skipping blocks or routing to experts differently "
        "on each rank mixes their shards: draw such choices from a seed every rank shares)"
    )


def reduce_scatter(reduction, wholes: dict, *, what, weight=None) -> dict:
    """Collective: ``{key: this rank's shard of wholes[key] reduced over the ranks by reduction}``."""
    flats = {key: _padded(g.reshape(-1), reduction.backend.size) for key, g in wholes.items()}
    return reduction.reduce(flats, weight=weight, scatter=True, verify=False, what=what).wait()


def _call(module, forward, args, kwargs):
    """``forward(*args, **kwargs)`` with ``module``'s own parameters whole (see ``fully_shard``)."""
    unit, own = module._du_unit, dict(_own(module))
    for key, a in own.items():  # still this rank's shards? (load_weights(..., strict=False) puts whole ones)
        shard = (-(-math.prod(unit.shapes[key]) // unit.backend.size),)
        if a.shape != shard:
            raise ValueError(
                f"du.fully_shard({type(module).__name__}): '{key}' holds an array of shape {tuple(a.shape)}, "
                f"not this rank's shard {shard} of {tuple(unit.shapes[key])}: whole weights were loaded after "
                "du.fully_shard (model.load_weights, mlx-lm's load_adapters); load them before sharding, or "
                "save and load with du.save_checkpoint / du.load_checkpoint"
            )
    trainable = {k for k, _ in _own(module, nn.Module.trainable_parameter_filter)}
    keys = [k for k in own if k in trainable]  # gathered with a gradient: reduce-scattered
    frozen = [k for k in own if k not in trainable]
    what = f"fully_shard({type(module).__name__})"

    def whole(shards, names):
        to = unit.compute_dtype
        cast = [s.astype(to) if to and is_floating(s.dtype) else s for s in shards]
        return gather(unit.backend, cast, [unit.shapes[k] for k in names], unit)

    def scattered(shards, cotangents):  # the shards' gradients
        wholes = {k: g.astype(s.dtype) for k, g, s in zip(keys, cotangents, shards)}
        return list(reduce_scatter(unit.reduction, wholes, what=what + " backward").values())

    gathered = mx.custom_function(lambda shards: whole(shards, keys))
    gathered.vjp(lambda shards, cotangents, _: _detached(scattered(shards, cotangents)))

    def run(full, a, k):  # forward with the whole parameters, then the shards again
        frozen_full = [mx.stop_gradient(x) for x in whole([own[name] for name in frozen], frozen)]
        module.update(tree_unflatten(list(zip(keys + frozen, list(full) + frozen_full))))
        held = {name: x for name, x in _own(module) if name in frozen}  # (as held: aliases hold one)
        try:
            out = forward(*a, **k)
            assigned = [name for name, x in _own(module) if x is not held.get(name, x)]
        finally:
            module.update(tree_unflatten(list(own.items())))
        if assigned:  # (BatchNorm's running statistics, in training): the shards would silently drop them
            raise ValueError(f"{what}: its forward pass assigned {assigned}, which its shards cannot keep")
        return out

    shards = [own[k] for k in keys]
    if not unit.recompute:  # (MLX's custom_function crashes on an empty list)
        return run(gathered(shards) if shards else [], args, kwargs)
    return _recomputed(run, whole, scattered, keys, shards, args, kwargs, what)


def _recomputed(run, whole, scattered, keys, shards, args, kwargs, what):
    """``run``'s result, its backward pass gathering and recomputing it (floating array inputs only)."""
    inputs = [a for _, a in tree_flatten((args, kwargs)) if isinstance(a, mx.array)]

    def call(full, floats):  # (the floating inputs replaced by ``floats``)
        it = iter(floats)
        a, k = replace_arrays((args, kwargs), [next(it) if is_floating(x.dtype) else x for x in inputs])
        out = run(full, a, k)
        if not isinstance(out, mx.array):
            raise TypeError(
                f"{what}: reshard_after_forward=True needs a module that returns one array, not a "
                f"{type(out).__name__}; pass reshard_after_forward=False"
            )
        return out

    def forward(shards, floats):
        key = mx.random.state[0]
        out = _detached(call(whole(shards, keys), floats))  # (its graph, and the whole parameters, go)
        if key is not mx.random.state[0]:  # (a draw replaces the key, also while MLX traces)
            raise ValueError(
                f"{what}: reshard_after_forward=True recomputes the forward pass in the backward pass, "
                "and this module draws random numbers (dropout?); pass reshard_after_forward=False"
            )
        return out

    def backward(primals, cotangent, _):
        shards, floats = primals

        def flat(*a):  # (mx.vjp takes a flat list)
            return call(a[: len(shards)], a[len(shards) :])

        _, grads = mx.vjp(flat, [*whole(shards, keys), *floats], [cotangent])
        evaluate(grads)  # (the whole parameters and the activations recomputed go)
        return _detached(scattered(shards, grads[: len(shards)])), _detached(grads[len(shards) :])

    recomputed = mx.custom_function(forward)
    recomputed.vjp(backward)
    return recomputed(shards, [x for x in inputs if is_floating(x.dtype)])


# --- what the rest of the library asks of fully sharded models ----------------------------------


def _detached(a):
    """``a`` (or a list) evaluated and copied out of its graph: inside ``mx.value_and_grad`` an evaluated
    array keeps its inputs (whole parameters, activations) till the end. While MLX traces: ``a``."""
    if isinstance(a, list):
        return [_detached(x) for x in a]
    if not evaluate(a):
        return a
    return to_mx(to_numpy(bits(a))).view(a.dtype).reshape(a.shape)


def sharded(model, who=None, fix="pass model=") -> dict:
    """``{flat key: (whole shape, backend)}`` of ``model``'s shards. With no module, for ``who`` (the caller,
    given an optimizer, whose state only the model tells apart): a ValueError saying ``fix`` once
    ``fully_sharded_in_process``, even if that model is gone (on every rank that fully sharded one)."""
    if not isinstance(model, nn.Module) and who is not None and fully_sharded_in_process:
        raise ValueError(
            f"{who}: the optimizer may hold the state of a fully sharded model's shards, which only the model "
            f"tells apart ({fix})"
        )
    out = {}
    if isinstance(model, nn.Module):
        for path, m in model.named_modules():
            unit = getattr(m, "_du_unit", None)
            if unit is not None:
                prefix = f"{path}." if path else ""
                out.update({prefix + k: (shape, unit.backend) for k, shape in unit.shapes.items()})
    return out


def state_shards(state, model, who: str, fix="pass model=") -> dict:
    """``sharded(model)``, refused as ``sharded`` says unless ``state`` is None or knows its shards."""
    if state is None or state.knows_its_shards():
        return sharded(model)
    return sharded(model, who, fix)


def whole_tree(tree, shards: dict):
    """Collective: ``tree`` (parameters, or a state keyed by them) with its ``shards`` gathered whole."""
    return _at_shards(tree, shards, lambda a, shape, backend: gather(backend, [a], [shape])[0])


def shard_tree(tree, shards: dict):
    """``whole_tree``'s inverse, on this rank: its shard of each whole array at a key of ``shards`` (or shard)."""
    return _at_shards(tree, shards, lambda a, whole, b: own_shard(a, b) if a.shape == whole else a)


def own_shard(a, backend):
    """This rank's shard of ``a``, copied (``mx.contiguous`` may keep the whole array's memory)."""
    return _detached(shard_of(a, backend.size, backend.rank))


def whole_shapes(tree, shards: dict):
    """``tree`` with a stand-in of the whole shape (unevaluated zeros) for each shard: what ``whole_tree`` gives."""
    return _at_shards(tree, shards, lambda a, shape, _: mx.zeros(shape, a.dtype))


def layout_of(keys, shards: dict) -> dict:
    """``{key: (whole shape, backend)}`` for each of ``keys`` at or under a parameter key of ``shards`` (a
    parameter's key, or an optimizer state entry of it: ``key.m``)."""
    params = {key: key if key in shards else key.rpartition(".")[0] for key in keys}
    return {key: shards[param] for key, param in params.items() if param in shards}


def split_at_shards(tree, shards: dict) -> tuple:
    flat = tree_flatten(tree)
    at = layout_of([k for k, _ in flat], shards)
    return [(k, v) for k, v in flat if k in at], [(k, v) for k, v in flat if k not in at]


def _at_shards(tree, shards, fn):
    """``tree`` with ``fn(array, whole shape, backend)`` for each array at (or under) a key of ``shards``."""
    if not shards:
        return tree
    flat = tree_flatten(tree)
    at = layout_of([k for k, a in flat if isinstance(a, mx.array)], shards)
    return tree_unflatten([(k, fn(a, *at[k]) if k in at else a) for k, a in flat])


def clip_grad_norm(backend, gradients, max_norm: float):
    """Collective: ``(gradients scaled to a global norm of at most max_norm, the global norm)``, the norm
    over every rank's ``gradients`` (its shards, as MLX's ``clip_grad_norm_sharded``), in two small
    all-reduces: the largest magnitude first, which scales the squares (else gradients of 2e19 or more
    square to inf, and every gradient is clipped to 0)."""
    leaves = tree_flatten(gradients)
    zero = mx.array(0.0, mx.float32)
    magnitudes = [mx.abs(g).max().astype(mx.float32) for _, g in leaves if g.size]
    largest = allreduce(backend, mx.max(mx.stack(magnitudes)) if magnitudes else zero, "max")
    unit = mx.where(largest > 0, largest, 1.0)
    local = sum((mx.square(g.astype(mx.float32) / unit).sum() for _, g in leaves), zero)
    norm = mx.where(mx.isinf(largest), largest, mx.sqrt(allreduce(backend, local, "sum")) * unit)
    factor = mx.minimum(max_norm / (norm + 1e-6), 1.0)
    return tree_unflatten([(k, (g * factor).astype(g.dtype)) for k, g in leaves]), norm


#: Optimizers whose update is element by element: their state can be split anywhere.
ELEMENTWISE = (optim.SGD, optim.Adam, optim.Lion, optim.RMSprop, optim.Adagrad, optim.AdaDelta, optim.Adamax)


def check_elementwise(optimizer, who: str):
    """ValueError unless ``optimizer`` updates each element on its own (a step on shards is then exact)."""
    if isinstance(optimizer, ELEMENTWISE) and not isinstance(optimizer, optim.MultiOptimizer):
        return
    why = {
        "Adafactor": "it factors each matrix's second moment into row and column statistics",
        "Muon": "it orthogonalizes each matrix's update as a whole",
        "MultiOptimizer": "it picks an optimizer for each parameter by its name",
    }.get(type(optimizer).__name__, "it is not known to update each element on its own")
    names = ", ".join(c.__name__ for c in ELEMENTWISE) + " (and AdamW, a subclass of Adam)"
    raise ValueError(
        f"{who} steps shards of the parameters, which is exact only for element-by-element optimizers "
        f"({names}); {type(optimizer).__name__} cannot be split so: {why}"
    )


def check_mlx_sharding(backend, model, who: str, replicated_ok=True):
    """Collective: ValueError on every rank if ``model`` holds MLX's own sharded layers whose parameters
    differ across ``backend`` (``nn.fully_shard``'s; ``shard_linear``'s, unless ``replicated_ok`` and
    every rank holds the same shard): broadcasting, averaging or saving one rank's would be wrong."""
    kinds = (mlx_sharded.FullyShardedModule, mlx_sharded.AllToShardedLinear, mlx_sharded.ShardedToAllLinear)
    kinds += (mlx_sharded.QuantizedAllToShardedLinear, mlx_sharded.QuantizedShardedToAllLinear)
    layers = model.named_modules() if isinstance(model, nn.Module) else []
    found = [(p, m) for p, m in layers if isinstance(m, kinds)]
    found = [(p, m) for p, m in found if not (hasattr(m, "group") and m.group.size() == 1)]
    if not found:
        return
    groups = [m.group.rank() for _, m in found if hasattr(m, "group")]  # (tensor parallel: a group each)
    if replicated_ok and len(groups) == len(found) and all(g == groups for g in allgather(backend, groups)):
        return
    path, layer = found[0]
    raise ValueError(
        f"{who}: '{path or 'the model'}' is MLX's {type(layer).__name__}, whose parameters differ by rank "
        "here: du would treat them as replicated (broadcast, average or save one rank's). Use "
        "du.fully_shard, or give du a backend over ranks that hold the same shard (du.split)"
    )
