"""DiLoCo, alone (a world of one) and under the launcher. Every rank knows every rank's data
(generated from fixed seeds), so each computes the N-rank reference itself: N inner optimizers
in one process, the pseudo-gradients averaged with numpy, the outer optimizer applied."""

import copy

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from primitives import counted
from test_optimizer import mlp

import distributed_utils as du


def loss_fn(model, x, y):
    return nn.losses.mse_loss(model(x), y, reduction="mean")


def rank_data(rank, steps, batch=4, seed=0):
    """Rank ``rank``'s batches: its own rows, so the ranks' local trajectories differ."""
    rng = np.random.default_rng(seed + 7919 * rank)
    x = rng.standard_normal((steps * batch, 4)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], axis=1).astype(np.float32)
    return [
        (mx.array(x[s * batch : (s + 1) * batch]), mx.array(y[s * batch : (s + 1) * batch]))
        for s in range(steps)
    ]


def train(backend, opt, steps, model=None, weights=None, seed=0, start=0, after_step=None):
    """``steps`` updates of ``model`` on this rank's data; the collectives each made."""
    model = model or mlp()
    lg = nn.value_and_grad(model, loss_fn)
    made = []
    for s, (x, y) in enumerate(rank_data(du.local_rank(backend), steps, seed=seed)[start:], start):
        _, grads = lg(model, x, y)
        with counted(backend) as calls:
            weight = {} if weights is None else {"weight": weights(du.local_rank(backend), s)}
            opt.update(model, grads, **weight)
            mx.eval(model.parameters(), opt.state)
        made.append(len(calls))
        if after_step:
            after_step(s + 1, model)
    return model, made


def flat(model) -> np.ndarray:
    return np.concatenate([np.array(p).ravel() for _, p in tree_flatten(model.parameters())])


def replicas_agree(backend, values) -> bool:
    everyone = du.allgather(backend, values[None])
    return bool((everyone.view(np.uint32) == everyone[0].view(np.uint32)).all())


def reference(n, inner, outer, sync_every, steps, weights=None, seed=0, delay=0, alpha=0.0):
    """N ranks' DiLoCo in one process (fragments=1): the global parameters after ``steps``, and
    rank 0's own. With ``delay``, the pseudo-gradient is taken ``delay`` steps before the sync."""
    models = [mlp() for _ in range(n)]
    inners = [copy.deepcopy(inner) for _ in range(n)]
    global_ = dict(tree_flatten(mlp().parameters()))
    data = [rank_data(r, steps, seed=seed) for r in range(n)]
    seen = np.zeros(n)
    for s in range(steps):
        for r in range(n):
            _, grads = nn.value_and_grad(models[r], loss_fn)(models[r], *data[r][s])
            inners[r].update(models[r], grads)
            seen[r] += 1.0 if weights is None else weights(r, s)
        if (s + 1 + delay) % sync_every == 0:
            locals_ = [dict(tree_flatten(m.parameters())) for m in models]
            share = seen / seen.sum()
            pseudo = {
                k: mx.array(
                    sum(share[r] * (np.array(global_[k]) - np.array(locals_[r][k])) for r in range(n))
                )
                for k in global_
            }
            seen[:] = 0
        if (s + 1) % sync_every == 0:
            global_ = outer.apply_gradients(pseudo, global_)
            for m in models:
                mine = dict(tree_flatten(m.parameters()))
                m.update(tree_unflatten([(k, g + alpha * (mine[k] - g)) for k, g in global_.items()]))
    order = [k for k, _ in tree_flatten(mlp().parameters())]
    return np.concatenate([np.array(global_[k]).ravel() for k in order]), flat(models[0])


# ---- the steps: no collective between syncs, the outer step as defined ----


def test_a_step_between_syncs_makes_no_collective(backend):
    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=4)
    _, made = train(backend, opt, 12)
    first = 1 if du.total_workers(backend) > 1 else 0  # the first update checks the parameters and settings
    syncs = 2 if du.total_workers(backend) > 1 else 0  # the structure check, one bucket
    assert made == [first, 0, 0, syncs, 0, 0, 0, syncs, 0, 0, 0, syncs]


