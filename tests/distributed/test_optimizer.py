"""DistributedOptimizer, alone (a world of one) and under the launcher: every rank knows all the
data (generated from a fixed seed), so it computes the one-process reference itself and checks
that N ranks at batch B train exactly like one process at batch N*B."""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from primitives import counted

import distributed_utils as du
from distributed_utils.tree import TreeMismatchError

OPTIMIZERS = {
    "sgd": lambda: optim.SGD(0.1, momentum=0.9),
    "adam": lambda: optim.Adam(1e-2),
    "adamw-schedule": lambda: optim.AdamW(optim.cosine_decay(2e-2, 8), weight_decay=0.05),
    "multi": lambda: optim.MultiOptimizer([optim.SGD(0.05), optim.Adam(1e-2)], [lambda k, _: "bias" in k]),
}


def mlp(seed=0):
    mx.random.seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    mx.eval(model.parameters())
    return model


def loss_fn(model, x, y):
    return nn.losses.mse_loss(model(x), y, reduction="mean")  # mean: the rank average is the full batch's


def dataset(seed, rows):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], axis=1).astype(np.float32)
    return mx.array(x), mx.array(y)


def train(model, opt, batches):
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    for x, y in batches:
        _, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    return model


def reference_and_mine(backend, batch, steps, k=1, seed=0):
    """The one-process batches (k * N * batch rows each) and this rank's micro-batches: micro-batch
    j of step s on rank r holds rows (j * N + r) * batch ... + batch of the big one."""
    n, r = du.total_workers(backend), du.local_rank(backend)
    x, y = dataset(seed, steps * k * n * batch)
    big = k * n * batch
    full = [(x[s * big : (s + 1) * big], y[s * big : (s + 1) * big]) for s in range(steps)]
    mine = [
        (bx[(j * n + r) * batch : (j * n + r + 1) * batch], by[(j * n + r) * batch : (j * n + r + 1) * batch])
        for bx, by in full
        for j in range(k)
    ]
    return full, mine


def assert_same_parameters(a, b, rtol=1e-4, atol=1e-5):
    fa, fb = tree_flatten(a.parameters()), tree_flatten(b.parameters())
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (key, pa), (_, pb) in zip(fa, fb):
        np.testing.assert_allclose(np.array(pa), np.array(pb), rtol=rtol, atol=atol, err_msg=key)


def atol(name) -> float:
    """How far N ranks may end from one process with OPTIMIZERS[name]. Adam's step divides m by sqrt(v):
    where two steps' gradients nearly cancel, the rounding of a sum in another order (N ranks) moves a
    parameter by more than 1e-5 (seen: 3.5e-5 at lr 2e-2, ring, 4 ranks)."""
    return 1e-5 if name == "sgd" else 1e-3


def contribution(rank, shape, dtype=mx.float32, seed=0):
    """Rank ``rank``'s gradient leaf: random, so that low-precision rounding shows."""
    rng = np.random.default_rng(seed + 1000 * rank)
    return mx.array(rng.standard_normal(shape).astype(np.float32) * (rank + 1)).astype(dtype)


def mean_over_ranks(backend, shape, dtype=mx.float32, seed=0):
    return np.mean(
        [
            np.array(contribution(r, shape, dtype, seed).astype(mx.float32))
            for r in range(du.total_workers(backend))
        ],
        axis=0,
    )


# ---- training equivalence: N ranks at batch B == one process at batch N * B ----


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_n_ranks_train_like_one_process_with_n_times_the_batch(backend, name):
    full, mine = reference_and_mine(backend, batch=3, steps=4)
    expected = train(mlp(), OPTIMIZERS[name](), full)
    opt = du.DistributedOptimizer(backend, OPTIMIZERS[name]())
    got = train(mlp(), opt, mine)
    assert_same_parameters(got, expected)
    assert not np.allclose(
        np.array(got.parameters()["layers"][0]["weight"]), np.array(mlp().parameters()["layers"][0]["weight"])
    )
    if name != "multi":
        assert opt.step.item() == 4


EVERY_OPTIMIZER = sorted(
    (
        c
        for c in vars(optim).values()
        if isinstance(c, type)
        and issubclass(c, optim.Optimizer)
        and c not in (optim.Optimizer, optim.MultiOptimizer)
    ),
    key=lambda c: c.__name__,
)


