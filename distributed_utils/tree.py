"""Parameter trees: their leaves by key path, and the cross-rank check that every rank holds
the same structure (keys, shapes, dtypes) before any tree data moves."""

import hashlib
import pickle

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten


class TreeMismatchError(ValueError):
    """Ranks hold differently structured trees; raised on every rank with the same message."""


def describe(tree) -> list:
    """``[(key, signature), ...]`` for the leaves of ``tree`` in flattening order; an array's
    signature is ``(dtype, shape)``, any other leaf's is its type name."""
    return [(key, _signature(leaf)) for key, leaf in tree_flatten(tree)]


def _signature(leaf):
    if isinstance(leaf, (mx.array, np.ndarray)):
        return (str(leaf.dtype).removeprefix("mlx.core."), tuple(leaf.shape))
    return type(leaf).__name__


def verify_same_structure(backend, description: list, what: str):
    """Collective: returns if every rank passed the same ``description`` (from ``describe``);
    otherwise raises TreeMismatchError on every rank, naming the first differing key, what
    each rank has there, and which ranks differ from rank 0.

    Costs one allgather of a 32-byte digest when the trees agree."""
    digest = np.frombuffer(hashlib.sha256(pickle.dumps(description)).digest(), np.uint8)
    digests = np.asarray(backend.allgather(digest)).reshape(backend.size, -1)
    if (digests == digests[0]).all():
        return
    descriptions = backend.allgather_object(description)  # every rank saw the mismatch
    raise TreeMismatchError(_mismatch_message(descriptions, what))


def _mismatch_message(descriptions: list, what: str) -> str:
    tables = [dict(d) for d in descriptions]
    keys = list(dict.fromkeys(k for d in descriptions for k, _ in d))
    key = next((k for k in keys if len({repr(t.get(k, "missing")) for t in tables}) > 1), None)
    if key is None:  # same leaves in a different order
        ranks = [r for r, d in enumerate(descriptions) if d != descriptions[0]]
        return f"{what}: ranks {ranks} order the tree's keys differently from rank 0"
    have = "; ".join(f"rank {r} has {_show(t.get(key, 'missing'))}" for r, t in enumerate(tables))
    differ = [r for r, t in enumerate(tables) if t.get(key, "missing") != tables[0].get(key, "missing")]
    return (
        f"{what}: ranks hold different trees; first difference at key '{key}': {have} "
        f"(ranks {differ} differ from rank 0)"
    )


def _show(signature) -> str:
    if isinstance(signature, tuple):
        dtype, shape = signature
        return f"{dtype} array of shape {shape}"
    return "no such key" if signature == "missing" else f"a {signature}"
