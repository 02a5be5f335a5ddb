"""Trees of arrays: their leaves, the packer that carries many arrays in few collectives, and
the check that every rank holds the same structure (the bucket sizes: docs/architecture.md)."""

import itertools

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .arrays import show, signature
from .collectives import check_same


class TreeMismatchError(ValueError):
    """Ranks hold differently structured trees; raised on every rank with the same message."""


def floating_leaves(tree, what: str) -> list:
    leaves = [(key, a) for key, a in tree_flatten(tree) if isinstance(a, mx.array)]
    for key, a in leaves:
        if not mx.issubdtype(a.dtype, mx.inexact):
            raise TypeError(
                f"{what}: '{key}' has dtype {a.dtype}; gradients and the parameters they update are floating"
            )
    return leaves


def replace_arrays(tree, arrays):
    it = iter(arrays)
    return tree_map(lambda v: next(it) if isinstance(v, mx.array) else v, tree)


def buckets(arrays, limit: int) -> list:
    """The indices of ``arrays`` grouped for packing, from the last array to the first (a backward pass
    computes the last layers' gradients first): arrays of one dtype, up to ``limit`` bytes a bucket; an array
    of ``limit`` bytes or more alone (0: every array). A bucket goes in the order of its first array."""
    groups, filling = [], {}  # filling: the bucket being filled, and its bytes, by dtype
    for i in reversed(range(len(arrays))):
        a = arrays[i]
        bucket, nbytes = filling.pop(a.dtype, (None, 0))
        if bucket is None or nbytes + a.nbytes > limit or a.nbytes >= limit:
            bucket, nbytes = [], 0
            groups.append(bucket)
        bucket.append(i)
        if a.nbytes < limit:  # (else it travels alone: the next of its dtype starts a bucket)
            filling[a.dtype] = (bucket, nbytes + a.nbytes)
    return groups


def pack(arrays, bucket, rows=1) -> mx.array:
    """The arrays at the indices ``bucket`` as one flat array (a lone array as it is): each cut in ``rows``
    rows, row r of each after row r of the one before (N rows: a reduce-scatter gives rank r row r of all)."""
    if len(bucket) == 1:
        return arrays[bucket[0]]
    return mx.concatenate([arrays[i].reshape(rows, -1) for i in bucket], axis=1).reshape(-1)


def unpack(flats, arrays, groups, rows=1) -> list:
    """``pack``'s inverse: ``flats`` (a collective's result of each bucket of ``groups``: one row of each
    array) cut into arrays shaped like ``arrays`` (``rows`` > 1: 1-d), in their order."""
    out = [None] * len(arrays)
    for group, flat in zip(groups, flats):
        for i, part in zip(group, columns(flat.reshape(1, -1), [arrays[i].size // rows for i in group])):
            out[i] = part.reshape(arrays[i].shape if rows == 1 else -1)
    return out


def columns(matrix, widths) -> list:
    """The columns of a 2-d ``matrix`` cut in ``widths``: what a collective gives of each packed array."""
    cuts = list(itertools.accumulate(widths))[:-1]
    return mx.split(matrix, cuts, axis=1) if cuts else [matrix]


def describe(tree) -> list:
    return [(key, signature(leaf)) for key, leaf in tree_flatten(tree)]


def verify_same_structure(backend, description: list, what: str):
    """Collective: unless every rank's ``description`` is the same, TreeMismatchError naming the first key."""
    check_same(backend, what, {"tree": description}, TreeMismatchError, _mismatch_message)


def _mismatch_message(what: str, everyone: list) -> str:
    descriptions = [values["tree"] for values in everyone]
    tables = [dict(d) for d in descriptions]
    keys = list(dict.fromkeys(k for d in descriptions for k, _ in d))
    key = next((k for k in keys if len({repr(t.get(k, "missing")) for t in tables}) > 1), None)
    if key is None:  # same leaves in a different order
        ranks = [r for r, d in enumerate(descriptions) if d != descriptions[0]]
        return f"{what}: ranks {ranks} order the tree's keys differently from rank 0"
    have = "; ".join(f"rank {r} has {_leaf(t.get(key, 'missing'))}" for r, t in enumerate(tables))
    differ = [r for r, t in enumerate(tables) if t.get(key, "missing") != tables[0].get(key, "missing")]
    return (
        f"{what}: ranks hold different trees; first difference at key '{key}': {have} "
        f"(ranks {differ} differ from rank 0)"
    )


def _leaf(sig) -> str:
    if isinstance(sig, tuple):
        return f"{sig[0]} array of shape {sig[1]}"
    return "no such key" if sig == "missing" else f"a {show(sig)}"