@pytest.mark.parametrize("cls", EVERY_OPTIMIZER, ids=lambda c: c.__name__)
def test_every_mlx_optimizer_trains_like_one_process(backend, cls):
    full, mine = reference_and_mine(backend, batch=2, steps=2)
    expected = train(mlp(), cls(learning_rate=1e-2), full)
    got = train(mlp(), du.DistributedOptimizer(backend, cls(learning_rate=1e-2)), mine)
    assert_same_parameters(got, expected)


@pytest.mark.parametrize("bucket_bytes", [0, None])
def test_batch_one_trains_like_one_process(backend, bucket_bytes):
    """At batch 1 a bias's gradient is a view of the memory the rest of the backward pass reads: summed in
    it while that pass computes (overlap), the other gradients came out wrong (found by the property test)."""
    full, mine = reference_and_mine(backend, batch=1, steps=2)
    expected = train(mlp(), optim.SGD(0.1), full)
    got = train(mlp(), du.DistributedOptimizer(backend, optim.SGD(0.1), bucket_bytes=bucket_bytes), mine)
    assert_same_parameters(got, expected)


@settings(max_examples=4)
@given(
    batch=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(sorted(OPTIMIZERS)),
    bucket_bytes=st.sampled_from([0, 64, None]),
)
def test_equivalence_over_batches_seeds_and_buckets(backend, batch, seed, name, bucket_bytes):
    full, mine = reference_and_mine(backend, batch=batch, steps=2, seed=seed)
    expected = train(mlp(seed), OPTIMIZERS[name](), full)
    got = train(
        mlp(seed), du.DistributedOptimizer(backend, OPTIMIZERS[name](), bucket_bytes=bucket_bytes), mine
    )
    assert_same_parameters(got, expected, atol=atol(name))


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_trains_like_one_process_with_k_n_times_the_batch(backend, k):
    full, mine = reference_and_mine(backend, batch=2, steps=3, k=k)
    expected = train(mlp(), OPTIMIZERS["adamw-schedule"](), full)
    model, opt = mlp(), du.DistributedOptimizer(backend, OPTIMIZERS["adamw-schedule"](), accumulate_steps=k)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    for i, (x, y) in enumerate(mine):
        before = [np.array(p) for _, p in tree_flatten(model.parameters())]
        opt.update(model, loss_and_grad(model, x, y)[1])
        mx.eval(model.parameters(), opt.state)
        after = [np.array(p) for _, p in tree_flatten(model.parameters())]
        changed = any(not np.array_equal(a, b) for a, b in zip(before, after))
        assert changed == ((i + 1) % k == 0), i  # only the k-th call of a cycle updates
        assert opt.step.item() == (i + 1) // k
    assert_same_parameters(model, expected)


def test_accumulated_apply_gradients_returns_the_parameters_until_the_kth_call(backend):
    model = mlp()
    opt = du.DistributedOptimizer(backend, optim.SGD(0.5), accumulate_steps=2)
    grads = nn.value_and_grad(model, loss_fn)(model, *dataset(0, 4))[1]
    first = opt.apply_gradients(grads, model)
    assert all(a is b for (_, a), (_, b) in zip(tree_flatten(first), tree_flatten(model.parameters())))
    second = opt.apply_gradients(grads, model)
    assert not mx.array_equal(second["layers"][0]["weight"], model.layers[0].weight).item()


def test_an_accumulation_cycle_whose_gradients_gain_or_lose_a_key_is_refused(backend):
    """Found by an adversarial test: a layer unfrozen at a cycle's second call had its gradients dropped
    silently (its parameters did not move); one frozen there was a bare KeyError. Also: a bucket_bytes that is
    no count of bytes is named."""
    for frozen_at_first in (True, False):
        model = mlp()
        step = nn.value_and_grad(model, loss_fn)
        opt = du.DistributedOptimizer(backend, optim.SGD(0.5), accumulate_steps=2)
        if frozen_at_first:
            model.layers[2].freeze()
        opt.update(model, step(model, *dataset(0, 4))[1])
        if frozen_at_first:
            model.layers[2].unfreeze()
        else:
            model.layers[2].freeze()
        with pytest.raises(ValueError, match=r"\['layers.2.bias', 'layers.2.weight'\] gained or lost"):
            opt.update(model, step(model, *dataset(0, 4))[1])
    with pytest.raises(TypeError, match="bucket_bytes must be an int >= 0, got '1MB'"):
        du.DistributedOptimizer(backend, optim.SGD(0.5), bucket_bytes="1MB")