@pytest.mark.parametrize("weighted", [False, True])
def test_the_outer_step_averages_the_pseudo_gradients_as_defined(backend, weighted):
    """N ranks against the definition computed in one process. Not bit for bit: the transport
    sums the ranks' pseudo-gradients in its own order and scales before or after the sum."""
    weights = (lambda r, s: float(1 + (r + s) % 3)) if weighted else None
    outer = lambda: optim.SGD(0.7, momentum=0.9, nesterov=True)  # noqa: E731
    got, _ = train(
        backend,
        du.DiLoCo(backend, optim.Adam(1e-2), outer_optimizer=outer(), sync_every=3),
        9,
        weights=weights,
    )
    expected, _ = reference(du.total_workers(backend), optim.Adam(1e-2), outer(), 3, 9, weights)
    np.testing.assert_allclose(flat(got), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected, flat(mlp()))


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_a_delayed_sync_averages_the_pseudo_gradient_taken_delay_steps_before(backend, alpha):
    """fragment_sync_delay=2, sync every 4: the pseudo-gradients are taken at steps 2, 6, 10 and
    the outer steps applied at 4, 8, 12 (the ranks computing meanwhile); then each rank's
    parameters are the global ones (alpha 0) or halfway to its own (alpha 0.5). Against the
    definition in one process (not bit for bit: the transport's order of summing)."""
    weights = lambda r, s: float(1 + (r + s) % 3)  # noqa: E731
    outer = lambda: optim.SGD(0.7, momentum=0.9, nesterov=True)  # noqa: E731
    opt = du.DiLoCo(
        backend,
        optim.Adam(1e-2),
        outer_optimizer=outer(),
        sync_every=4,
        fragment_sync_delay=2,
        fragment_update_alpha=alpha,
    )
    got, made = train(backend, opt, 12, weights=weights)
    expected, rank0 = reference(
        du.total_workers(backend), optim.Adam(1e-2), outer(), 4, 12, weights, delay=2, alpha=alpha
    )
    global_ = np.concatenate([np.array(v).ravel() for _, v in tree_flatten(opt.state["global"])])
    np.testing.assert_allclose(global_, expected, rtol=1e-5, atol=1e-6)
    if du.local_rank(backend) == 0:
        np.testing.assert_allclose(flat(got), rank0, rtol=1e-5, atol=1e-6)
    if du.total_workers(backend) > 1:  # collectives only where a sync starts (the structure check, the sum)
        assert [m > 0 for m in made[1:]] == [s in (2, 6, 10) for s in range(2, 13)]
        assert replicas_agree(backend, flat(got)) == (alpha == 0)


@settings(max_examples=8)
@given(lr=st.floats(1e-3, 0.5), steps=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_local_sgd_that_syncs_every_step_steps_like_distributed_sgd(backend, lr, steps, seed):
    """sync_every=1, outer SGD(1.0), inner SGD: the pseudo-gradient is lr times the gradient,
    up to rounding (p - (p - lr g) is not lr g in floating point), so a tolerance."""
    diloco = du.DiLoCo(backend, optim.SGD(lr), outer_optimizer=optim.SGD(1.0), sync_every=1)
    got, _ = train(backend, diloco, steps, seed=seed)
    expected, _ = train(backend, du.DistributedOptimizer(backend, optim.SGD(lr)), steps, seed=seed)
    np.testing.assert_allclose(flat(got), flat(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", [None, "sparse", du.SparseCodec(k=3, chunk=8)])
def test_replicas_are_identical_right_after_each_sync_and_differ_between(backend, compression):
    checked = []

    def check(step, model):
        checked.append((step, replicas_agree(backend, flat(model))))

    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=3, compression=compression)
    train(backend, opt, 7, after_step=check)
    n = du.total_workers(backend)
    assert checked == [(s, s % 3 == 0 or n == 1) for s in range(1, 8)]


def test_fragments_sync_in_turn_each_every_h_steps(backend):
    """H=4, F=2: the parameters cut into two runs of about equal bytes (the first layer's
    32-value weight; its bias and the second layer, 26 values); fragment 0 syncs at steps 2
    and 6, fragment 1 at 4 and 8; right after its sync a fragment is identical on every rank."""
    synced = []

    def check(step, model):
        params = dict(tree_flatten(model.parameters()))
        rest = np.concatenate(
            [np.array(params[k]).ravel() for k in ("layers.0.bias", "layers.2.weight", "layers.2.bias")]
        )
        synced.append(
            (
                replicas_agree(backend, np.array(params["layers.0.weight"]).ravel()),
                replicas_agree(backend, rest),
            )
        )

    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=4, fragments=2)
    _, made = train(backend, opt, 8, after_step=check)
    if du.total_workers(backend) > 1:
        assert [m > 0 for m in made[1:]] == [s % 2 == 0 for s in range(2, 9)]
        assert synced == [(False, False), (True, False), (False, False), (False, True)] * 2


@pytest.mark.parametrize("compression", ["bfloat16", "int8"])
def test_compressed_pseudo_gradients_keep_replicas_identical_and_close(backend, compression):
    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=2, compression=compression)
    got, _ = train(backend, opt, 6)
    exact, _ = train(backend, du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=2), 6)
    assert replicas_agree(backend, flat(got))
    np.testing.assert_allclose(flat(got), flat(exact), atol=2e-2)


