"""DistributedDataContainer: run alone (a world of one) and under the launcher, where every rank
runs this file; collective checks gather every rank's view and assert on the same data. The
hypothesis profile of tests/conftest.py makes every rank draw the same examples."""

import collections
import time
import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_optimizer import assert_same_parameters, dataset, loss_fn, mlp

import distributed_utils as du
from distributed_utils.data import AUTO_SHARE_STEPS
from distributed_utils.partition import (
    batch_count,
    epoch_indices,
    exactly_once_indices,
    shard_bounds,
    share_sizes,
)


def as_list(batch):
    return np.asarray(batch).tolist()


# ---- the pure partition functions, for many simulated world sizes ----


@given(
    n=st.integers(1, 150),
    batch=st.integers(1, 12),
    shuffle=st.booleans(),
    seed=st.integers(0, 9),
    parts=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 12), st.floats(0, 1)), min_size=1, max_size=3),
    world=st.integers(1, 6),
    drop_last=st.booleans(),
)
def test_an_epoch_resumed_at_other_world_sizes_visits_the_rest_exactly_once(
    n, batch, shuffle, seed, parts, world, drop_last
):
    """Restarts at other world sizes and batch sizes: each part visits only items no earlier
    part visited; the last part, at ``world`` ranks, visits all that is left (drop_last:
    all but fewer than world * batch), with equal batch counts on every rank."""
    done, seen = [], set()
    for world_then, batch_then, fraction in parts:
        orders = [
            epoch_indices(n, world_then, r, batch_then, shuffle=shuffle, seed=seed, done=done)
            for r in range(world_then)
        ]
        batches = int(fraction * -(-len(orders[0]) // batch_then))  # stopped after this many
        visited = {i for order in orders for i in order[: batches * batch_then].tolist()}
        assert not visited & seen
        seen |= visited
        done.append((world_then, batch_then, batches))
    orders = [
        epoch_indices(n, world, r, batch, shuffle=shuffle, seed=seed, drop_last=drop_last, done=done)
        for r in range(world)
    ]
    assert len({len(order) for order in orders}) == 1
    rest = np.concatenate(orders).tolist()
    assert not set(rest) & seen
    left = n - len(seen)
    if drop_last:
        assert len(set(rest)) == len(rest) and left - len(rest) < world * batch
    else:
        assert seen | set(rest) == set(range(n)) and len(rest) - left < world


@given(
    n=st.integers(1, 400),
    seed=st.integers(0, 9),
    parts=st.lists(
        st.tuples(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.floats(0, 1)),
        min_size=1,
        max_size=3,
    ),
    exactly_once=st.booleans(),
)
def test_length_grouped_parts_resumed_or_re_split_visit_every_item_once(n, seed, parts, exactly_once):
    """#38: with lengths (sorted within runs of 32 batches), the parts done before were replayed in the
    unsorted order: a re-split (share="auto") or a resume visited 31 of 256 items twice and 31 never. Each
    part here is every rank's batch size (shares), stopped after a fraction of its batches; the last part
    finishes the epoch. exactly_once: the real items alone, each once."""
    table = np.random.default_rng(seed).integers(1, 50, n)
    lengths = table.__getitem__
    done, seen = [], []
    *before, (last_sizes, _) = parts
    for sizes, fraction in before:
        world = len(sizes)
        visits = [visit(n, world, r, sizes, seed, done, lengths, exactly_once) for r in range(world)]
        batches = int(fraction * -(-len(visits[0][0]) // sizes[0]))
        for r, (items, real) in enumerate(visits):
            first = slice(0, batches * sizes[r])
            seen += (items[first] if real is None else items[first][real[first]]).tolist()
        done.append((world, sizes, batches))
    world = len(last_sizes)
    visits = [visit(n, world, r, last_sizes, seed, done, lengths, exactly_once) for r in range(world)]
    rest = [i for items, real in visits for i in (items if real is None else items[real]).tolist()]
    assert sorted(set(seen) | set(rest)) == list(range(n))  # every item visited
    if len(set(seen)) < n:  # none twice before every item was visited (a part that ended the epoch repeats)
        assert len(seen) == len(set(seen)) and not set(seen) & set(rest)
    if exactly_once:
        assert len(rest) == len(set(rest))


@given(n=st.integers(1, 200), world=st.integers(1, 5), batch=st.integers(1, 6), seed=st.integers(0, 9))
def test_length_grouped_batches_visit_every_item_once_before_any_twice(n, world, batch, seed):
    """Found by an adversarial test: a rank whose shard is one item short took the next shard's first item
    as its repeat, not marked as one, so the length grouping moved it forward when it was long."""
    lengths = np.random.default_rng(seed).integers(1, 50, n).__getitem__
    orders = [
        epoch_indices(n, world, r, batch, shuffle=True, seed=seed, lengths=lengths) for r in range(world)
    ]
    seen = set()
    for s in range(0, len(orders[0]), batch):
        step = np.concatenate([order[s : s + batch] for order in orders]).tolist()
        if len(seen | set(step)) < len(seen) + len(step):  # a repeat: only once every item is visited
            assert len(seen | set(step)) == n, (s, step, seen)
        seen |= set(step)


def visit(n, world, rank, sizes, seed, done, lengths, exactly_once):
    how = dict(shuffle=True, seed=seed, done=done, lengths=lengths)
    if exactly_once:
        return exactly_once_indices(n, world, rank, sizes, **how)
    return epoch_indices(n, world, rank, sizes, **how), None


@given(n=st.integers(1, 300), world=st.integers(1, 40))
def test_shard_bounds_are_array_split_and_lux_chunks_when_they_divide(n, world):
    bounds = [shard_bounds(n, world, r) for r in range(world)]
    assert [list(range(*b)) for b in bounds] == [list(c) for c in np.array_split(np.arange(n), world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    if n % world == 0:  # Lux: Iterators.partition(1:n, ceil(n / P))
        chunk = n // world
        assert bounds == [(r * chunk, (r + 1) * chunk) for r in range(world)]


@given(
    n=st.integers(1, 200),
    world=st.integers(1, 24),
    batch=st.integers(1, 40),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
)
def test_epoch_indices_give_equal_batches_and_cover_the_data(
    n, world, batch, drop_last, shuffle, seed, epoch
):
    orders = [
        epoch_indices(n, world, r, batch, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
        for r in range(world)
    ]
    steps = batch_count(n, world, batch, drop_last)
    for order in orders:  # same length on every rank, hence the same batches and batch sizes
        assert len(order) == len(orders[0]) and -(-len(order) // batch) == steps
    visited = np.concatenate(orders)
    assert ((0 <= visited) & (visited < n)).all()
    if drop_last:
        assert len(set(visited.tolist())) == len(visited)  # no repeats
        assert n - len(visited) < world * batch  # fewer than P * batch_size dropped
        assert len(orders[0]) % batch == 0
    else:
        assert set(visited.tolist()) == set(range(n))
        assert len(visited) - n == world * -(-n // world) - n < world  # padding: under P repeats
    if not shuffle:
        for r, order in enumerate(orders):
            start, stop = shard_bounds(n, world, r)
            own = order[: stop - start]
            assert own.tolist() == list(range(start, start + len(own)))


@given(n=st.integers(2, 200), world=st.integers(1, 8), seed=st.integers(0, 1000))
def test_shuffle_depends_on_seed_and_epoch_only(n, world, seed):
    def order(epoch, s=seed):
        return np.concatenate(
            [epoch_indices(n, world, r, 1, shuffle=True, seed=s, epoch=epoch) for r in range(world)]
        )

    assert (order(3) == order(3)).all()
    if n >= 8:  # n! orders: a repeat would be a bug, not bad luck
        assert (order(0) != order(1)).any() and (order(0) != order(0, seed + 1)).any()


# ---- the container under the real world ----


@given(n=st.integers(1, 120), kind=st.sampled_from(["list", "numpy", "mx", "tuple", "dict"]))
def test_shards_are_disjoint_and_complete(backend, n, kind):
    x = np.arange(n) * 10
    data = {
        "list": list(x),
        "numpy": x,
        "mx": mx.array(x),
        "tuple": (x, np.arange(n)),
        "dict": {"x": x, "i": list(range(n))},
    }[kind]
    c = du.DistributedDataContainer(backend, data)
    local = list(c.indices)
    assert len(c) == len(local)
    items = list(c)
    assert len(items) == len(c)

    def value(item):
        return int(item[0] if kind == "tuple" else item["x"] if kind == "dict" else item)

    assert [value(c[i]) for i in range(len(c))] == [value(item) for item in items] == [10 * j for j in local]
    everyone = du.allgather(backend, local)
    flat = [j for share in everyone for j in share]
    assert sorted(flat) == list(range(n)) and len(flat) == n  # each item exactly once


@given(n=st.integers(1, 100), batch=st.integers(1, 24), drop_last=st.booleans(), shuffle=st.booleans())
def test_every_rank_yields_the_same_number_and_sizes_of_batches(backend, n, batch, drop_last, shuffle):
    c = du.DistributedDataContainer(backend, np.arange(n))
    sizes = [b.shape[0] for b in c.batches(batch, shuffle=shuffle, seed=1, drop_last=drop_last)]
    everyone = du.allgather(backend, sizes)
    assert all(s == everyone[0] for s in everyone)
    expected = batch_count(n, du.total_workers(backend), batch, drop_last)  # from (N, P, batch, drop_last)
    assert len(sizes) == c.num_batches(batch, drop_last=drop_last) == expected
    counts = du.allgather(backend, np.array(len(sizes)))  # the array collective agrees too
    assert (np.asarray(counts) == len(sizes)).all()


@given(n=st.integers(2, 90), batch=st.integers(1, 16), seed=st.integers(0, 99), epoch=st.integers(0, 3))
def test_shuffled_epochs_are_identical_on_every_rank_and_cover_the_data(backend, n, batch, seed, epoch):
    world, rank = du.total_workers(backend), du.local_rank(backend)
    c = du.DistributedDataContainer(backend, np.arange(n))
    mine = [v for b in c.batches(batch, shuffle=True, seed=seed, epoch=epoch) for v in as_list(b)]
    assert mine == epoch_indices(n, world, rank, batch, shuffle=True, seed=seed, epoch=epoch).tolist()
    c.set_epoch(epoch)
    assert [v for b in c.batches(batch, shuffle=True, seed=seed) for v in as_list(b)] == mine
    everyone = du.allgather(backend, mine)
    assert set(v for share in everyone for v in share) == set(range(n))
    # every rank computes the same global order: rank r's batches are r's slice of it
    expected = [
        epoch_indices(n, world, r, batch, shuffle=True, seed=seed, epoch=epoch).tolist() for r in range(world)
    ]
    assert everyone == expected
    if n >= 8:
        other = [v for b in c.batches(batch, shuffle=True, seed=seed, epoch=epoch + 1) for v in as_list(b)]
        assert du.allgather(backend, other) != everyone


@given(n=st.integers(1, 90), batch=st.integers(1, 12), drop_last=st.booleans(), data=st.data())
def test_resuming_mid_epoch_yields_exactly_the_remaining_batches(backend, n, batch, drop_last, data):
    c = du.DistributedDataContainer(backend, np.arange(n))
    full = [as_list(b) for b in c.batches(batch, shuffle=True, seed=7, epoch=2, drop_last=drop_last)]
    start = data.draw(st.integers(0, len(full)))
    resumed = [
        as_list(b) for b in c.batches(batch, shuffle=True, seed=7, epoch=2, drop_last=drop_last, start=start)
    ]
    assert resumed == full[start:]


# ---- kinds of data and what a batch looks like ----


def test_batches_of_each_kind_of_data(backend):
    n, rank = 23, du.local_rank(backend)
    c = du.DistributedDataContainer(backend, (np.ones((n, 3), np.float32), np.arange(n)))
    x, y = next(iter(c.batches(4)))
    assert isinstance(x, mx.array) and x.shape == (4, 3) and x.dtype == mx.float32
    assert as_list(y) == list(c.indices)[:4]

    rows = [{"x": np.full(2, i), "label": f"item {i}"} for i in range(n)]
    b = next(iter(du.DistributedDataContainer(backend, rows).batches(3)))
    assert (
        b["x"].shape == (3, 2)
        and b["label"][0] == f"item {shard_bounds(n, du.total_workers(backend), rank)[0]}"
    )

    pairs = [(i, float(i) / 2) for i in range(n)]
    i, half = next(iter(du.DistributedDataContainer(backend, pairs).batches(5)))
    assert as_list(half) == [v / 2 for v in as_list(i)]

    xs = mx.arange(n * 2).reshape(n, 2)
    b = next(iter(du.DistributedDataContainer(backend, {"x": xs}).batches(2, shuffle=True)))
    assert b["x"].shape == (2, 2) and (b["x"][:, 1] - b["x"][:, 0] == 1).all().item()


def test_sequences_are_read_lazily(backend):
    class Spy(collections.abc.Sequence):
        def __init__(self, n):
            self.n, self.read = n, []

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            self.read.append(i)
            return i

    data = Spy(10_000)
    c = du.DistributedDataContainer(backend, data)
    assert data.read == []
    next(iter(c.batches(8)))
    assert data.read == list(c.indices[:8])
    data.read.clear()
    next(iter(c.batches(8, shuffle=True, seed=5)))
    world, rank = du.total_workers(backend), du.local_rank(backend)
    assert data.read == epoch_indices(data.n, world, rank, 8, shuffle=True, seed=5)[:8].tolist()


def test_hugging_face_dataset_is_sharded_without_loading_it(backend, monkeypatch):
    datasets = pytest.importorskip("datasets")
    n, batch = 100_000, 256
    ds = datasets.Dataset.from_dict({"x": np.arange(n), "y": np.arange(n) % 7})
    keys = []
    real = datasets.Dataset.__getitem__

    def spy(self, key):
        keys.append(key)
        return real(self, key)

    monkeypatch.setattr(datasets.Dataset, "__getitem__", spy)
    c = du.DistributedDataContainer(backend, ds)
    assert len(c) == len(c.indices) and keys == []  # sharding reads nothing
    world, rank = du.total_workers(backend), du.local_rank(backend)
    expected = epoch_indices(n, world, rank, batch, shuffle=True, seed=3, epoch=1)
    for step, b in zip(range(3), c.batches(batch, shuffle=True, seed=3, epoch=1)):
        assert as_list(b["x"]) == expected[step * batch : (step + 1) * batch].tolist()
        assert as_list(b["y"]) == [v % 7 for v in as_list(b["x"])]
    assert len(keys) == 3  # one ds[list_of_indices] per batch, only the rows it needs
    assert all(isinstance(k, list) and len(k) == batch for k in keys)
    assert c[0] == {"x": c.indices[0], "y": c.indices[0] % 7} and keys[-1] == c.indices[0]


# ---- errors ----


def test_errors_name_what_is_wrong_and_the_rank(backend):
    rank = f"rank {du.local_rank(backend)}"
    with pytest.raises(ValueError, match=f"{rank}.*empty"):
        du.DistributedDataContainer(backend, [])
    with pytest.raises(ValueError, match=f"{rank}.*empty"):
        du.DistributedDataContainer(backend, np.zeros((0, 3)))
    with pytest.raises(ValueError, match=f"{rank}.*field 1 has 9 items but field 0 has 10"):
        du.DistributedDataContainer(backend, (np.zeros(10), np.zeros(9)))
    with pytest.raises(ValueError, match=f"{rank}.*field 'y' has 4 items but field 'x' has 5"):
        du.DistributedDataContainer(backend, {"x": list(range(5)), "y": mx.zeros(4)})
    with pytest.raises(TypeError, match=f"{rank}.*field 'y' is a int"):
        du.DistributedDataContainer(backend, {"x": [1], "y": 3})
    for bad in ({1, 2, 3}, 42, np.array(5.0), iter(range(3))):
        with pytest.raises(TypeError, match=rank):
            du.DistributedDataContainer(backend, bad)
    c = du.DistributedDataContainer(backend, list(range(5 * du.total_workers(backend))))
    for size, error in ((0, ValueError), (-3, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match=f"{rank}.*batch_size"):
            c.batches(size)
    with pytest.raises(ValueError, match=f"{rank}.*start=99"):
        c.batches(2, start=99)
    with pytest.raises(IndexError, match=rank):
        c[len(c)]
    with pytest.raises(
        TypeError, match=f"{rank}: cannot index a generator; pass a sequence \\(an iterator: list"
    ):
        du.DistributedDataContainer(backend, (i for i in range(3)))


def test_data_of_different_lengths_on_different_ranks_fails_on_every_rank(backend):
    """Each rank loading its own (different) data would deadlock later; it fails up front."""
    rank, size = du.local_rank(backend), du.total_workers(backend)
    if size == 1:
        assert len(du.DistributedDataContainer(backend, list(range(7)))) == 7
        return
    with pytest.raises(
        ValueError,
        match=r"every rank needs the same data \(the whole data set\), of length; "
        r"ranks \[1(, 2)?(, 3)?\] differ from rank 0 \(rank 0: 10, rank 1: 11",
    ):
        du.DistributedDataContainer(backend, list(range(10 + rank)))


def test_state_dict_resumes_exactly_where_the_batches_stopped(backend):
    data = du.DistributedDataContainer(backend, np.arange(50))
    everything = [b.tolist() for b in data.batches(4, shuffle=True, seed=3, epoch=2)]
    assert data.state_dict()["epoch"] == 3 and data.state_dict()["batches"] == 0  # read to its end
    first = data.batches(4, shuffle=True, seed=3, epoch=2)
    seen = [next(first).tolist() for _ in range(3)]
    state = data.state_dict()
    size = du.total_workers(backend)
    assert state == {
        "epoch": 2,
        "batches": 3,
        "world_size": size,
        "batch_size": 4,
        "drop_last": False,
        "before": [],
    }
    resumed = du.DistributedDataContainer(backend, np.arange(50))
    resumed.load_state_dict(state)
    assert resumed.epoch == 2 and resumed.state_dict() == state  # saved again before resuming: the same
    rest = [b.tolist() for b in resumed.batches(4, shuffle=True, seed=3, epoch=resumed.epoch)]
    assert seen + rest == everything
    assert [b.tolist() for b in resumed.batches(4, shuffle=True, seed=3, epoch=2)] == everything  # once only


def test_resuming_mid_epoch_at_another_world_size_visits_the_rest_once(backend):
    """A position saved by a job of size + 1 ranks (simulated: the items it visited are the
    first batches of epoch_indices at that size) resumes here: this job visits exactly the
    items that job had not, with a warning on rank 0 that names the new global batch."""
    rank, size = du.local_rank(backend), du.total_workers(backend)
    saved = {"epoch": 1, "batches": 2, "world_size": size + 1, "batch_size": 3, "before": []}
    visited = {
        i
        for r in range(size + 1)
        for i in epoch_indices(50, size + 1, r, 3, shuffle=True, seed=5, epoch=1)[:6]
    }
    data = du.DistributedDataContainer(backend, np.arange(50))
    data.load_state_dict(saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = [i for b in data.batches(4, shuffle=True, seed=5, epoch=data.epoch) for i in b.tolist()]
    if rank == 0:
        assert f"global batch {3 * (size + 1)}" in str(caught[0].message)
        assert f"global batch {4 * size}" in str(caught[0].message)
    else:
        assert not caught
    everyone = du.allgather(backend, mine)
    rest = [i for items in everyone for i in items]
    assert not set(rest) & visited
    assert set(rest) | visited == set(range(50))
    assert len(rest) - (50 - len(visited)) < size  # only the padding repeats
    assert data.state_dict()["epoch"] == 2 and data.state_dict()["before"] == []


def test_a_resharded_epoch_saved_again_keeps_what_every_part_visited(backend):
    """Saved mid-way through a resharded epoch, the position lists both parts."""
    size = du.total_workers(backend)
    data = du.DistributedDataContainer(backend, np.arange(40))
    data.load_state_dict({"epoch": 0, "batches": 1, "world_size": size + 2, "batch_size": 2, "before": []})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        next(data.batches(3))
    assert data.state_dict() == {
        "epoch": 0,
        "batches": 1,
        "world_size": size,
        "batch_size": 3,
        "drop_last": False,
        "before": [[size + 2, 2, 1, False]],
    }


def test_an_old_position_without_a_batch_size_at_another_world_size_is_a_clear_error(backend):
    data = du.DistributedDataContainer(backend, np.arange(50))
    with pytest.raises(ValueError, match="without its batch size"):
        data.load_state_dict({"epoch": 1, "batches": 2, "world_size": du.total_workers(backend) + 1})
    data.load_state_dict(
        {"epoch": 4, "batches": 0, "world_size": du.total_workers(backend) + 1}
    )  # a boundary
    assert data.epoch == 4


# ---- sequences: collate, length-grouped batches, evaluation exactly once ----


def sequences(n=61, seed=0):
    """Token sequences of lengths 1..40 (a list of lists, ragged)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 100, rng.integers(1, 41)).tolist() for _ in range(n)]


def pad(items):
    """A collate function: right-padded token batch and the lengths."""
    width = max(len(t) for t in items)
    return mx.array([t + [0] * (width - len(t)) for t in items]), mx.array([len(t) for t in items])


def padding_fraction(batches):
    tokens, lengths = zip(*batches)
    return 1 - sum(int(l.sum()) for l in lengths) / sum(t.size for t in tokens)


def test_collate_makes_the_batches(backend):
    data = du.DistributedDataContainer(backend, sequences(), collate=pad)
    for tokens, lengths in data.batches(5, shuffle=True, seed=1):
        assert tokens.ndim == 2 and tokens.shape[1] == int(lengths.max())


@pytest.mark.parametrize("lengths", ["array", "function"])
def test_length_grouped_batches_pad_less_and_visit_the_same_items(backend, lengths):
    seqs = sequences(400)
    given_lengths = np.array([len(s) for s in seqs]) if lengths == "array" else len
    plain = du.DistributedDataContainer(backend, seqs, collate=pad)
    grouped = du.DistributedDataContainer(backend, seqs, collate=pad, lengths=given_lengths)
    for epoch in (0, 1):
        a = list(plain.batches(8, shuffle=True, seed=2, epoch=epoch))
        b = list(grouped.batches(8, shuffle=True, seed=2, epoch=epoch))
        assert len(a) == len(b) == plain.num_batches(8)
        assert sorted(as_list(mx.concatenate([l for _, l in a]))) == sorted(
            as_list(mx.concatenate([l for _, l in b]))
        )
        assert padding_fraction(b) < padding_fraction(a) / 3
        again = list(grouped.batches(8, shuffle=True, seed=2, epoch=epoch))  # deterministic
        assert all(mx.array_equal(x[0], y[0]).item() for x, y in zip(b, again))


@given(n=st.integers(1, 80), batch=st.integers(1, 9), shuffle=st.booleans())
def test_exactly_once_visits_every_item_once_with_equal_steps(backend, n, batch, shuffle):
    data = du.DistributedDataContainer(backend, np.arange(n))
    mine = list(data.batches(batch, shuffle=shuffle, seed=4, exactly_once=True))
    steps = du.allgather(backend, np.array([len(mine)]))
    assert (steps == steps[0]).all()  # the same steps everywhere
    assert all(x.shape == (batch,) and m.shape == (batch,) for x, m in mine)  # full batches: one shape
    real = [int(i) for x, m in mine for i, keep in zip(as_list(x), as_list(m)) if keep == 1]
    everyone = [i for items in du.allgather(backend, real) for i in items]
    assert sorted(everyone) == list(range(n))  # each item exactly once


def test_exactly_once_refuses_what_would_skip_or_repeat_items(backend):
    data = du.DistributedDataContainer(backend, np.arange(10))
    with pytest.raises(ValueError, match="drop_last skips items"):
        data.batches(3, exactly_once=True, drop_last=True)


# ---- batch shares: unequal batches for unequal hosts ----


@given(
    n=st.integers(1, 150),
    batch=st.integers(1, 8),
    shares=st.lists(st.floats(0.05, 5), min_size=1, max_size=5),
    shuffle=st.booleans(),
    seed=st.integers(0, 9),
    drop_last=st.booleans(),
    fraction=st.floats(0, 1),
    world_after=st.integers(1, 5),
)
def test_batch_shares_give_equal_steps_and_visit_the_items_as_equal_batches_do(
    n, batch, shares, shuffle, seed, drop_last, fraction, world_after
):
    world = len(shares)
    sizes = share_sizes(batch, shares)
    assert sum(sizes) == world * batch
    assert all(abs(k - world * batch * s / sum(shares)) < 1 for k, s in zip(sizes, shares))
    if min(sizes) == 0:
        return  # refused by batches() (tested below)
    orders = [
        epoch_indices(n, world, r, sizes, shuffle=shuffle, seed=seed, drop_last=drop_last)
        for r in range(world)
    ]
    steps = batch_count(n, world, sizes, drop_last)
    assert [len(order) for order in orders] == [steps * k for k in sizes]  # full batches, equal steps
    every = np.concatenate(orders).tolist()
    if drop_last:
        assert len(set(every)) == len(every) and n - len(every) < sum(sizes)
    else:
        assert set(every) == set(range(n)) and len(every) - n < sum(sizes)
    once = [exactly_once_indices(n, world, r, sizes, shuffle=shuffle, seed=seed) for r in range(world)]
    assert sorted(i for order, real in once for i in order[real].tolist()) == list(range(n))
    assert [len(order) for order, _ in once] == [batch_count(n, world, sizes, False) * k for k in sizes]
    # stopped part way, resumed with equal batches at another world size: the rest, once
    done = int(fraction * steps)
    visited = {i for r, order in enumerate(orders) for i in order[: done * sizes[r]].tolist()}
    rest = [
        epoch_indices(n, world_after, r, batch, shuffle=shuffle, seed=seed, done=[(world, sizes, done)])
        for r in range(world_after)
    ]
    rest = np.concatenate(rest).tolist()
    assert not set(rest) & visited and visited | set(rest) == set(range(n))


def test_weighted_updates_with_batch_shares_equal_one_process_on_the_union(backend):
    """Rank r takes r + 1 shares of each step; weighting its gradient by its batch makes the
    step that of one process on the step's items of every rank."""
    n, rank = du.total_workers(backend), du.local_rank(backend)
    x, y = dataset(0, 37)
    data = du.DistributedDataContainer(backend, (x, y))
    model, opt = mlp(), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    lg = nn.value_and_grad(model, loss_fn)
    for bx, by in data.batches(3, share=rank + 1, shuffle=True, seed=1):
        _, grads = lg(model, bx, by)
        opt.update(model, grads, weight=len(bx))
        mx.eval(model.parameters(), opt.state)
    sizes = share_sizes(3, [r + 1 for r in range(n)])
    orders = [epoch_indices(37, n, r, sizes, shuffle=True, seed=1) for r in range(n)]
    reference, ref_opt = mlp(), optim.Adam(1e-2)
    for step in range(batch_count(37, n, sizes, False)):
        rows = np.concatenate([orders[r][step * sizes[r] : (step + 1) * sizes[r]] for r in range(n)])
        _, grads = nn.value_and_grad(reference, loss_fn)(reference, x[mx.array(rows)], y[mx.array(rows)])
        ref_opt.update(reference, grads)
        mx.eval(reference.parameters(), ref_opt.state)
    assert_same_parameters(model, reference)  # (the ranks' sums come in the transport's order)


def test_shares_resume_exactly_and_bad_shares_fail_on_every_rank(backend):
    n, rank = du.total_workers(backend), du.local_rank(backend)
    data = du.DistributedDataContainer(backend, np.arange(40))
    everything = [b.tolist() for b in data.batches(2, share=rank + 1)]
    first = data.batches(2, share=rank + 1)
    seen = [next(first).tolist() for _ in range(2)]
    assert data.state_dict()["batch_size"] == share_sizes(2, [r + 1 for r in range(n)])
    resumed = du.DistributedDataContainer(backend, np.arange(40))
    resumed.load_state_dict(data.state_dict())
    assert seen + [b.tolist() for b in resumed.batches(2, share=rank + 1)] == everything
    with pytest.raises(
        ValueError, match=r"share must be a positive number or 'auto'; ranks \[0\] passed another"
    ):
        next(data.batches(2, share=-1.0 if rank == 0 else 1.0))
    if n > 1:
        with pytest.raises(ValueError, match=r"give ranks \[1\] no item of the"):
            next(data.batches(1, share=1e-6 if rank == 1 else 1.0))
        with pytest.raises(
            ValueError, match=r"give ranks \[1.*\] no item of the"
        ):  # #26.11: no OverflowError
            next(data.batches(1, share=1e308 if rank == 0 else 1.0))


@pytest.mark.world(min_size=2)
def test_a_share_on_some_ranks_only_is_a_clear_error_on_every_rank(backend):
    """#26.6: share= on rank 0 and share=None elsewhere waited until the watchdog; now the
    argument check names it."""
    data = du.DistributedDataContainer(backend, np.arange(40))
    for share in (2.0, "auto"):
        with pytest.raises(ValueError, match=r"every rank needs the same share; ranks \[1"):
            next(data.batches(2, share=share if du.local_rank(backend) == 0 else None))


def slowed_epoch(backend, data, *, slow_rank, **kw):
    """One epoch of ``data.batches(share="auto", **kw)``, with ``slow_rank`` sleeping 0.1 s in each
    of the timed steps: its own work is then far slower than the others'."""
    out = []
    for batch in data.batches(share="auto", **kw):
        if du.local_rank(backend) == slow_rank and len(out) <= AUTO_SHARE_STEPS:
            time.sleep(0.1)  # (the slowness to measure, not a synchronization)
        out.append(batch)
    return out


def test_auto_shares_give_the_slow_rank_less_and_every_rank_the_same_steps(backend):
    n = du.total_workers(backend)
    data = du.DistributedDataContainer(backend, np.arange(400))
    batches = slowed_epoch(backend, data, slow_rank=0, batch_size=4)
    sizes = du.allgather(backend, [len(b) for b in batches])
    assert len({len(s) for s in sizes}) == 1  # the same steps everywhere
    k = AUTO_SHARE_STEPS + 1  # the warm-up step and the steps measured: equal batches
    assert all(s[:k] == [4] * k for s in sizes)
    # then shares: 4 x N a step in all, the slow rank's the smallest (others may be slow too:
    # more ranks than cores), smaller than the fastest's
    after = [s[k] for s in sizes]
    assert sum(after) == 4 * n and (n == 1 or after[0] == min(after) < max(after)), after


@pytest.mark.parametrize("lengths", [None, "lengths"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_exactly_once_with_auto_shares_visits_every_item_once(backend, shuffle, lengths):
    """#26.5: the re-split after the measurement kept the masks off and repeated items (104 of 101);
    #38: with lengths= too (the re-split replayed the unsorted order)."""
    table = None if lengths is None else np.random.default_rng(0).integers(1, 50, 101)
    data = du.DistributedDataContainer(backend, np.arange(101), lengths=table)
    batches = slowed_epoch(
        backend, data, slow_rank=0, batch_size=4, exactly_once=True, shuffle=shuffle, seed=3
    )
    seen = [int(i) for batch, mask in batches for i, m in zip(batch.tolist(), mask.tolist()) if m]
    everyone = sorted(i for s in du.allgather(backend, seen) for i in s)
    assert everyone == list(range(101))
    assert len({n for n in du.allgather(backend, len(batches))}) == 1


def test_auto_shares_with_lengths_visit_every_item_before_any_twice(backend):
    """#38: 2 ring ranks, 256 items, rank 1 slowed, share="auto", lengths=: 31 items never visited and
    31 twice (the re-split replayed the part before it in the order before the length sort)."""
    table = np.random.default_rng(1).integers(1, 50, 256)
    data = du.DistributedDataContainer(backend, np.arange(256), lengths=table)
    batches = slowed_epoch(backend, data, slow_rank=backend.size - 1, batch_size=4, shuffle=True)
    seen = [i for s in du.allgather(backend, [int(i) for b in batches for i in b.tolist()]) for i in s]
    assert set(seen) == set(range(256)) and len(seen) - 256 < 4 * backend.size, len(seen)  # (repeats: the
    # last global batch's filler)