@pytest.mark.world(min_size=2)
def test_compression_leaves_a_nan_or_inf_not_finite_and_complex_numbers_whole(backend):
    """Found by an adversarial test: int8's unit of an array holding a NaN on one rank fell back to 1, so 1000
    wrapped in the int8 cast and the mean came back finite (a diverged rank hidden); compressed, a complex64
    array lost its imaginary part."""
    last = backend.rank == backend.size - 1
    for bad in (float("nan"), float("inf")):
        g = {"w": mx.array([1000.0, 0.25, bad if last else 3.0])}
        assert not mx.isfinite(du.reduce_gradients(backend, g, compression="int8")["w"]).any().item()
    z = {"z": mx.array([1 + 2j, 3 - 4j], mx.complex64)}
    for compression in ("bfloat16", "float16", "int8"):
        assert mx.allclose(du.reduce_gradients(backend, z, compression=compression)["z"], z["z"]).item()


def train_with_the_first_layer_frozen(backend, opt):
    """N ranks with ``opt`` (an Adam(1e-2)) and one process, the first layer frozen in both:
    (the trained model, the one-process reference, the frozen weights)."""
    full, mine = reference_and_mine(backend, batch=2, steps=3)
    ref, model = mlp(), mlp()
    for m in (ref, model):
        m.layers[0].freeze()
    frozen = np.array(model.layers[0].weight)
    return train(model, opt, mine), train(ref, optim.Adam(1e-2), full), frozen


def test_frozen_layers_stay_frozen_and_the_rest_trains_like_one_process(backend):
    got, expected, frozen = train_with_the_first_layer_frozen(
        backend, du.DistributedOptimizer(backend, optim.Adam(1e-2))
    )
    assert_same_parameters(got, expected)
    assert np.array_equal(np.array(got.layers[0].weight), frozen)


# ---- reduce_gradients: op, buckets, dtypes, compression ----

SHAPES = [(), (1,), (7,), (3, 5), (33, 17), (2, 3, 4)]


@pytest.mark.world(min_size=2)  # (in a world of one nothing travels: a value compared with itself)
@pytest.mark.parametrize("bucket_bytes", [0, 16, 1000, 2**30, None])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_reduce_gradients_matches_the_mean_or_sum_for_every_bucketing(backend, bucket_bytes, op):
    dtypes = [mx.float32, mx.float16, mx.bfloat16, mx.float32, mx.float32, mx.float16]
    rank, n = du.local_rank(backend), du.total_workers(backend)
    grads = {
        "w": [contribution(rank, s, d, seed=i) for i, (s, d) in enumerate(zip(SHAPES, dtypes))],
        "none": None,
        "frozen": {},
        "tail": (contribution(rank, (5,), seed=99),),
    }
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1), op=op, bucket_bytes=bucket_bytes)
    out = opt.reduce_gradients(grads)
    assert out["none"] is None and out["frozen"] == {} and isinstance(out["tail"], tuple)
    for i, (shape, dtype) in enumerate(zip(SHAPES, dtypes)):
        got = out["w"][i]
        assert got.shape == shape and got.dtype == dtype
        want = mean_over_ranks(backend, shape, dtype, seed=i) * (n if op == "sum" else 1)
        tol = 1e-5 if dtype == mx.float32 else 2e-2
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol * n, err_msg=str(i)
        )
    np.testing.assert_allclose(
        np.array(out["tail"][0]),
        mean_over_ranks(backend, (5,), seed=99) * (n if op == "sum" else 1),
        rtol=1e-5,
    )


