"""Holes an adversarial test found (../shared/repro/), closed: each test here failed before its
fix. Every rank runs them; a fault must give the same clear error on every rank, or the
right value, never garbage or a hang."""

import json
import pickle
import struct

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from test_optimizer import dataset, loss_fn, mlp

import distributed_utils as du
from distributed_utils.tree import TreeMismatchError

MULTI_RANK = pytest.mark.world(min_size=2)


def raised_everywhere(backend, call, error, words):
    """Run ``call`` on every rank; every rank must raise ``error`` with ``words`` in it."""
    try:
        call()
        got = None
    except Exception as e:  # noqa: BLE001 (what is raised is what is tested)
        got = e
    outcomes = du.allgather(backend, (isinstance(got, error) and words in str(got), repr(got)))
    assert all(ok for ok, _ in outcomes), outcomes


@MULTI_RANK
def test_a_gradient_tree_that_changes_on_one_rank_later_raises_on_every_rank(backend):  # d7
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1))
    model = nn.Linear(4, 2)
    du.synchronize(backend, model)
    grads = {"weight": mx.ones((2, 4)), "bias": mx.ones(2)}
    opt.update(model, grads)  # the first step: every rank alike
    changed = {"weight": mx.ones((2, 4 + (backend.rank == 1))), "bias": mx.ones(2)}
    raised_everywhere(
        backend, lambda: opt.reduce_gradients(changed), TreeMismatchError, "first difference at key 'weight'"
    )


def test_numpy_arrays_with_negative_strides(backend):  # d8
    rank, size = du.local_rank(backend), du.total_workers(backend)
    x = np.arange(4, dtype=np.float32)[::-1] + rank
    np.testing.assert_array_equal(
        du.allreduce(backend, x, "sum"), sum(np.arange(4)[::-1] + r for r in range(size))
    )
    np.testing.assert_array_equal(du.bcast(backend, x), np.arange(4, dtype=np.float32)[::-1])
    np.testing.assert_array_equal(
        du.synchronize(backend, {"x": x})["x"], np.arange(4, dtype=np.float32)[::-1]
    )


def _rebuild_on_root_only():
    if du.local_rank(du.initialize()) != 0:
        raise RuntimeError("cannot unpickle on this rank")
    return "rebuilt"


class OnlyRootUnpickles:
    def __reduce__(self):
        return (_rebuild_on_root_only, ())


@MULTI_RANK
def test_an_object_other_ranks_cannot_unpickle_raises_on_every_rank(backend):  # d9
    payload = OnlyRootUnpickles() if backend.rank == 0 else None
    raised_everywhere(backend, lambda: du.bcast(backend, payload), TypeError, "cannot unpickle it")
    raised_everywhere(
        backend,
        lambda: du.synchronize(backend, {"x": payload, "w": mx.ones(2)}),
        TypeError,
        "cannot unpickle it",
    )