@pytest.mark.parametrize(
    "delay,compression",
    [(0, None), (2, None), (0, "sparse"), (2, du.SparseCodec(k=3, chunk=8))],
    ids=["between-syncs", "while-a-sync-travels", "sparse", "sparse-while-a-sync-travels"],
)
def test_a_checkpoint_between_syncs_resumes_bit_for_bit(backend, tmp_path, delay, compression):
    """Saved at step 7 of 10 (sync every 4, weighted; with a delay of 2 the sync of step 8
    started at step 6 and is in flight): the resumed run ends where the uninterrupted one
    does, bit for bit on every rank (sparse: the error feedback saved and loaded too)."""
    path = du.bcast(backend, str(tmp_path / "diloco.safetensors"))
    weights = lambda r, s: float(1 + r + s % 2)  # noqa: E731
    make = lambda: du.DiLoCo(  # noqa: E731
        backend, optim.AdamW(1e-2), sync_every=4, fragment_sync_delay=delay, compression=compression
    )
    saved = {}

    def save(step, model):
        if step == 7:
            du.save_checkpoint(backend, path, model=model, optimizer=opt, step=step)
            saved["params"] = flat(model)

    opt = make()
    whole, _ = train(backend, opt, 10, weights=weights, after_step=save)
    resumed_opt, model = make(), mlp(seed=1)  # other parameters: the checkpoint must set them
    state = du.load_checkpoint(backend, path, model=model, optimizer=resumed_opt)
    assert state["step"] == 7 and (flat(model) == saved["params"]).all()
    resumed, _ = train(backend, resumed_opt, 10, model=model, weights=weights, start=7)
    assert (flat(resumed).view(np.uint32) == flat(whole).view(np.uint32)).all()


# ---- the sparse codec (SparseLoCo) ----


def test_a_sparse_sync_is_one_allgather_of_the_documented_bytes(backend):
    """Arrays of 10000, 64 x 64 and 5 values, the default codec (k=64 of each 4096, 2 bits): 3 chunks
    (2 x 64 uint16 indices each, 24 bytes of signs, 3 x 2 float32 levels) + 1 chunk (128 + 8 + 8) + one
    of 5 (5 uint8 indices, 1 byte of signs, 8) + the weight's 4 = 594 bytes from each rank: 1/196 of
    int8's 14101 (0.27 bits per value)."""
    codec = du.SparseCodec()
    tree = {"a": mx.ones((10000,)), "b": mx.ones((64, 64)), "c": mx.ones((5,))}
    given = []

    def allgather(x, _original=backend.allgather):
        given.append((x.dtype, x.nbytes))
        return _original(x)

    backend.allgather = allgather
    try:
        codec.reduce(backend, tree, {})
    finally:
        del backend.allgather
    assert given == [(mx.uint8, 594)] and codec.nbytes([10000, 4096, 5]) == 594


