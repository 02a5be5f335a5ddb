"""``du.synchronize``: root's arrays, trees, modules, optimizer states and objects on every rank."""

import copy

import mlx.core as mx
import numpy as np
from mlx.nn import Module
from mlx.optimizers import Optimizer
from mlx.utils import tree_flatten, tree_unflatten

from . import fsdp
from .arrays import bits
from .collectives import bcast, check_root, run_on_root
from .state import of
from .tree import TreeMismatchError, buckets, describe, pack, unpack, verify_same_structure

BROADCAST_BUCKET_BYTES = 16 * 2**20  # the buckets of bits: small enough to stay in MLX's buffer cache


def synchronize(backend, x, root: int = 0, *, model=None, trainable_only=False):
    """Collective: ``x`` with root's values on every rank (on root, ``x`` itself), bit for bit.

    Arrays (numpy ones as new numpy arrays); trees (dict, list, tuple, namedtuple) with root's
    containers and other leaves (any picklable object); an ``nn.Module``'s ``parameters()``,
    in place (``trainable_only``: the trainable ones); an ``Optimizer``'s existing ``state``, in
    place (``model=``: initialized from the model first; a sharded ``DistributedOptimizer``
    keeps its own slices). Every rank holds arrays at the same keys, shapes and dtypes, else
    ``TreeMismatchError`` on every rank. Arrays travel as bits in ``BROADCAST_BUCKET_BYTES``
    buckets, the rest in one pickle."""
    check_root(backend, root)
    what = f"du.synchronize({type(x).__name__})"
    if isinstance(x, Optimizer):
        state = of(x)
        if model is not None and not state.initialized():
            x.init(model.trainable_parameters())
        hint = "call opt.init(model.trainable_parameters()) first, or pass model=model"
        shards = fsdp.state_shards(state, model, what)
        try:
            shared = _synchronize_tree(backend, state.shared_state(), root, what, shards)
        except TreeMismatchError as e:
            raise TreeMismatchError(f"{e}; an optimizer not yet updated: {hint}") from None
        if not state.initialized():  # the same on every rank: their states have the same structure
            raise ValueError(f"{what}: the state is not initialized; {hint}")
        if backend.rank != root:
            state.set_shared_state(shared)
        return x
    if model is not None:
        raise TypeError(f"{what}: model= is only for optimizers")
    if isinstance(x, Module):
        fsdp.check_mlx_sharding(backend, x, what)
        params = x.trainable_parameters() if trainable_only else x.parameters()
        params = _synchronize_tree(backend, params, root, what, fsdp.sharded(x))
        return x if backend.rank == root else x.update(params)
    if trainable_only:
        raise TypeError(f"{what}: trainable_only= is only for an nn.Module")
    return _synchronize_tree(backend, x, root, what)


def _synchronize_tree(backend, tree, root, what, shards=None):
    """Root's ``tree``; at the keys of ``shards`` (``fsdp.sharded``) each rank keeps its own."""
    if backend.size == 1:
        return tree
    if shards:
        own, shared = fsdp.split_at_shards(tree, shards)
        return tree_unflatten(list(_synchronize_tree(backend, dict(shared), root, what).items()) + own)
    # Only the arrays must agree: each rank receives into buffers the size of its own arrays.
    verify_same_structure(backend, [(k, s) for k, s in describe(tree) if isinstance(s, tuple)], what)
    skeleton = run_on_root(backend, lambda: _map(_stand_in, tree), root, TypeError, f"send {what}")
    arrays = [leaf for _, leaf in tree_flatten(tree) if _travels_as_bits(leaf)]
    sent = [bits(a) if backend.rank == root else mx.zeros_like(bits(a)) for a in arrays]  # (a not evaluated)
    groups = buckets(sent, BROADCAST_BUCKET_BYTES)  # (bcast evaluates: one bucket at a time)
    received = unpack([bcast(backend, pack(sent, group), root) for group in groups], sent, groups)
    if backend.rank == root:
        return tree
    rebuilt = (  # root's bits as this rank's kinds, dtypes and shapes (root's: verified), in root's order
        (np.array(r) if isinstance(a, np.ndarray) else r).view(a.dtype).reshape(a.shape)
        for a, r in zip(arrays, received)
    )
    return _map(lambda v: next(rebuilt) if v is _Array else v, skeleton)


def _travels_as_bits(leaf) -> bool:
    return isinstance(leaf, mx.array) or (isinstance(leaf, np.ndarray) and not leaf.dtype.hasobject)


def _stand_in(leaf):
    if isinstance(leaf, (Module, Optimizer)):
        raise TypeError(f"a tree holds a {type(leaf).__name__}: synchronize it on its own")
    return _Array if _travels_as_bits(leaf) else leaf


class _Array:
    """Stands for one of root's arrays in the tree it sends (a class: it unpickles as itself)."""


def _map(fn, tree):
    """``fn`` of each leaf that ``tree_flatten`` visits, in new containers of the same types."""
    if isinstance(tree, tuple):
        items = [_map(fn, v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, (list, dict)) and not isinstance(tree, Module):
        out = copy.copy(tree)  # keeps list and dict subclasses (OrderedDict, defaultdict)
        for k, v in enumerate(tree) if isinstance(tree, list) else tree.items():
            out[k] = _map(fn, v)
        return out
    return fn(tree)