@pytest.mark.world(min_size=2)  # (in a world of one nothing travels: a value compared with itself)
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_arrays_sharing_memory_or_not_contiguous_are_reduced_once_each(backend, op):
    rank = du.local_rank(backend)
    base = contribution(rank, (4, 6))
    mx.eval(base)
    grads = {
        "a": base,
        "same": base,
        "t": base.T,
        "slice": base[1:3],
        "broadcast": mx.broadcast_to(base[0], (3, 6)),
    }
    out = du.DistributedOptimizer(backend, optim.SGD(0.1), op=op, bucket_bytes=0).reduce_gradients(grads)
    want = mean_over_ranks(backend, (4, 6)) * (du.total_workers(backend) if op == "sum" else 1)
    for key, expect in {
        "a": want,
        "same": want,
        "t": want.T,
        "slice": want[1:3],
        "broadcast": np.broadcast_to(want[0], (3, 6)),
    }.items():
        np.testing.assert_allclose(np.array(out[key]), expect, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.world(min_size=2)  # (in a world of one nothing travels: a value compared with itself)
def test_ranks_whose_arrays_share_memory_differently_still_agree(backend):
    rank = du.local_rank(backend)
    big = contribution(rank, (1536, 1024))  # MPIBackend: rank 0 reduces "b" (it aliases "a") in a copy
    mx.eval(big)
    grads = {"a": big, "b": big if rank == 0 else mx.array(np.array(big)), "c": contribution(rank, (3,))}
    out = du.DistributedOptimizer(backend, optim.SGD(0.1), op="sum", bucket_bytes=0).reduce_gradients(grads)
    want = mean_over_ranks(backend, (1536, 1024)) * du.total_workers(backend)
    for key in ("a", "b"):
        np.testing.assert_allclose(np.array(out[key]), want, rtol=1e-5, atol=1e-5, err_msg=key)
    np.testing.assert_allclose(
        np.array(out["c"]), mean_over_ranks(backend, (3,)) * du.total_workers(backend), rtol=1e-5
    )


@pytest.mark.world(min_size=2)
def test_the_callers_gradients_keep_their_values(backend):
    """A gradient may be a view of memory that the rest of the backward pass still reads (a bias's, at batch
    1): reduced while that pass computes, it must not be written (MPIBackend wrote into it before 2026-11)."""
    grads = {"w": contribution(du.local_rank(backend), (64, 64))}
    mx.eval(grads)
    before = np.array(grads["w"])
    out = du.DistributedOptimizer(backend, optim.SGD(0.1), bucket_bytes=0).reduce_gradients(grads)
    np.testing.assert_array_equal(np.array(grads["w"]), before)
    np.testing.assert_allclose(np.array(out["w"]), mean_over_ranks(backend, (64, 64)), rtol=1e-5, atol=1e-6)


@pytest.mark.world(min_size=2)  # (in a world of one nothing travels: a value compared with itself)
@pytest.mark.parametrize("compression", [mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_compression_is_close_to_float32_but_rounded(backend, compression, op):
    rank, n = du.local_rank(backend), du.total_workers(backend)
    grads = {"w": contribution(rank, (50, 40)), "b": contribution(rank, (40,), seed=1)}
    exact = du.DistributedOptimizer(backend, optim.SGD(0.1), op=op).reduce_gradients(grads)
    out = du.DistributedOptimizer(backend, optim.SGD(0.1), op=op, compression=compression).reduce_gradients(
        grads
    )
    for key in grads:
        assert out[key].dtype == mx.float32
        np.testing.assert_allclose(np.array(out[key]), np.array(exact[key]), rtol=2e-2, atol=2e-2 * n)
        if n > 1:  # in a world of one nothing is sent, so nothing is rounded
            assert not mx.array_equal(out[key], exact[key]).item()


@pytest.mark.world(min_size=2)  # (in a world of one nothing travels: a value compared with itself)
@pytest.mark.parametrize("weighted", [False, True])
def test_int8_compression_is_within_half_a_level_of_the_exact_mean(backend, weighted):
    """Each array travels as int8 in 127 // N levels of its largest magnitude over the ranks:
    each rank's rounding is at most half a level, so the mean is off by at most that."""
    rank, n = du.local_rank(backend), du.total_workers(backend)
    grads = {
        "w": contribution(rank, (50, 40)),
        "b": contribution(rank, (40,), seed=1).astype(mx.float16),
        "zero": mx.zeros((3,)),
    }
    weight = rank + 1 if weighted else None
    exact = du.reduce_gradients(backend, grads, weight=weight)
    out = du.reduce_gradients(backend, grads, weight=weight, compression="int8")
    total = n * (n + 1) / 2 if weighted else n
    for key, g in grads.items():
        largest = du.allreduce(backend, mx.max(mx.abs(g.astype(mx.float32) * (weight or 1))), "max").item()
        bound = n * largest / (127 // n) / 2 / total
        assert out[key].dtype == g.dtype
        error = np.abs(np.array(out[key].astype(mx.float32)) - np.array(exact[key].astype(mx.float32)))
        assert error.max() <= bound * 1.01 + (1e-3 if g.dtype == mx.float16 else 1e-6), key
        if n > 1 and key != "zero":  # in a world of one, unweighted, nothing travels
            assert error.max() > 0, key
    assert (np.array(out["zero"]) == 0).all()


@pytest.mark.world(min_size=2)  # (in a world of one nothing travels: a value compared with itself)
def test_compression_pre_divides_so_that_large_sums_do_not_overflow(backend):
    n = du.total_workers(backend)
    grads = {"w": mx.full((8,), 60000.0)}  # float16's largest value is 65504
    for op, want in (("avg", 60000.0), ("sum", 60000.0 * n)):
        out = du.DistributedOptimizer(
            backend, optim.SGD(0.1), op=op, compression=mx.float16
        ).reduce_gradients(grads)
        assert np.isfinite(np.array(out["w"])).all()
        np.testing.assert_allclose(np.array(out["w"]), want, rtol=1e-3)


def test_compressed_accumulated_training_stays_close(backend):
    full, mine = reference_and_mine(backend, batch=2, steps=3, k=2)
    expected = train(mlp(), optim.SGD(0.1), full)
    got = train(
        mlp(),
        du.DistributedOptimizer(backend, optim.SGD(0.1), accumulate_steps=2, compression=mx.bfloat16),
        mine,
    )
    assert_same_parameters(got, expected, rtol=2e-2, atol=2e-3)


# ---- drop-in: compile, state, attributes ----


def compiled_step(model, opt, loss=loss_fn):
    state = [model.state, opt.state]
    loss_and_grad = nn.value_and_grad(model, loss)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        return loss

    return step


@pytest.mark.parametrize("compression", [None, mx.bfloat16], ids=str)
def test_compiled_train_step_with_the_wrapper_inside(backend, compression):
    """mlx-lm's idiom; on MPIBackend the traced collectives are MLX's own MPI ops."""
    full, mine = reference_and_mine(backend, batch=3, steps=4)
    expected = train(mlp(), OPTIMIZERS["adamw-schedule"](), full)
    model, opt = (
        mlp(),
        du.DistributedOptimizer(backend, OPTIMIZERS["adamw-schedule"](), compression=compression),
    )
    step = compiled_step(model, opt)
    for x, y in mine:
        mx.eval(step(x, y), model.parameters(), opt.state)
    assert_same_parameters(model, expected, *((1e-4, 1e-5) if compression is None else (2e-2, 2e-3)))
    assert opt.step.item() == 4


def test_an_eager_reduction_between_compiled_functions(backend):
    """The other way to compile: the gradient and the optimizer rule compiled, the reduction
    eager between them (in place on MPI)."""
    full, mine = reference_and_mine(backend, batch=3, steps=3)
    expected = train(mlp(), optim.Adam(1e-2), full)
    model, opt = mlp(), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    loss_and_grad, state = nn.value_and_grad(model, loss_fn), [model.state, opt.state]
    grad_fn = mx.compile(lambda x, y: loss_and_grad(model, x, y)[1], inputs=model.state, outputs=model.state)
    apply = mx.compile(lambda grads: opt.optimizer.update(model, grads), inputs=state, outputs=state)
    for x, y in mine:
        apply(opt.reduce_gradients(grad_fn(x, y)))
        mx.eval(model.parameters(), opt.state)
    assert_same_parameters(model, expected)


def test_reads_and_writes_through_to_the_wrapped_optimizer(backend):
    inner = optim.Adam(1e-3, betas=[0.8, 0.9])
    opt = du.DistributedOptimizer(backend, inner)
    assert isinstance(opt, optim.Optimizer) and opt.betas == [0.8, 0.9]
    opt.learning_rate = 0.5
    assert inner.learning_rate.item() == 0.5 and opt.state is inner.state
    model = mlp()
    opt.init(model.trainable_parameters())
    assert "layers" in inner.state and opt.step.item() == 0
    opt.state = {**inner.state, "step": mx.array(7, mx.uint64)}
    assert inner.step.item() == 7


def test_synchronize_gives_every_rank_roots_state(backend):
    model, opt = mlp(), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    opt.init(model.trainable_parameters())
    opt.learning_rate = 0.1 * (du.local_rank(backend) + 1)
    du.synchronize(backend, opt)
    assert opt.learning_rate.item() == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"op": "max"}, ValueError),
        ({"accumulate_steps": 0}, ValueError),
        ({"compression": mx.int16}, ValueError),
        ({"compression": "float8"}, ValueError),
    ],
)
def test_bad_arguments_are_refused(backend, kwargs, error):
    with pytest.raises(error):
        du.DistributedOptimizer(backend, optim.SGD(0.1), **kwargs)


