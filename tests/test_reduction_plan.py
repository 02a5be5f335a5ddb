"""The reduction's plan (``reduction.plan``: what each rank sends, and how the sums decode) without ranks:
every rank's plan runs in this one process, the transport's sum is numpy's, and the decoded result is
compared with the weighted mean it stands for (distributed_utils/reduction.py's table)."""

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed_utils.reduction import inverse, plan, weighted_shares

COMPRESSIONS = [None, mx.bfloat16, mx.float16, "int8"]


def reduced(plans) -> list:
    """What the transport hands every rank: the sum over the ranks of each array sent, times the scale
    (``plans``: every rank's ``(sent, transport_scale, decode)``)."""
    out = []
    for pieces in zip(*(sent for sent, _, _ in plans)):
        total = sum(np.array(p if p.dtype == mx.complex64 else p.astype(mx.float32)) for p in pieces)
        if pieces[0].dtype == mx.int8:  # the levels of every rank fit one int8: the sum cannot overflow
            assert np.abs(total).max(initial=0) <= 127
        out.append(mx.array(total * plans[0][1]).astype(pieces[0].dtype))
    return out


@settings(max_examples=1000)  # (one process, a millisecond each: int8's wraps hide in few cases)
@given(
    size=st.integers(1, 6),
    compression=st.sampled_from(COMPRESSIONS),
    weighted=st.booleans(),
    op=st.sampled_from(["avg", "sum"]),
    scale=st.sampled_from([1.0, 0.5, 3.0]),
    magnitudes=st.lists(st.sampled_from([0.0, 1e-3, 1.0, 300.0]), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_every_ranks_plan_decodes_to_the_weighted_mean_within_its_wire_rounding(
    size, compression, weighted, op, scale, magnitudes, seed
):
    op = "avg" if weighted else op  # (a weighted reduction is a mean)
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (0,), (5,)]
    arrays = [
        [rng.normal(size=s) * magnitudes[(r + i) % 6] for i, s in enumerate(shapes)] for r in range(size)
    ]
    weights = rng.integers(0, 3, size).astype(np.float64) if weighted else None
    if weighted:
        shares = weights / weights.sum() if weights.sum() else np.zeros(size)  # every weight 0: zeros
    else:
        shares = np.full(size, 1.0 / size if op == "avg" else 1.0)
    maxima = mx.array([[np.abs(a).max(initial=0) for a in mine] for mine in arrays], mx.float32)
    options = dict(op=op, scale=scale, compression=compression, maxima=maxima)
    if weighted:
        options["weights"] = mx.array(weights, mx.float32)
    plans = [plan([mx.array(a, mx.float32) for a in arrays[r]], r, size, **options) for r in range(size)]
    got = plans[0][2](reduced(plans))
    after = scale if op == "avg" or weighted else scale * size  # (decode's factor: "sum" is N "avg"s)

    for i, result in enumerate(got):
        expected = sum(shares[r] * arrays[r][i] for r in range(size)) * scale
        spread = (
            sum(abs(shares[r] * arrays[r][i]) for r in range(size)) * scale
        )  # (what rounding scales with)
        if compression == "int8":  # each rank's levels rounded: half a unit each (127 // N levels a rank)
            averaged = shares if op == "avg" or weighted else np.full(size, 1.0 / size)
            unit = max(float(maxima[r, i]) * averaged[r] for r in range(size)) / (127 // size)
            bound = size * 0.5 * unit * after + 1e-6 * spread
        elif compression is not None:  # the wire's mantissa (bfloat16: 8 bits); float16's subnormals
            bound = 2.0**-6 * spread + size * 2.0**-24 * after
        else:  # float32 throughout
            bound = 1e-5 * spread
        assert result.dtype == mx.float32 and result.shape == shapes[i]
        assert np.all(np.abs(np.array(result, np.float64) - expected) <= bound + 1e-30)


def test_a_plan_without_weights_or_compression_leaves_the_scaling_to_the_transport():
    arrays = [mx.ones((3,)), mx.zeros((0,))]
    (sent, mean_scale, decode), (total_sent, total_scale, _) = (
        plan(arrays, 0, 4, "avg", 2.0),
        plan(arrays, 0, 4, "sum", 2.0),
    )
    assert sent is arrays and mean_scale == 0.25 * 2.0
    assert total_sent is arrays and total_scale == 2.0
    sums = [mx.full((3,), 7.0), mx.zeros((0,))]
    assert decode(sums) is sums


def test_a_nan_or_inf_on_one_rank_is_no_finite_number_after_int8_and_complex_arrays_stay_complex():
    """Found by an adversarial test: int8's unit of an array holding a NaN fell back to 1, so 1000 wrapped in
    the int8 cast and the mean came back finite (a diverged rank hidden); compressed, a complex64 array
    lost its imaginary part."""
    for bad in (float("nan"), float("inf")):
        arrays = [[mx.array([1000.0, 0.25, 3.0])], [mx.array([1000.0, 0.25, bad])]]
        maxima = mx.array([[1000.0], [bad]], mx.float32)  # (what Reduction._maxima gathers)
        (sent, _, decode), (other, _, _) = [
            plan(arrays[r], r, 2, compression="int8", maxima=maxima) for r in range(2)
        ]
        total = (sent[0].astype(mx.int32) + other[0].astype(mx.int32)).astype(mx.int8)
        assert not mx.isfinite(decode([total])[0]).any().item()
    z = mx.array([1 + 2j, 3 - 4j], mx.complex64)
    for compression in COMPRESSIONS[1:]:
        plans = [plan([z], r, 2, compression=compression, maxima=mx.array([[5.0], [5.0]])) for r in range(2)]
        assert plans[0][0][0].dtype == mx.complex64
        assert mx.allclose(plans[0][2](reduced(plans))[0], z).item()


def test_weights_huge_or_tiny_give_the_weighted_mean():
    """Found by an adversarial test: the shares were w_r * (1 / sum w) in float32, so finite weights of 2e38
    (their sum inf) gave zeros, and subnormal ones (1 / sum: inf) inf or NaN, silently."""
    mine = [mx.array([1.0, 2.0]), mx.array([3.0, 4.0])]
    for weights, expected in (([2e38, 2e38], [2, 3]), ([1e-40, 1e-40], [2, 3]), ([1e-45, 0.0], [1, 2])):
        plans = [plan([mine[r]], r, 2, weights=mx.array(weights, mx.float32)) for r in range(2)]
        assert plans[0][2](reduced(plans))[0].tolist() == expected, weights


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=8))
def test_the_shares_of_usual_weights_are_their_fraction_of_the_sum_bit_for_bit(weights):
    """Found by review: dividing by the largest weight itself (not a power of two) rounded twice, and the
    shares of token counts lost their bits (98 of 186 weighted cases)."""
    w = mx.array(weights, mx.float32)
    assert mx.array_equal(weighted_shares(w), w * inverse(w.sum())).item()
