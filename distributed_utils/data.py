"""DistributedDataContainer: this rank's share of a data set (``partition.py``'s split), and
equal-length epochs of batches. The data is never copied: a batch's rows are read when asked for."""

import functools
import operator
import sys
import time
import warnings

import mlx.core as mx
import numpy as np

from . import partition, watchdog
from .collectives import allgather, check_count, check_same
from .registry import local_rank, total_workers

#: ``batches(share="auto")`` times this many steps (after one warm-up step) of each epoch.
AUTO_SHARE_STEPS = 4


class DistributedDataContainer:
    """This rank's share of ``data``: a sequence, a numpy or mx array (first axis), a tuple or dict
    of those indexed together, or a ``datasets.Dataset``. ``collate``: a list of items -> a batch
    (else stacked); ``lengths``: each item's length (an array, or a function of an item), for
    ``batches`` to group similar lengths. Collective at construction (every rank passes data of the
    same length); then ``len()``, ``container[i]`` and iteration cover this rank's shard, locally."""

    def __init__(self, backend, data, *, collate=None, lengths=None):
        self.backend, self.data, self.epoch = backend, data, 0
        self.rank, self.world_size = local_rank(backend), total_workers(backend)
        self._label = f"DistributedDataContainer on rank {self.rank}"  # (errors name it)
        # this epoch's batches() so far: world size, batch size, count, drop_last
        self._part = (self.world_size, None, 0, False)
        self._before = []  # the parts of this epoch run before a restart at another world size or batch size
        self._resume = None  # load_state_dict's state, for the next batches()
        self._auto_sizes = None  # the batch sizes share="auto" last agreed on
        self._columns, self._n = _columns_and_length(data, self._label)
        check_same(backend, self._label, {"data (the whole data set), of length": self._n})
        self.indices = range(*partition.shard_bounds(self._n, self.world_size, self.rank))
        if collate is not None and not callable(collate):
            raise TypeError(f"{self._label}: collate must be a function from a list of items to a batch")
        self.collate = collate
        self._lengths = None  # a function from global indices to lengths (memoized for a function of an item)
        if callable(lengths):
            of_item = functools.cache(lambda i: lengths(self._item(i)))
            self._lengths = lambda indices: [of_item(i) for i in indices.tolist()]
        elif lengths is not None:
            table = np.asarray(lengths)
            if table.shape != (self._n,):
                raise ValueError(
                    f"{self._label}: lengths must give one number per item ({self._n}), got shape {table.shape}"
                )
            self._lengths = lambda indices: table[indices]

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        i = operator.index(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self._label}: index {i} is out of range for this rank's {len(self)} items")
        return self._item(self.indices[i])

    def _item(self, j):  # (global)
        return self.data[j] if self._columns is None else _map_fields(self._columns, lambda f: f[j])

    def __iter__(self):
        """This rank's items in order (counts may differ by one across ranks; ``batches``'s do not)."""
        return (self[i] for i in range(len(self)))

    def set_epoch(self, epoch: int):
        """The epoch ``batches`` shuffles for by default (as PyTorch's DistributedSampler); on every rank."""
        self.epoch = operator.index(epoch)

    def num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        """Batches per epoch, the same on every rank."""
        batch_size = check_count(batch_size, 1, f"{self._label}: batch_size")
        return partition.batch_count(self._n, self.world_size, batch_size, drop_last)

    def state_dict(self) -> dict:
        """Where the job is in the data (the same on every rank), for ``save_checkpoint(data=)``."""
        if self._resume is not None:  # loaded, and not yet resumed by batches()
            return {"before": [], "batch_size": None, **self._resume}
        part = dict(zip(("world_size", "batch_size", "batches", "drop_last"), self._part))
        return {"epoch": self.epoch, **part, "before": [list(p) for p in self._before]}

    def load_state_dict(self, state: dict):
        """Resume from ``state_dict()``: the next ``batches()`` of the saved epoch (given no
        ``start``) skips the batches done; at another world size or batch size it shards the
        items not yet visited anew over this job's ranks (each still visited once)."""
        epoch, batches = operator.index(state["epoch"]), operator.index(state["batches"])
        if batches and state.get("batch_size") is None and state["world_size"] != self.world_size:
            raise ValueError(
                f"{self._label}: the data position was saved by {state['world_size']} ranks in the middle "
                f"of epoch {epoch} ({batches} batches) by an older version, without its batch size; "
                f"resume with {state['world_size']} ranks, or from a checkpoint saved at an epoch's end"
            )
        self.epoch, self._resume = epoch, state

    def _resumed_parts(self, epoch, batch_size):
        """(the parts of ``epoch`` done, the batches of this part to skip) after ``load_state_dict``."""
        state, self._resume = self._resume, None
        if state is None or state["epoch"] != epoch:
            return [], 0
        before = [tuple(part) for part in state.get("before", [])]
        world_size, saved_batch, batches = state["world_size"], state.get("batch_size"), state["batches"]
        if batches == 0 or (saved_batch in (None, batch_size) and world_size == self.world_size):
            return before, batches
        if self.rank == 0:
            warnings.warn(
                f"{self._label}: epoch {epoch} was saved after {batches} batches of {saved_batch} items on "
                f"each of {world_size} ranks (global batch {partition.global_batch(world_size, saved_batch)}); its "
                f"items not yet visited are sharded anew over {self.world_size} ranks with batches of "
                f"{batch_size} (global batch {partition.global_batch(self.world_size, batch_size)})",
                stacklevel=3,
            )
        return [*before, (world_size, saved_batch, batches, state.get("drop_last", False))], 0

    def batches(
        self,
        batch_size,
        *,
        shuffle=False,
        seed=0,
        epoch=None,
        drop_last=False,
        start=None,
        exactly_once=False,
        share=None,
    ):
        """Yields this rank's batches of one epoch: items stacked into mx.arrays (a tuple or dict
        of them for such data; non-numbers stay lists), or ``collate``'s. Collective: every rank
        passes the same arguments (else ValueError on every rank) and yields as many batches.

        - Each rank visits ``ceil(N / P)`` items (one short repeats one); ``drop_last``: full
          batches, no repeats. ``shuffle``: one permutation from ``(seed, epoch)``; ``epoch``
          defaults to ``set_epoch``'s. ``start`` skips batches (by default those done before
          ``load_state_dict``).
        - ``exactly_once`` (evaluation): every item once across the ranks, as ``(batch, mask)``:
          shards are filled up to the same number of batches with their first item, mask 0.
        - ``share`` (unequal hosts): this rank's share of each step's N x ``batch_size`` items
          (``partition.share_sizes``); weight the update by ``len(batch)``. ``"auto"``: the ranks
          time their own work (less their time in collectives) over ``AUTO_SHARE_STEPS`` steps,
          agree on shares in proportion (rank 0 prints them) and split the rest of the epoch so."""
        batch_size = check_count(batch_size, 1, f"{self._label}: batch_size")
        epoch = self.epoch if epoch is None else operator.index(epoch)
        start = None if start is None else operator.index(start)
        auto = isinstance(share, str) and share == "auto"
        how = dict(shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, exactly_once=exactly_once)
        agreed = {**how, "batch_size": batch_size, "start": start, "position_loaded": self._resume}
        agreed["share"] = share if auto or share is None else "a number on each rank"
        check_same(self.backend, f"{self._label}: batches()", agreed)
        if share is not None:
            batch_size = self._agreed_sizes(batch_size, share)
        before, skip = self._resumed_parts(epoch, batch_size)
        if exactly_once and (drop_last or before):
            why = "drop_last skips items"
            if not drop_last:
                why = "the epoch was begun at another world size or batch size"
            raise ValueError(f"{self._label}: exactly_once cannot visit every item once here: {why}")
        return self._sized_batches(how, before, batch_size, skip if start is None else start, auto)

    def _sized_batches(self, how, before, batch_size, start, auto=False):
        """The epoch's batches (``batch_size``: one, or every rank's list), handed out by ``_counted``."""
        mine = partition.size_of(batch_size, self.rank)
        where = (self._n, self.world_size, self.rank, batch_size)
        order_of = dict(shuffle=how["shuffle"], seed=how["seed"], epoch=how["epoch"], done=before)
        order_of["lengths"] = self._lengths
        if how["exactly_once"]:
            order, real = partition.exactly_once_indices(*where, **order_of)
        else:
            order, real = partition.epoch_indices(*where, drop_last=how["drop_last"], **order_of), None
        count = -(-len(order) // mine)
        if not 0 <= start <= count:
            raise ValueError(f"{self._label}: start={start} is not in 0..{count} (batches in this epoch)")
        starts = range(start * mine, len(order), mine)
        batches = (self._fetch(order[b : b + mine]) for b in starts)
        if real is not None:  # (batch, mask)
            batches = zip(batches, (mx.array(real[b : b + mine], mx.float32) for b in starts))
        return self._counted(how, before, batch_size, start, batches, auto)

    def _agreed_sizes(self, batch_size, share) -> list:
        """Collective: each rank's batch size for ``share`` ("auto": the last measured, saved, or equal)."""
        if share == "auto":
            saved, total = (self._resume or {}).get("batch_size"), batch_size * self.world_size
            for sizes in (self._auto_sizes, saved, [batch_size] * self.world_size):
                if isinstance(sizes, list) and len(sizes) == self.world_size and sum(sizes) == total:
                    return sizes
        ok = isinstance(share, (int, float, np.number)) and not isinstance(share, bool) and 0 < share < np.inf
        shares = allgather(self.backend, np.array([float(share) if ok else np.nan]))
        bad = [r for r, s in enumerate(shares) if not s > 0]
        if bad:
            raise ValueError(
                f"{self._label}: share must be a positive number or 'auto'; ranks {bad} passed another "
                f"(shares: {shares.tolist()})"
            )
        sizes = partition.share_sizes(batch_size, shares)
        if min(sizes) == 0:
            raise ValueError(
                f"{self._label}: shares {shares.tolist()} give ranks {[r for r, k in enumerate(sizes) if not k]} "
                f"no item of the {sum(sizes)} per step; raise their shares or the batch size"
            )
        return sizes

    def _measured_sizes(self, sizes, clock) -> list:
        """Collective: batch sizes in proportion to each rank's items per second of its own work."""
        (t0, w0), (t1, w1) = clock[0], clock[-1]
        speed = partition.size_of(sizes, self.rank) * (len(clock) - 1) / max((t1 - t0) - (w1 - w0), 1e-9)
        speeds = allgather(self.backend, np.array([speed]))
        self._auto_sizes = partition.share_sizes(sum(sizes) // self.world_size, speeds)
        for r in [r for r, k in enumerate(self._auto_sizes) if k == 0]:  # every rank keeps an item a step
            self._auto_sizes[r] += 1
            self._auto_sizes[int(np.argmax(self._auto_sizes))] -= 1
        if self.rank == 0:
            print(
                f"distributed_utils: batch shares (auto, epoch {self.epoch}): {self._auto_sizes} items per step by "
                f"rank, for {np.round(speeds, 1).tolist()} items/s of each rank's own work",
                file=sys.stderr,
            )
        return self._auto_sizes

    def _counted(self, how, before, batch_size, start, batches, auto=False):
        """``batches``, keeping ``state_dict`` current; ``auto``: the rest re-split once speeds are known."""
        drop_last = how["drop_last"]
        self.epoch, self._before = how["epoch"], before
        self._part = (self.world_size, batch_size, start, drop_last)
        clock = []  # (seconds, seconds in collectives) at each hand-out
        for batch in batches:
            self._part = (self.world_size, batch_size, self._part[2] + 1, drop_last)
            clock.append((time.monotonic(), watchdog.waited()))
            if auto and len(clock) == AUTO_SHARE_STEPS + 2:  # (the first step is a warm-up)
                sizes = self._measured_sizes(batch_size, clock[1:])
                if sizes != batch_size:  # the rest of the epoch, split anew, from this batch on
                    done = (self.world_size, batch_size, self._part[2] - 1, drop_last)
                    yield from self._sized_batches(how, [*before, done], sizes, 0)
                    return
            yield batch
        self.epoch, self._before = how["epoch"] + 1, []
        self._part = (self.world_size, batch_size, 0, drop_last)

    def _fetch(self, idx):
        """The batch of global indices ``idx`` (a numpy int array): stacked, or collated."""
        if self.collate is not None:
            return self.collate([self._item(int(i)) for i in idx])
        if self._columns is not None:
            return _map_fields(self._columns, lambda f: _take(f, idx))
        hf = sys.modules.get("datasets")  # a datasets.Dataset exists only if its module is loaded
        if hf is not None and isinstance(self.data, hf.Dataset):
            return {k: _stack(v) for k, v in self.data[idx.tolist()].items()}
        return _take(self.data, idx)

    def __repr__(self):
        return (
            f"DistributedDataContainer(rank={self.rank}, world_size={self.world_size}, "
            f"items {self.indices.start}..{self.indices.stop - 1} of {self._n})"
        )


def _columns_and_length(data, where):
    """``(columns, n)``: ``data``'s fields if a tuple or dict (else None), and its length, checked."""
    columns = data if isinstance(data, (tuple, dict)) else None
    if columns is not None:
        if not data:
            raise ValueError(f"{where}: data is an empty {type(data).__name__} (no fields)")
        lengths = {}
        for key, field in data.items() if isinstance(data, dict) else enumerate(data):
            m = None if isinstance(field, (tuple, dict)) else _len(field, where)
            if m is None:
                raise TypeError(
                    f"{where}: field {key!r} is a {type(field).__name__}; the fields of a tuple or dict "
                    "must be arrays or lists (len and indexing; no nested tuples or dicts)"
                )
            lengths[key] = m
        (first, n), *_ = lengths.items()
        for key, m in lengths.items():
            if m != n:
                raise ValueError(
                    f"{where}: field {key!r} has {m} items but field {first!r} has {n}; every field "
                    "needs the same length (first axis)"
                )
    else:
        n = _len(data, where)
        if n is None:
            raise TypeError(
                f"{where}: cannot index a {type(data).__name__}; pass a sequence (an iterator: list() it "
                "first), a numpy or mx array, a tuple or dict of arrays, or a datasets.Dataset"
            )
    if n == 0:
        raise ValueError(f"{where}: data is empty (0 items)")
    return columns, n


def _len(x, where):
    if not (hasattr(x, "__len__") and hasattr(x, "__getitem__")):
        return None
    try:
        return len(x)
    except TypeError:
        raise TypeError(f"{where}: a {type(x).__name__} of shape () has no first axis to split") from None


def _map_fields(fields, fn):
    return {k: fn(v) for k, v in fields.items()} if isinstance(fields, dict) else tuple(map(fn, fields))


def _take(field, idx):
    if isinstance(field, np.ndarray):  # (as MLX makes a batch of numpy's: float64 becomes float32)
        return mx.array(field[idx])
    if isinstance(field, mx.array):
        return field[mx.array(idx)]
    return _stack([field[int(i)] for i in idx])


def _stack(values: list):
    first = values[0]
    if isinstance(first, tuple):
        return tuple(_stack(list(col)) for col in zip(*values))
    if isinstance(first, dict):
        return {k: _stack([v[k] for v in values]) for k in first}
    if all(isinstance(v, mx.array) for v in values):
        return mx.stack(values)
    try:
        arr = np.asarray(values)
    except ValueError:  # ragged
        return values
    return mx.array(arr) if arr.dtype.kind in "biufc" else values