def test_a_backend_class_or_a_non_optimizer_is_refused(backend):
    with pytest.raises(TypeError, match="backend object"):
        du.DistributedOptimizer(type(backend), optim.SGD(0.1))
    with pytest.raises(TypeError, match="Optimizer"):
        du.DistributedOptimizer(backend, lambda g: g)


# ---- mismatched trees raise on every rank ----

MULTI_RANK = pytest.mark.world(min_size=2)


@MULTI_RANK
@pytest.mark.parametrize("change", ["extra key", "shape", "dtype", "missing key"])
def test_mismatched_trees_raise_on_every_rank_on_the_first_reduction(backend, change):
    last = du.local_rank(backend) == du.total_workers(backend) - 1
    grads = {"a": mx.ones((3,)), "b": {"c": mx.ones((2, 2))}}
    if last and change == "extra key":
        grads["b"]["d"] = mx.ones((1,))
    elif last and change == "shape":
        grads["b"]["c"] = mx.ones((2, 3))
    elif last and change == "dtype":
        grads["b"]["c"] = mx.ones((2, 2), mx.float16)
    elif last and change == "missing key":
        del grads["a"]
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1))
    key = {"extra key": "b.d", "shape": "b.c", "dtype": "b.c", "missing key": "a"}[change]
    with pytest.raises(
        TreeMismatchError,
        match=rf"DistributedOptimizer.update\(grads\).*'{key}'.*ranks \[{du.total_workers(backend) - 1}\]",
    ):
        opt.update(mlp(), grads)


