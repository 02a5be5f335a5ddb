"""Token-weighted reduction, alone and under the launcher: with per-token-mean losses and each
rank's token count as its weight, N ranks step exactly like one process on the union of their
tokens (variable lengths: the plain average of per-rank means would not)."""

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_optimizer import OPTIMIZERS, assert_same_parameters, atol, contribution, mlp

import distributed_utils as du
from distributed_utils.tree import TreeMismatchError


def masked_loss(model, x, y, mask):
    """The mean over the valid rows (the "tokens") of a batch padded to a fixed length."""
    per_row = ((model(x) - y) ** 2).mean(axis=1)
    return (per_row * mask).sum() / mask.sum()


def token_batches(seed, steps, world, rows=6):
    """Per step, for every rank: (x, y, mask) of ``rows`` rows, of which a random number
    (1..rows) are valid: the ranks' counts differ."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(world):
            x = rng.standard_normal((rows, 4)).astype(np.float32)
            y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype(np.float32)
            mask = (np.arange(rows) < rng.integers(1, rows + 1)).astype(np.float32)
            step.append((mx.array(x), mx.array(y), mx.array(mask)))
        out.append(step)
    return out


def union(step):
    """One process's batch: every rank's valid rows."""
    keep = [np.array(m) > 0 for _, _, m in step]
    x = np.concatenate([np.array(x)[k] for (x, _, _), k in zip(step, keep)])
    y = np.concatenate([np.array(y)[k] for (_, y, _), k in zip(step, keep)])
    return mx.array(x), mx.array(y), mx.ones((len(x),))


def train(model, opt, batches, weighted=True):
    loss_and_grad = nn.value_and_grad(model, masked_loss)
    for x, y, mask in batches:
        _, grads = loss_and_grad(model, x, y, mask)
        if weighted:
            opt.update(model, grads, weight=mask.sum())
        else:
            opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    return model


@settings(max_examples=5)
@given(
    seed=st.integers(0, 2**16), name=st.sampled_from(["sgd", "adam", "adamw-schedule"]), shard=st.booleans()
)
def test_weighted_ranks_train_like_one_process_on_the_union_of_their_tokens(backend, seed, name, shard):
    n, r = du.total_workers(backend), du.local_rank(backend)
    steps = token_batches(seed, 3, n)
    expected = train(mlp(), OPTIMIZERS[name](), [union(step) for step in steps], weighted=False)
    opt = du.DistributedOptimizer(backend, OPTIMIZERS[name](), shard_optimizer_state=shard)
    got = train(mlp(), opt, [step[r] for step in steps])
    assert_same_parameters(got, expected, atol=atol(name))


@pytest.mark.world(min_size=2)
def test_unweighted_averaging_of_per_rank_means_is_not_the_union(backend):
    """The case for weights: with different counts, the plain average differs."""
    n, r = du.total_workers(backend), du.local_rank(backend)
    steps = token_batches(3, 3, n)
    assert len({float(s[i][2].sum()) for s in steps for i in range(n)}) > 1  # the counts differ
    expected = train(mlp(), optim.SGD(0.5), [union(step) for step in steps], weighted=False)
    got = train(
        mlp(), du.DistributedOptimizer(backend, optim.SGD(0.5)), [step[r] for step in steps], weighted=False
    )
    with pytest.raises(AssertionError):
        assert_same_parameters(got, expected)


@pytest.mark.parametrize("k", [2, 3])
def test_weighted_accumulation_is_the_weighted_mean_over_calls_and_ranks(backend, k):
    n, r = du.total_workers(backend), du.local_rank(backend)
    steps = token_batches(7, 2 * k, n)
    cycles = [[row for step in steps[c * k : (c + 1) * k] for row in step] for c in range(2)]
    expected = train(mlp(), optim.Adam(1e-2), [union(cycle) for cycle in cycles], weighted=False)
    opt = du.DistributedOptimizer(backend, optim.Adam(1e-2), accumulate_steps=k)
    got = train(mlp(), opt, [step[r] for step in steps])
    assert_same_parameters(got, expected)
    assert opt.step.item() == 2


@pytest.mark.world(min_size=2)  # (in a world of one the mean is the value itself)
@pytest.mark.parametrize("compression", [None, mx.bfloat16], ids=str)
def test_reduce_gradients_with_weights_is_the_weighted_mean(backend, compression):
    n, r = du.total_workers(backend), du.local_rank(backend)
    weights = [float(2 * i + 1) for i in range(n)]
    grads = {"a": contribution(r, (33, 17)), "b": [contribution(r, (5,), seed=1)]}
    got = du.reduce_gradients(backend, grads, weight=weights[r], compression=compression)
    for key, shape, seed, value in (("a", (33, 17), 0, got["a"]), ("b", (5,), 1, got["b"][0])):
        want = sum(w * np.array(contribution(i, shape, seed=seed)) for i, w in enumerate(weights)) / sum(
            weights
        )
        tol = (1e-5, 1e-6) if compression is None else (2e-2, 2e-2)
        np.testing.assert_allclose(np.array(value), want, rtol=tol[0], atol=tol[1], err_msg=key)


def test_all_weights_zero_give_zero_gradients_and_tiny_weights_are_weights(backend):
    got = du.reduce_gradients(backend, {"a": mx.ones((3,))}, weight=0)
    assert mx.array_equal(got["a"], mx.zeros((3,))).item()
    got = du.reduce_gradients(backend, {"a": mx.ones((3,))}, weight=1e-31)  # (not clamped to 1e-30)
    np.testing.assert_allclose(np.array(got["a"]), 1.0, rtol=1e-6)


def test_weighted_mean_for_logging(backend):
    n, r = du.total_workers(backend), du.local_rank(backend)
    got = du.weighted_mean(backend, mx.array(float(r)), r + 1)
    assert got == pytest.approx(sum(i * (i + 1) for i in range(n)) / sum(i + 1 for i in range(n)))
    assert np.isnan(du.weighted_mean(backend, 1.0, 0))


def test_bad_weights_are_clear_errors(backend):
    grads = {"a": mx.ones((3,))}
    with pytest.raises(ValueError, match="op must be 'avg'"):
        du.reduce_gradients(backend, grads, op="sum", weight=2)
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1), accumulate_steps=2)
    model = mlp()
    grads = nn.value_and_grad(model, masked_loss)(model, *token_batches(0, 1, 1)[0][0])[1]
    opt.update(model, grads, weight=3)
    with pytest.raises(ValueError, match="to every call of an accumulation cycle, or to none"):
        opt.update(model, grads)


@pytest.mark.world(min_size=2)
def test_a_weight_on_some_ranks_only_is_a_mismatch_on_every_rank(backend):
    weight = 2.0 if du.local_rank(backend) == 0 else None
    with pytest.raises(TreeMismatchError, match="weight"):
        du.reduce_gradients(backend, {"a": mx.ones((3,))}, weight=weight)


def test_the_path_of_transports_with_a_native_reduce_scatter_weights_too(backend, monkeypatch):
    """Sharded where the transport reduce-scatters natively (NCCL, JACCL; forced here over this
    transport's own reduce-scatter), the weights travel in a collective of their own."""
    monkeypatch.setattr(backend, "native_reduce_scatter", True)
    n, r = du.total_workers(backend), du.local_rank(backend)
    steps = token_batches(11, 3, n)
    expected = train(mlp(), optim.AdamW(1e-2), [union(step) for step in steps], weighted=False)
    opt = du.DistributedOptimizer(backend, optim.AdamW(1e-2), shard_optimizer_state=True)
    assert_same_parameters(train(mlp(), opt, [step[r] for step in steps]), expected)


def test_a_compiled_weighted_step(backend):
    n, r = du.total_workers(backend), du.local_rank(backend)
    steps = token_batches(5, 3, n)
    expected = train(mlp(), optim.Adam(1e-2), [union(step) for step in steps], weighted=False)
    model, opt = mlp(), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    state, loss_and_grad = [model.state, opt.state], nn.value_and_grad(model, masked_loss)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y, mask):
        loss, grads = loss_and_grad(model, x, y, mask)
        opt.update(model, grads, weight=mask.sum())
        return loss

    for x, y, mask in (step_[r] for step_ in steps):
        mx.eval(step(x, y, mask), model.parameters(), opt.state)
    assert_same_parameters(model, expected)