@settings(max_examples=12)
@given(
    k=st.integers(1, 12),
    chunk=st.integers(1, 40),
    bits=st.sampled_from([1, 2, 3, None]),
    n=st.integers(1, 90),
    syncs=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_with_decay_1_the_sent_parts_and_the_residual_add_up_to_the_pseudo_gradients(
    backend, k, chunk, bits, n, syncs, seed
):
    """beta = 1: nothing is lost: the averages sent plus the ranks' mean final residual are the mean
    of the ranks' summed pseudo-gradients (to float32 rounding); every rank decodes the same bits."""
    codec = du.SparseCodec(k=min(k, chunk), chunk=chunk, bits=bits, decay=1.0)
    size, rank = du.total_workers(backend), du.local_rank(backend)
    deltas = [
        [np.random.default_rng([seed, r, t]).standard_normal(n, np.float32) for t in range(syncs)]
        for r in range(size)
    ]
    feedback, sent = {}, np.zeros(n, np.float32)
    for t in range(syncs):
        averaged, feedback = codec.reduce(backend, {"w": mx.array(deltas[rank][t])}, feedback)
        assert replicas_agree(backend, np.array(averaged["w"]))
        sent += np.array(averaged["w"])
    residual = np.array(du.allgather(backend, feedback["w"][None])).mean(axis=0)
    expected = np.mean([np.sum(d, axis=0) for d in deltas], axis=0)
    np.testing.assert_allclose(sent + residual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fragments,delay,weighted", [(1, 0, False), (2, 1, True)])
def test_sparse_keeping_every_value_unquantized_is_diloco_with_the_same_outer_sgd(
    backend, fragments, delay, weighted
):
    """k = chunk, bits=None: all of the pseudo-gradient is sent and the residual is zero; the run
    is DiLoCo's with the same outer SGD (fragments and a delayed sync too), bit for bit on up to 2
    ranks. On 3 the transport sums three ranks in an order of its own: to float32 rounding."""
    weights = (lambda r, s: float(1 + (r + s) % 3)) if weighted else None
    runs = [
        train(
            backend,
            du.DiLoCo(
                backend,
                optim.Adam(1e-2),
                outer_optimizer=optim.SGD(1.0),
                sync_every=4,
                fragments=fragments,
                fragment_sync_delay=delay,
                compression=compression,
            ),
            12,
            weights=weights,
        )
        for compression in (du.SparseCodec(k=4096, bits=None), None)
    ]
    sparse, dense = (flat(model) for model, _ in runs)
    if du.total_workers(backend) <= 2:
        assert (sparse.view(np.uint32) == dense.view(np.uint32)).all()
    np.testing.assert_allclose(sparse, dense, rtol=1e-6, atol=1e-7)
    assert not np.allclose(dense, flat(mlp()))


def test_a_sparse_step_between_syncs_makes_no_collective_and_a_sync_one(backend):
    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=4, compression="sparse")
    _, made = train(backend, opt, 8)
    first = 1 if du.total_workers(backend) > 1 else 0  # the first update checks the parameters and settings
    assert made == [first, 0, 0, 1, 0, 0, 0, 1]
    assert isinstance(opt.outer_optimizer, optim.SGD) and opt.outer_optimizer.momentum == 0


def test_sparse_feedback_saved_by_more_ranks_loads_rank_r_modulo_their_number(backend):
    """As the local parameters: a checkpoint of N + 1 ranks gives rank r saved rank r % (N + 1)'s buffers."""
    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=2, compression=du.SparseCodec(k=3, chunk=8))
    train(backend, opt, 3)
    whole, saved = opt.whole_state(), du.total_workers(backend) + 1
    whole["ranks"] = tree_map(lambda a: mx.concatenate([a[:1]] * saved), whole["ranks"])

    def numbered(rows):  # row i: rank 0's buffer + i
        return rows + mx.arange(saved).reshape(-1, *[1] * (rows.ndim - 1))

    whole["ranks"]["feedback"] = tree_map(numbered, whole["ranks"]["feedback"])
    resumed = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=2, compression=du.SparseCodec(k=3, chunk=8))
    resumed.load_whole_state(tree_unflatten(tree_flatten(whole)))  # (flat keys nested, as a checkpoint's)
    row = du.local_rank(backend) % saved
    for key, mine in resumed._feedback.items():
        assert (np.array(mine) == np.array(whole["ranks"]["feedback"][key][row])).all(), key
    assert any((np.array(v) != 0).any() for v in resumed._feedback.values())


# ---- bad input ----


