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
from distributed_utils.fsdp import ELEMENTWISE, shard_of

SHARDABLE = {name: make for name, make in OPTIMIZERS.items() if name != "multi"}


def sharded(backend, optimizer, **kwargs):
    return du.DistributedOptimizer(backend, optimizer, shard_optimizer_state=True, **kwargs)


def assert_same_state(a, b):
    a, b = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert a.keys() == b.keys()
    for key in a:
        assert mx.array_equal(a[key], b[key]).item(), key


@given(shape=st.lists(st.integers(0, 5), max_size=3), world=st.integers(1, 7))
def test_the_shards_of_the_ranks_are_disjoint_and_complete(shape, world):
    """Each rank's shard: ceil(n / N) elements of the flattened array, in rank order, zeros past its end."""
    a = mx.arange(int(np.prod(shape)), dtype=mx.float32).reshape(shape) + 1
    shards = [shard_of(a, world, r) for r in range(world)]
    assert all(s.shape == (-(-a.size // world),) for s in shards)
    joined = mx.concatenate(shards)
    assert mx.array_equal(joined[: a.size], a.reshape(-1)).item() and not joined[a.size :].any().item()


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
    """The state of this rank's shard of each parameter, as the replicated state is keyed: 1/N of
    its elements (rounded up)."""
    model, opt = mlp(), sharded(backend, optim.Adam(1e-2))
    train(model, opt, reference_and_mine(backend, batch=2, steps=1)[1])
    params = dict(tree_flatten(model.trainable_parameters()))
    state = dict(tree_flatten(opt.state))
    assert {k.rpartition(".")[0] for k in state if "." in k} == set(params)
    for key, p in params.items():
        assert state[key + ".m"].shape == state[key + ".v"].shape == (-(-p.size // backend.size),)


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


def test_a_checkpoint_of_a_sharded_state_loads_replicated_or_sharded_and_resumes(
    backend, tmp_path, monkeypatch
):
    path = du.bcast(backend, str(tmp_path / "ck"))  # rank 0's directory
    _, mine = reference_and_mine(backend, batch=2, steps=4)
    whole_run = train(mlp(), sharded(backend, optim.AdamW(1e-2)), mine)
    model, opt = mlp(), sharded(backend, optim.AdamW(1e-2))
    train(model, opt, mine[:2])
    gathered, gather = [], du.fsdp.gather  # (each rank writes its shards' bytes where all see the file)
    monkeypatch.setattr(du.fsdp, "gather", lambda *a, **k: gathered.append(a) or gather(*a, **k))
    du.save_checkpoint(backend, path, model=model, optimizer=opt, step=2)
    monkeypatch.undo()
    assert gathered == [] or backend.size == 1  # (no gather of the state; a world of one writes its own)
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
        (lambda: optim.Adafactor(), "factors each matrix's second moment into row and column statistics"),
        (lambda: optim.Muon(1e-2), "orthogonalizes each matrix's update as a whole"),
        (OPTIMIZERS["multi"], "picks an optimizer for each parameter by its name"),
    ],
)
def test_optimizers_that_are_not_elementwise_are_refused_with_the_reason(backend, optimizer, words):
    with pytest.raises(ValueError, match=words):
        sharded(backend, optimizer())


def test_a_gradient_tree_that_changes_after_sharding_steps_like_the_replicated_optimizer(backend):
    """Each parameter's state is its own shard: a layer frozen later keeps its state, unused, whole in
    ``whole_state()`` and each rank's own through ``du.synchronize`` (found by an adversarial run: a
    step without the layer's gradient forgot which entries were shards)."""
    steps = reference_and_mine(backend, batch=2, steps=3)[1]
    runs, states = [], []
    for opt in (sharded(backend, optim.Adam(0.1)), du.DistributedOptimizer(backend, optim.Adam(0.1))):
        model = train(mlp(), opt, steps[:1])
        model.layers[0].freeze()
        train(model, opt, steps[1:2])
        states.append(dict(tree_flatten(opt.whole_state())))  # (as it is now: the step goes on)
        du.synchronize(backend, opt)
        model.unfreeze()
        runs.append(train(model, opt, steps[2:]))
    assert_same_state(*states)
    assert_bit_identical(*runs)


@pytest.mark.parametrize("compression", [None, mx.bfloat16], ids=str)
def test_the_path_of_transports_with_a_native_reduce_scatter_trains_like_one_process(
    backend, compression, monkeypatch
):
    """NCCL and JACCL reduce-scatter natively, and ZeRO-1 then reduce-scatters (not all-reduces) the
    gradients: that path, forced here over this transport's own reduce-scatter, trains like one process
    (NCCL's and JACCL's own sum_scatter cannot run on this machine)."""
    monkeypatch.setattr(backend, "native_reduce_scatter", True)
    full, mine = reference_and_mine(backend, batch=3, steps=3)
    expected = train(mlp(), optim.AdamW(1e-2), full)
    got = train(mlp(), sharded(backend, optim.AdamW(1e-2), compression=compression), mine)
    assert_same_parameters(got, expected, *((1e-4, 1e-5) if compression is None else (2e-2, 2e-3)))