@MULTI_RANK
def test_a_tree_that_changes_on_every_rank_is_verified_again(backend):
    last = du.local_rank(backend) == du.total_workers(backend) - 1
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1))
    mx.eval(opt.reduce_gradients({"a": mx.ones((3,))}))
    mx.eval(
        opt.reduce_gradients({"a": mx.ones((3,)), "b": mx.ones((2,))})
    )  # the same change everywhere: fine
    with pytest.raises(TreeMismatchError, match="'b'"):
        opt.reduce_gradients({"a": mx.ones((3,)), "b": mx.ones((4,) if last else (5,))})


def test_verify_false_skips_the_structure_check_and_nothing_else(backend):
    """One collective per bucket without the check, one more (the 32-byte digest) with it."""
    grads = {"a": mx.ones((3,)), "b": [mx.ones((2, 2))]}
    made = []
    for verify in (True, False):
        with counted(backend) as calls:
            out = du.reduce_gradients(backend, grads, verify=verify)
        made.append(len(calls))
        assert mx.array_equal(out["b"][0], mx.ones((2, 2))).item()
    assert made == ([2, 1] if du.total_workers(backend) > 1 else [0, 0])


@pytest.mark.world(min_size=2)
@pytest.mark.parametrize(
    "options", [{"compression": mx.bfloat16}, {"bucket_bytes": 0}, {"scale": 2.0}], ids=str
)
def test_a_reduction_with_other_settings_on_one_rank_is_a_mismatch_on_every_rank(backend, options):
    """Other compression or buckets made other collectives (a hang or garbage); another scale, a
    silently wrong sum of gradients scaled differently by rank. In the digest now."""
    mine = options if du.local_rank(backend) == 1 else {}
    with pytest.raises(TreeMismatchError, match=r"first difference at key '\(reduction\)'"):
        du.reduce_gradients(backend, {"a": mx.ones((3,)), "b": mx.ones((300,))}, **mine)