@pytest.mark.parametrize(
    "make,error,words",
    [
        (lambda b: du.DiLoCo(b, optim.SGD(0.1), sync_every=0), ValueError, "sync_every must be an int >= 1"),
        (
            lambda b: du.DiLoCo(b, optim.SGD(0.1), sync_every=2, fragments=3),
            ValueError,
            r"fragments \(each syncs once every sync_every steps, at its own\) must be an int in \[1, 2\], got 3",
        ),
        (lambda b: du.DiLoCo(b, optim.SGD(0.1), outer_optimizer="sgd"), TypeError, "outer_optimizer must be"),
        (
            lambda b: du.DiLoCo(b, du.DistributedOptimizer(b, optim.SGD(0.1))),
            TypeError,
            "already distributed",
        ),
        (lambda b: du.DiLoCo(b, optim.SGD(0.1), compression="int4"), ValueError, "compression must be"),
        (
            lambda b: train(b, du.DiLoCo(b, optim.SGD(0.1), sync_every=8, fragments=5), 1),
            ValueError,
            "only 4 parameter arrays",
        ),
        (
            lambda b: train(b, du.DiLoCo(b, optim.SGD(0.1)), 2, weights=lambda r, s: 1.0 if s == 0 else None),
            ValueError,
            "weight= to every update or to none",
        ),
        (
            lambda b: du.DiLoCo(b, optim.SGD(0.1), sync_every=10, fragments=2, fragment_sync_delay=5),
            ValueError,
            r"fragment_sync_delay \(less than sync_every // fragments = 5\) must be an int in \[0, 4\], got 5",
        ),
        (
            lambda b: du.DiLoCo(b, optim.SGD(0.1), fragment_update_alpha=1.5),
            ValueError,
            r"fragment_update_alpha must be in \[0, 1\]",
        ),
        (
            lambda b: du.SparseCodec(k=9, chunk=8),
            ValueError,
            r"SparseCodec: k \(values kept of each chunk of 8\) must be an int in \[1, 8\], got 9",
        ),
        (
            lambda b: du.SparseCodec(bits=16),
            ValueError,
            r"SparseCodec: bits \(or None or 32: float32 values\) must be an int in \[1, 8\], got 16",
        ),
        (lambda b: du.SparseCodec(decay=1.5), ValueError, r"SparseCodec: decay must be in \[0, 1\], got 1.5"),
    ],
    ids=[
        "sync_every",
        "fragments>H",
        "outer",
        "distributed-inner",
        "compression",
        "fragments>arrays",
        "weight",
        "delay",
        "alpha",
        "sparse-k",
        "sparse-bits",
        "sparse-decay",
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(backend, make, error, words):
    with pytest.raises(error, match=words):
        make(backend)


@pytest.mark.world(min_size=2)
def test_ranks_with_other_settings_fail_on_every_rank_at_the_first_update(backend):
    opt = du.DiLoCo(backend, optim.SGD(0.1), sync_every=4 + (du.local_rank(backend) == 1))
    with pytest.raises(
        ValueError,
        match=r"DiLoCo: every rank needs the same sync_every; ranks \[1\] differ from "
        r"rank 0 \(rank 0: 4, rank 1: 5(, rank 2: 4)?(, rank 3: 4)?\)",
    ):
        train(backend, opt, 1)


def test_a_resumed_run_is_checked_as_a_fresh_one_is(backend, tmp_path, monkeypatch):
    """Found by an adversarial test: a resumed DiLoCo skipped the first update's check (a rank resumed with
    other settings paired its syncs with the others', silently), loaded the state of DiLoCo over other
    optimizers (AdamW's second moments as SGD's momentum), and a parameter frozen after the first update
    failed at the next sync with a bare KeyError."""
    path = du.bcast(backend, str(tmp_path / "diloco.safetensors"))
    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=4)
    model, _ = train(backend, opt, 2)
    du.save_checkpoint(backend, path, model=model, optimizer=opt, step=2)
    other = du.DiLoCo(backend, optim.SGD(0.1, momentum=0.9), sync_every=4)
    with pytest.raises(du.CheckpointError, match=r"a DiLoCo\(AdamW, SGD\), not of a DiLoCo\(SGD, SGD\)"):
        du.load_checkpoint(backend, path, model=model, optimizer=other)
    if backend.size > 1:
        other = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=4 + (du.local_rank(backend) == 1))
        du.load_checkpoint(backend, path, model=model, optimizer=other)
        with pytest.raises(ValueError, match="DiLoCo: every rank needs the same sync_every"):
            train(backend, other, 3, model=model, start=2)
    with monkeypatch.context() as patched:  # a file of before the rule names held the optimizers: it loads
        patched.setattr(du.DiLoCo, "rule_name", lambda self: "DiLoCo")
        du.save_checkpoint(backend, path, model=model, optimizer=opt, step=2)
    du.load_checkpoint(
        backend, path, model=model, optimizer=du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=4)
    )
    model.layers[0].freeze()
    with pytest.raises(ValueError, match=r"\['layers.0.bias', 'layers.0.weight'\] gained or lost their"):
        train(backend, opt, 3, model=model, start=2)


def test_a_schedule_can_set_the_learning_rate(backend):
    """DiLoCo.learning_rate is the inner optimizer's, read and written (schedules assign it)."""
    opt = du.DiLoCo(backend, optim.AdamW(1e-2), sync_every=4)
    opt.learning_rate = 5e-3
    assert opt.learning_rate.item() == pytest.approx(5e-3) == opt.inner_optimizer.learning_rate.item()