@MULTI_RANK
def test_an_object_one_rank_cannot_pickle_raises_on_every_rank(backend):  # it was None in the others' lists
    last = backend.size - 1
    mine = (lambda: 1) if backend.rank == last else "ok"
    raised_everywhere(
        backend,
        lambda: du.allgather(backend, mine),
        TypeError,
        f"the objects ranks gather: rank {last} cannot pickle it",
    )
    raised_everywhere(
        backend,
        lambda: du.bcast(backend, mine, root=last),
        TypeError,
        f"the object rank {last} broadcasts: rank {last} cannot pickle it",
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_max_and_min_give_nan_wherever_any_rank_has_nan(backend, dtype):  # d10
    size = du.total_workers(backend)
    for holder in range(size):
        x = mx.array([1.0 + backend.rank, -2.0, 3.0], dtype)
        if backend.rank == holder:
            x = mx.array([np.nan, -2.0, 3.0 - backend.rank], dtype)
        for op, best in (("max", max), ("min", min)):
            got = du.allreduce(backend, x, op)
            assert got.dtype == dtype and np.isnan(np.array(got.astype(mx.float32))[0]), (op, holder, got)
            assert got[1].item() == -2.0
    assert np.isnan(du.allreduce(backend, float("nan") if backend.rank == size - 1 else 1.0, max))


def test_a_failed_save_leaves_no_temporary_file_and_raises_everywhere(backend, tmp_path):  # d5
    folder = du.bcast(backend, str(tmp_path))  # rank 0's
    target = f"{folder}/is-a-directory"
    if backend.rank == 0:
        (tmp_path / "is-a-directory").mkdir()
    raised_everywhere(
        backend,
        lambda: du.save_checkpoint(backend, target, model=nn.Linear(2, 2)),
        du.CheckpointError,
        "rank 0 could not write",
    )
    if backend.rank == 0:
        assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _rewrite_header(path, edit):
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    edit(header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    open(path, "wb").write(struct.pack("<Q", len(head)) + head + blob[8 + n :])


def _meta(change):
    """An edit of the checkpoint's own metadata (its JSON), by ``change(meta)``."""

    def edit(header):
        meta = json.loads(header["__metadata__"]["distributed_utils"])
        change(meta)
        header["__metadata__"]["distributed_utils"] = json.dumps(meta)

    return edit


def _entry(name, change):
    """An edit of one of the metadata's JSON entries (keys, float64, crc32), by ``change(value)``."""

    def edit(header):
        value = json.loads(header["__metadata__"][name])
        header["__metadata__"][name] = json.dumps(change(value))

    return edit


DAMAGED = "is damaged: its metadata or header do not match their checksum"
CORRUPT = [
    (
        "an unknown dtype",
        lambda h: h["model.weight"].__setitem__("dtype", "X9"),
        "ck is incomplete or corrupt: [safetensor] unsupported dtype X9",
    ),
    (
        "offsets shorter than the shape",
        lambda h: h["model.bias"].__setitem__("data_offsets", [0, 4]),
        "ck is incomplete or corrupt: [load_safetensors] Tensor 'model.bias' invalid data offsets",
    ),
    # Everything a load trusts is covered by a checksum (#26.1): a bit flipped anywhere is damage.
    ("the step 5 -> 7", _meta(lambda m: m.update(step=7)), DAMAGED),
    ("the data position", _meta(lambda m: m.update(data={"epoch": 0, "batch": 1})), DAMAGED),
    ("extra", _meta(lambda m: m.update(extra={"loss": 0.5})), DAMAGED),
    ("the world size", _meta(lambda m: m.update(world_size=m["world_size"] + 1)), DAMAGED),
    ("metadata missing", _meta(lambda m: m.pop("world_size")), DAMAGED),
    ("the key order", _entry("keys", lambda keys: keys[::-1]), DAMAGED),
    ("the float64 list", _entry("float64", lambda keys: keys + ["model.bias"]), DAMAGED),
    ("the checksum map", _entry("crc32", lambda crcs: {**crcs, "rng": [crcs["rng"][0] ^ 1]}), DAMAGED),
    ("an array's shape", lambda h: h["optimizer.weight.m"].__setitem__("shape", [16, 64]), DAMAGED),
    ("an array's name", lambda h: h.__setitem__("model.bias2", h.pop("model.bias")), DAMAGED),
]


@pytest.mark.parametrize("what, edit, words", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_checkpoint_headers_are_checkpoint_errors_on_every_rank(
    backend, tmp_path, what, edit, words
):  # d12
    path = du.bcast(backend, str(tmp_path / "ck"))
    model = nn.Linear(16, 64)
    opt = du.DistributedOptimizer(backend, optim.Adam(1e-3))
    opt.init(model.trainable_parameters())
    du.save_checkpoint(backend, path, model=model, optimizer=opt, step=5, data={"epoch": 0, "batch": 3})
    if backend.rank == 0:
        _rewrite_header(path, edit)
    raised_everywhere(
        backend,
        lambda: du.load_checkpoint(backend, path, model=model, optimizer=opt),
        du.CheckpointError,
        words,
    )


@MULTI_RANK
def test_a_forgotten_synchronize_raises_at_the_first_update_on_every_rank(backend):  # #11
    mx.random.seed(backend.rank)  # each rank its own initial weights
    model = nn.Linear(3, 2)
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1))
    grads = {"weight": mx.ones((2, 3)), "bias": mx.ones(2)}
    raised_everywhere(
        backend, lambda: opt.update(model, grads), ValueError, "call du.synchronize(backend, model)"
    )
    du.synchronize(backend, model)
    opt.update(model, grads)  # now it goes on


@MULTI_RANK
def test_batches_with_a_different_batch_size_on_one_rank_raise_on_every_rank(backend):  # #11
    data = du.DistributedDataContainer(backend, np.arange(40))
    batch = 4 + (backend.rank == 1)
    raised_everywhere(
        backend,
        lambda: data.batches(batch),
        ValueError,
        "batches(): every rank needs the same batch_size; ranks [1] differ from rank 0",
    )


@pytest.mark.world(backend=du.MLXBackend)
def test_debug_mode_inside_compile_when_ranks_trace_at_different_times(backend):  # #7
    step = mx.compile(lambda x: du.allreduce(backend, mx.ones(4) * mx.sum(x), "sum"))
    du.initialize(debug=True)
    try:
        for length in (3, 3 + backend.rank):  # the second call retraces on ranks > 0 only
            out = step(mx.ones(length))
            mx.eval(out)
    finally:
        du.initialize(debug=False)
    want = sum(3 + r for r in range(backend.size))
    assert out.tolist() == [want] * 4


def test_object_collectives_survive_pickling(backend):
    """The agreement step of object collectives leaves ordinary objects alone."""
    obj = {"rank": backend.rank, "bytes": pickle.dumps(1)}
    assert du.allgather(backend, obj) == [{"rank": r, "bytes": pickle.dumps(1)} for r in range(backend.size)]


@MULTI_RANK
def test_a_rank_one_collective_ahead_of_an_object_gather_is_named_not_a_huge_allocation(backend):
    """Rank 0 makes one collective more (an allgather of two int64s) while the others gather
    objects: they read its numbers as the sizes of its object (numpy then tried to allocate
    exbibytes); now they see that rank 0 announced no object and say so."""
    if backend.rank == 0:
        du.allgather(backend, np.array([2**60, 2**60]))  # the extra collective
        return
    with pytest.raises(
        du.CollectiveMismatchError, match=r"ranks \[0\] sent no object size: they are in another"
    ):
        du.allgather(backend, {"an": "object"})


@MULTI_RANK
def test_a_distributed_optimizer_with_other_settings_on_one_rank_fails_on_every_rank(backend):
    """#27: the settings are checked with the parameters (another accumulate_steps on one rank
    made it reduce at other calls, and the job hang)."""
    model = mlp()
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1), accumulate_steps=2 if backend.rank == 1 else 1)
    grads = nn.value_and_grad(model, loss_fn)(model, *dataset(0, 4))[1]
    with pytest.raises(ValueError, match=r"every rank needs the same accumulate_steps; ranks \[1\] differ"):
        opt.update(model, grads)


@MULTI_RANK
@pytest.mark.parametrize(
    "inner",
    [lambda r: optim.SGD(0.1 * (r + 1)), lambda r: optim.Adam(1e-3, betas=[0.9, 0.99 if r else 0.999])],
)
def test_a_wrapped_optimizer_with_another_learning_rate_or_setting_on_one_rank_fails_on_every_rank(
    backend, inner
):
    """#39: the wrapped optimizer was compared by its class alone: a rank with another learning rate (or
    beta) trained on, its parameters drifting from the others' with no error."""
    model = mlp()
    du.synchronize(backend, model)
    opt = du.DistributedOptimizer(backend, inner(backend.rank))
    grads = nn.value_and_grad(model, loss_fn)(model, *dataset(0, 4))[1]
    with pytest.raises(ValueError, match=r"every rank needs the same optimizer; ranks \[1"):
        opt.update(model, grads)
