"""DistributedOptimizer(shard_optimizer_state=True), alone and under the launcher: the same
trajectory as one process (and as the replicated optimizer), about 1/N of the state per rank,
and checkpoints that hold the whole state."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from test_optimizer import (
    OPTIMIZERS,
    assert_same_parameters,
    compiled_step,
    loss_fn,
    mlp,
    reference_and_mine,
    train,
    train_with_the_first_layer_frozen,
)

import distributed_utils as du
from distributed_utils.sharded import ELEMENTWISE, Layout

SHARDABLE = {name: make for name, make in OPTIMIZERS.items() if name != "multi"}


def sharded(backend, optimizer, **kwargs):
    return du.DistributedOptimizer(backend, optimizer, shard_optimizer_state=True, **kwargs)


def assert_same_state(a, b):
    a, b = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert a.keys() == b.keys()
    for key in a:
        assert mx.array_equal(a[key], b[key]).item(), key


@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from([mx.float32, mx.bfloat16]), min_size=6, max_size=6),
    world=st.integers(1, 7),
)
def test_the_shards_of_the_ranks_are_the_flat_vector_disjoint_and_complete(shapes, dtypes, world):
    leaves = [
        (f"p{i}", mx.arange(int(np.prod(s)), dtype=d).reshape(s) + 1000 * i)
        for i, (s, d) in enumerate(zip(shapes, dtypes))
    ]
    arrays = dict(leaves)
    layouts = [Layout(leaves, world, r) for r in range(world)]
    assert layouts[0].fits(leaves) and not layouts[0].fits(leaves[:-1] + [(leaves[-1][0], mx.zeros((9, 9)))])
    for name in layouts[0].groups:
        shards = [layout.shard(layout.my_slices(arrays), name) for layout in layouts]
        assert all(s.shape == (layouts[0].shard_size[name],) for s in shards)
        flat = layouts[0].flatten(arrays, name)
        assert mx.array_equal(mx.concatenate(shards), flat).item()
        for layout, shard in zip(layouts, shards):
            slices = layout.my_slices(arrays)
            for key, piece in layout.slices_of(shard, name).items():
                assert mx.array_equal(piece, slices[key]).item()
        for key, a in layouts[0].unflatten(flat, name).items():
            assert a.shape == arrays[key].shape and mx.array_equal(a, arrays[key]).item()


@pytest.mark.parametrize("name", SHARDABLE)
def test_sharded_state_trains_like_one_process(backend, name):
    full, mine = reference_and_mine(backend, batch=3, steps=4)
    expected = train(mlp(), OPTIMIZERS[name](), full)
    opt = sharded(backend, OPTIMIZERS[name]())
    got = train(mlp(), opt, mine)
    assert_same_parameters(got, expected)
    assert opt.step.item() == 4


@pytest.mark.parametrize(
    "cls", sorted(ELEMENTWISE + (optim.AdamW,), key=lambda c: c.__name__), ids=lambda c: c.__name__
)
def test_every_elementwise_optimizer_matches_the_replicated_one_bit_for_bit(backend, cls):
    _, mine = reference_and_mine(backend, batch=2, steps=3)
    replicated = du.DistributedOptimizer(backend, cls(learning_rate=1e-2))
    expected = train(mlp(), replicated, mine)
    opt = sharded(backend, cls(learning_rate=1e-2))
    got = train(mlp(), opt, mine)
    for (key, a), (_, b) in zip(tree_flatten(expected.parameters()), tree_flatten(got.parameters())):
        assert mx.array_equal(a, b).item(), key
    assert_same_state(replicated.state, opt.whole_state())


def test_each_rank_holds_its_part_of_the_state(backend):
    """The state of this rank's pieces, keyed by parameter: 1/N of the elements (rounded up)."""
    n, rank = du.total_workers(backend), du.local_rank(backend)
    model, opt = mlp(), sharded(backend, optim.Adam(1e-2))
    train(model, opt, reference_and_mine(backend, batch=2, steps=1)[1])
    total = sum(p.size for _, p in tree_flatten(model.trainable_parameters()))
    keys = {k for k, _ in tree_flatten(model.trainable_parameters())}
    pieces = {k: v for k, v in opt.state.items() if k not in ("step", "learning_rate")}
    assert set(pieces) <= keys and all(set(v) == {"m", "v"} for v in pieces.values())
    held = sum(v["m"].size for v in pieces.values())
    chunk = -(-total // n)
    assert held == max(0, min(total, (rank + 1) * chunk) - rank * chunk)
    assert du.allreduce(backend, held, "sum") == total


def assert_bit_identical(a, b):
    for (key, pa), (_, pb) in zip(tree_flatten(a.parameters()), tree_flatten(b.parameters())):
        assert mx.array_equal(pa, pb).item(), key


@pytest.mark.parametrize("k", [2, 3])
def test_sharded_accumulation_trains_like_one_process(backend, k):
    """Like one process (to float tolerance), and bit for bit like the replicated optimizer."""
    full, mine = reference_and_mine(backend, batch=2, steps=3, k=k)
    expected = train(mlp(), OPTIMIZERS["adamw-schedule"](), full)
    opt = sharded(backend, OPTIMIZERS["adamw-schedule"](), accumulate_steps=k)
    got = train(mlp(), opt, mine)
    assert_same_parameters(got, expected)
    assert opt.step.item() == 3
    replicated = du.DistributedOptimizer(backend, OPTIMIZERS["adamw-schedule"](), accumulate_steps=k)
    assert_bit_identical(got, train(mlp(), replicated, mine))


def test_sharded_sum_and_compression(backend):
    n = du.total_workers(backend)
    full, mine = reference_and_mine(backend, batch=2, steps=3)
    expected = train(mlp(), optim.SGD(0.1 / n), full)  # a sum of N means at lr/N: the mean at lr
    for options, tolerance in (
        ({"op": "sum"}, {}),
        ({"compression": mx.bfloat16}, dict(rtol=2e-2, atol=2e-3)),
    ):
        lr = 0.1 / n / n if "op" in options else 0.1 / n
        got = train(mlp(), sharded(backend, optim.SGD(lr), **options), mine)
        assert_same_parameters(got, expected, **tolerance)
        assert_bit_identical(
            got, train(mlp(), du.DistributedOptimizer(backend, optim.SGD(lr), **options), mine)
        )


def test_frozen_parameters_are_neither_updated_nor_in_the_state(backend):
    opt = sharded(backend, optim.Adam(1e-2))
    got, expected, frozen = train_with_the_first_layer_frozen(backend, opt)
    assert_same_parameters(got, expected)
    assert np.array_equal(np.array(got.layers[0].weight), frozen)
    assert set(opt.whole_state()["layers"][0]) == set() and set(opt.whole_state()["layers"][2]) == {
        "weight",
        "bias",
    }


def test_a_compiled_step_with_the_sharded_update_inside(backend):
    full, mine = reference_and_mine(backend, batch=3, steps=4)
    expected = train(mlp(), OPTIMIZERS["adamw-schedule"](), full)
    model, opt = mlp(), sharded(backend, OPTIMIZERS["adamw-schedule"]())
    opt.init(model.trainable_parameters())  # the state exists before it is captured
    step = compiled_step(model, opt)
    for x, y in mine:
        mx.eval(step(x, y), model.parameters(), opt.state)
    assert_same_parameters(model, expected)
    assert opt.step.item() == 4
    replicated, rule = mlp(), du.DistributedOptimizer(backend, OPTIMIZERS["adamw-schedule"]())
    rule.init(replicated.trainable_parameters())
    step = compiled_step(replicated, rule)
    for x, y in mine:
        mx.eval(step(x, y), replicated.parameters(), rule.state)
    assert_bit_identical(model, replicated)


def test_a_checkpoint_of_a_sharded_state_loads_replicated_or_sharded_and_resumes(backend, tmp_path):
    path = du.bcast(backend, str(tmp_path / "ck"))  # rank 0's directory
    _, mine = reference_and_mine(backend, batch=2, steps=4)
    whole_run = train(mlp(), sharded(backend, optim.AdamW(1e-2)), mine)
    model, opt = mlp(), sharded(backend, optim.AdamW(1e-2))
    train(model, opt, mine[:2])
    du.save_checkpoint(backend, path, model=model, optimizer=opt, step=2)
    replicated = du.DistributedOptimizer(backend, optim.AdamW(1e-2))
    du.load_checkpoint(backend, path, optimizer=replicated)
    assert_same_state(opt.whole_state(), replicated.state)
    resumed, again = mlp(), sharded(backend, optim.AdamW(1e-2))
    assert du.load_checkpoint(backend, path, model=resumed, optimizer=again)["step"] == 2
    train(resumed, again, mine[2:])
    for (key, a), (_, b) in zip(tree_flatten(whole_run.parameters()), tree_flatten(resumed.parameters())):
        assert mx.array_equal(a, b).item(), key


def test_synchronize_keeps_each_ranks_part_and_gives_roots_learning_rate(backend):
    model, opt = mlp(), sharded(backend, optim.Adam(1e-2))
    train(model, opt, reference_and_mine(backend, batch=2, steps=1)[1])
    mine = {k: np.array(v["m"]) for k, v in opt.state.items() if isinstance(v, dict)}
    opt.learning_rate = 0.1 * (du.local_rank(backend) + 1)
    du.synchronize(backend, opt)
    assert opt.learning_rate.item() == pytest.approx(0.1)
    assert all(np.array_equal(np.array(opt.state[k]["m"]), m) for k, m in mine.items())


@pytest.mark.parametrize(
    "optimizer, words",
    [
        (lambda: optim.Adafactor(), "factors each matrix's second moment"),
        (OPTIMIZERS["multi"], "picks an optimizer for each parameter by its name"),
    ],
)
def test_optimizers_that_are_not_elementwise_are_refused_with_the_reason(backend, optimizer, words):
    with pytest.raises(ValueError, match=words):
        sharded(backend, optimizer())


def test_a_gradient_tree_that_changes_after_sharding_is_a_clear_error(backend):
    model, opt = mlp(), sharded(backend, optim.SGD(0.1))
    train(model, opt, reference_and_mine(backend, batch=2, steps=1)[1])
    model.layers[0].freeze()
    grads = nn.value_and_grad(model, loss_fn)(model, *reference_and_mine(backend, batch=2, steps=1)[1][0])[1]
    with pytest.raises(ValueError, match="the gradient tree changed"):
        opt.update(model, grads)


@pytest.mark.parametrize("compression", [None, mx.bfloat16], ids=str)
def test_the_reduce_scatter_path_of_nccl_and_jaccl_trains_like_one_process(backend, compression, monkeypatch):
    """NCCL and JACCL reduce-scatter natively (not testable here); the same path, with the
    reduce-scatter built from an all-reduce, must train like one process."""
    monkeypatch.setattr(backend, "native_reduce_scatter", True)
    full, mine = reference_and_mine(backend, batch=3, steps=3)
    expected = train(mlp(), optim.AdamW(1e-2), full)
    got = train(mlp(), sharded(backend, optim.AdamW(1e-2), compression=compression), mine)
    assert_same_parameters(got, expected, *((1e-4, 1e-5) if compression is None else (2e-2, 2e-3)))
