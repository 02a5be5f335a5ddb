"""How an epoch's items are split over the ranks: pure functions, the same on every rank.

Rank r of P owns the contiguous items ``shard_bounds(N, P, r)`` (``np.array_split``'s, Lux's
when P divides N, any P): disjoint shards that cover the data. ``batch_size`` is one size for
every rank, or the list of every rank's (``share_sizes``, for unequal hosts)."""

import numpy as np

#: Length-grouped batches are sorted within runs of this many batches (see ``group_by_length``).
LENGTH_GROUP_BATCHES = 32


def shard_bounds(n: int, world_size: int, rank: int) -> tuple:
    """``(start, stop)`` of rank's shard of ``n`` items: ``ceil(n / P)`` for the first ``n % P``, else ``floor``."""
    q, r = divmod(n, world_size)
    start = rank * q + min(rank, r)
    return start, start + q + (rank < r)


def batch_count(n: int, world_size: int, batch_size, drop_last: bool) -> int:
    """Batches per epoch, the same on every rank: every rank visits ``ceil(n / P)`` items (``drop_last``:
    full batches, no repeats), and ``ceil(ceil(n / P) / b)`` is ``ceil(n / (P * b))``."""
    total = global_batch(world_size, batch_size)
    return n // total if drop_last else -(-n // total)


def share_sizes(batch_size: int, shares) -> list:
    """Each rank's batch size for ``shares`` (positive numbers): ``N * batch_size * s_r / sum(s)``
    rounded, largest remainders first, to add up to ``N * batch_size``."""
    shares = np.asarray(shares, np.float64) / np.max(shares)  # (their sum cannot overflow)
    exact = len(shares) * batch_size * shares / shares.sum()
    sizes = np.floor(exact).astype(np.int64)
    sizes[np.argsort(sizes - exact, kind="stable")[: len(shares) * batch_size - sizes.sum()]] += 1
    return sizes.tolist()


def size_of(batch_size, rank) -> int:
    return batch_size[rank] if isinstance(batch_size, list) else batch_size


def global_batch(world_size, batch_size) -> int:
    return sum(batch_size) if isinstance(batch_size, list) else world_size * batch_size


def epoch_indices(
    n, world_size, rank, batch_size, *, shuffle=False, seed=0, epoch=0, drop_last=False, done=(), lengths=None
):
    """The global indices rank visits in this epoch, in order: ``ceil(n / P)`` items (``drop_last``:
    full batches) of the epoch's order from the start of rank's shard, wrapping around; with every
    rank's batch size (a list) its slice of each global batch instead; ``lengths``: grouped by length
    (``group_by_length``). ``done``: the parts ``(world_size, batch_size, batches[, drop_last])`` visited
    before (a restart, a re-split); the rest is sharded so. Over an epoch, whatever its parts, no item is
    visited twice before every item was visited once."""
    order = _remaining_order(n, shuffle, seed, epoch, done, lengths, exactly_once=False)
    return _visits(order, world_size, rank, batch_size, lengths, drop_last, exactly_once=False)[0]


def exactly_once_indices(
    n, world_size, rank, batch_size, *, shuffle=False, seed=0, epoch=0, done=(), lengths=None
):
    """``(indices, real)``: as ``epoch_indices``, but rank's shard alone, then its first item
    again (not ``real``) up to as many batches as every rank: each item once across the ranks (the
    ``done`` parts' and the rest's together)."""
    order = _remaining_order(n, shuffle, seed, epoch, done, lengths, exactly_once=True)
    return _visits(order, world_size, rank, batch_size, lengths, False, exactly_once=True)


def group_by_length(order, lengths, batch_size, real=None):
    """``order`` with each run of ``LENGTH_GROUP_BATCHES`` batches stably sorted by ``lengths(indices)``,
    longest first (less padding; the runs keep the epoch's order); with ``real`` (a prefix), those alone:
    the filler and the repeats after them stay last."""
    out = np.array(order)
    count = len(out) if real is None else int(real.sum())
    run = LENGTH_GROUP_BATCHES * batch_size
    for s in range(0, count, run):
        chunk = out[s : min(s + run, count)]
        out[s : s + len(chunk)] = chunk[np.argsort(-np.asarray(lengths(chunk)), kind="stable")]
    return out


def _visits(order, world_size, rank, batch_size, lengths, drop_last, exactly_once) -> tuple:
    """``(the items of order rank visits, in order; which are real: None unless exactly_once)``: the one
    rule that both a part's batches and the replay of the parts done before (``_remaining_order``) follow."""
    m = len(order)
    positions = _share(m, world_size, rank, batch_size, drop_last and not exactly_once, exactly_once)
    first = positions < m  # (the repeats past the end, or exactly_once's filler, stay last)
    if exactly_once:  # (the filler: rank's first item)
        positions = np.where(first, positions, positions[0] % m if m and len(positions) else 0)
    items = order[positions % max(m, 1)]
    if lengths is not None:
        items = group_by_length(items, lengths, size_of(batch_size, rank), first)
    return items, first if exactly_once else None


def _remaining_order(n, shuffle, seed, epoch, done, lengths, exactly_once) -> np.ndarray:
    """The epoch's order (``shuffle``: ``np.random.default_rng((seed, epoch))``'s permutation) less the
    items the ``done`` parts visited, each part run (as ``_visits``) on what the parts before it left."""
    order = np.random.default_rng((seed, epoch)).permutation(n) if shuffle else np.arange(n)
    for part in done:
        world_size, batch_size, batches = part[:3]
        drop_last = len(part) > 3 and bool(part[3])  # (parts saved before 2026-11 have three: no drop_last)
        visited = []
        for rank in range(world_size):
            items, real = _visits(order, world_size, rank, batch_size, lengths, drop_last, exactly_once)
            first = slice(0, batches * size_of(batch_size, rank))
            visited.append(items[first] if real is None else items[first][real[first]])
        order = order[~np.isin(order, np.concatenate(visited))]
    return order


def _share(m, world_size, rank, batch_size, drop_last, exactly_once) -> np.ndarray:
    """Which of ``m`` positions rank visits, in order: its shard's (or its slice of each global batch), then
    past ``m``, always last: repeats (wrapping around, ``% m``), or ``exactly_once``'s filler."""
    if isinstance(batch_size, list):
        steps = batch_count(m, world_size, batch_size, drop_last)
        starts = np.arange(steps)[:, None] * sum(batch_size) + sum(batch_size[:rank])
        return (starts + np.arange(batch_size[rank])).reshape(-1)
    start, stop = shard_bounds(m, world_size, rank)
    if exactly_once:
        total = batch_count(m, world_size, batch_size, False) * batch_size
        return np.concatenate([np.arange(start, stop), np.full(total - (stop - start), m)])
    count = batch_count(m, world_size, batch_size, True) * batch_size if drop_last else -(-m // world_size)
    positions = start + np.arange(count)
    return np.where(positions < stop, positions, positions + m)  # (a repeat of the next shard's: past m too)