def test_float16_gradients_weighted_by_thousands_of_tokens_do_not_overflow(backend):
    """#26.4: g * 4096 overflows float16 (65504); the weighted mean is the float32 computation,
    rounded once to float16 (the shares are powers of two here, so float32 holds every sum exactly)."""
    n, r = du.total_workers(backend), du.local_rank(backend)
    weights = [4096.0 * w for w in (1, 1, 2, 4)[:n]]
    grads = [np.arange(-600, 600, 7, dtype=np.float16) * (i + 1) for i in range(n)]
    got = du.reduce_gradients(backend, {"g": mx.array(grads[r])}, weight=weights[r])["g"]
    shares = np.array(weights, np.float32) / np.float32(sum(weights))
    want = sum(g.astype(np.float32) * s for g, s in zip(grads, shares)).astype(np.float16)
    assert got.dtype == mx.float16 and np.array_equal(np.array(got), want)


@pytest.mark.parametrize("weight", [None, 4096])
def test_accumulated_float16_gradients_stay_finite(backend, weight):
    """Summed over the calls in float32: four float16 gradients of 30000 (or 100 weighted by 4096
    tokens) overflowed float16's 65504 before."""
    n, r = du.total_workers(backend), du.local_rank(backend)
    opt = du.DistributedOptimizer(backend, optim.SGD(1.0), accumulate_steps=4)
    params = {"w": mx.zeros((8,), mx.float16)}
    value = 100.0 * (r + 1) if weight else 30000.0  # (every rank's fits float16; four of them summed do not)
    for i in range(4):
        grads = {"w": mx.full((8,), value, mx.float16)}
        params = opt.apply_gradients(grads, params, **({} if weight is None else {"weight": weight}))
    want = -100.0 * sum(range(1, n + 1)) / n if weight else -30000.0  # the mean over calls and ranks
    assert params["w"].dtype == mx.float16
    np.testing.assert_allclose(np.array(params["w"], np.float32), want, rtol=1e-3)


def test_a_weight_that_is_not_one_number_gt_0_is_a_clear_error_on_every_rank(backend):
    """Negative, infinite, NaN, a string, an array of another shape: on the last rank alone, the
    same ValueError on every rank (raised on that rank alone, the others waited in the reduction)."""
    n, r = du.total_workers(backend), du.local_rank(backend)
    for bad in (-1.0, float("inf"), float("nan"), "2", mx.ones((2,)), True):
        weight = bad if r == n - 1 else 3.0
        with pytest.raises(
            ValueError, match=rf"weight must be one number >= 0 per rank.*ranks \[{n - 1}\] passed"
        ):
            du.reduce_gradients(backend, {"a": mx.ones((3,))}, weight=weight)
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1), accumulate_steps=2)
    grads = {"a": mx.ones((3,))}
    opt.apply_gradients(grads, {"a": mx.zeros((3,))}, weight=mx.ones((2,)) if r == n - 1 else 3.0)
    with pytest.raises(ValueError, match=rf"ranks \[{n - 1}\] passed \[nan\]"):  # at the cycle's reduction
        opt.apply_gradients(grads, {"a": mx.zeros((3,))}, weight=1.0)
