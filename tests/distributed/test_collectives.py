"""bcast / allreduce / reduce / allgather / barrier on every dtype, with the results checked
against what every rank contributed (known to all ranks: values are functions of the rank)."""

import operator

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import distributed_utils as du

DTYPES = [
    mx.bool_,
    mx.uint8,
    mx.uint16,
    mx.uint32,
    mx.uint64,
    mx.int8,
    mx.int16,
    mx.int32,
    mx.int64,
    mx.float16,
    mx.bfloat16,
    mx.float32,
    mx.float64,
    mx.complex64,
]
FLOATS = [mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.complex64]
NUMPY_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def contribution(rank, dtype, shape=(5,)):
    """Rank ``rank``'s array: small values so that every reduction is exact in every dtype."""
    n = int(np.prod(shape))
    values = (np.arange(n) + rank) % 3 + (rank % 2)
    if dtype == mx.bool_:
        values = (np.arange(n) + rank) % 2
    return mx.array(values.reshape(shape)).astype(dtype)


def expected(backend, dtype, op, shape=(5,)):
    parts = [
        np.array(contribution(r, dtype, shape).astype(mx.float64 if dtype != mx.complex64 else mx.complex64))
        for r in range(du.total_workers(backend))
    ]
    if dtype == mx.bool_:
        parts = [p.astype(bool) for p in parts]
        return (np.any if op in ("sum", "max") else np.all)(parts, axis=0)
    if op == "avg":
        return np.mean(parts, axis=0)
    return NUMPY_REDUCE[op](parts, axis=0)


def ops_for(dtype):
    if dtype == mx.bool_:
        return ["sum", "max", "min", "prod"]
    ops = ["sum", "prod"] + (["avg"] if dtype in FLOATS else [])
    return ops + ([] if dtype == mx.complex64 else ["max", "min"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_every_op_and_dtype(backend, dtype):
    mine = contribution(du.local_rank(backend), dtype)
    for op in ops_for(dtype):
        out = du.allreduce(backend, mine, op)
        assert isinstance(out, mx.array) and out.dtype == dtype and out.shape == mine.shape
        want = expected(backend, dtype, op)
        got = np.array(out.astype(mx.float64) if dtype in (mx.bfloat16, mx.float16) else out)
        np.testing.assert_allclose(
            got, want, rtol=1e-2 if dtype in (mx.float16, mx.bfloat16) else 1e-6, err_msg=op
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bcast_and_allgather_every_dtype(backend, dtype):
    rank, size = du.local_rank(backend), du.total_workers(backend)
    root = size - 1
    out = du.bcast(backend, contribution(rank, dtype, (2, 3)), root=root)
    assert out.dtype == dtype and mx.array_equal(out, contribution(root, dtype, (2, 3))).item()
    gathered = du.allgather(backend, contribution(rank, dtype, (2, 3)))
    assert gathered.shape == (2 * size, 3) and gathered.dtype == dtype
    want = mx.concatenate([contribution(r, dtype, (2, 3)) for r in range(size)])
    assert mx.array_equal(gathered, want).item()


def test_bcast_is_bit_exact(backend):
    specials = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], np.float32)
    bits = specials.view(np.uint32).copy()
    bits[0] = 0x7FC00123  # a NaN with a payload
    if du.local_rank(backend) != 0:
        bits[:] = 0
    out = du.bcast(backend, mx.array(bits.view(np.float32)), root=0)
    assert (
        np.array(out).view(np.uint32)
        == np.array(
            bits if du.local_rank(backend) == 0 else [0x7FC00123, *specials[1:].view(np.uint32)], np.uint32
        )
    ).all()
    mine = (
        np.array([-0.0, np.nan]) if du.local_rank(backend) == 0 else np.array([1.0, 2.0])
    )  # (differs off root)
    out64 = du.bcast(backend, mine, root=0)
    assert np.signbit(out64[0]) and out64[0] == 0 and np.isnan(out64[1])


def test_zero_d_empty_numpy_and_scalars(backend):
    rank, size = du.local_rank(backend), du.total_workers(backend)
    total = sum(range(1, size + 1))
    zero_d = du.allreduce(backend, mx.array(float(rank + 1)), "sum")
    assert zero_d.shape == () and zero_d.item() == total
    empty = du.allreduce(backend, mx.zeros((0, 3)), "sum")
    assert empty.shape == (0, 3)
    assert du.allgather(backend, mx.zeros((0,))).shape == (0,)
    assert du.bcast(backend, mx.zeros((0, 2), mx.int32)).shape == (0, 2)
    np_out = du.allreduce(backend, np.full(3, rank + 1, np.int32), "sum")
    assert isinstance(np_out, np.ndarray) and np_out.dtype == np.int32 and (np_out == total).all()
    assert du.allreduce(backend, rank + 1, operator.add) == total
    assert du.allreduce(backend, float(rank), du.avg) == (size - 1) / 2
    assert du.allreduce(backend, rank == 0, min) is (size == 1)
    assert du.allreduce(backend, rank + 1, max) == size
    assert du.allreduce(backend, 2, operator.mul) == 2**size
    assert du.reduce(backend, rank, "sum", root=0) == size * (size - 1) // 2
    assert du.allgather(backend, mx.array(rank)).tolist() == list(range(size))
    assert du.allgather(backend, {"rank": rank}) == [{"rank": r} for r in range(size)]
    assert du.bcast(backend, f"from {rank}", root=size - 1) == f"from {size - 1}"
    assert du.bcast(backend, None if rank == 0 else 1) is None
    du.barrier(backend)


def test_float64_keeps_its_precision(backend):
    """float64 (numpy and Python floats) must not be rounded through float32 on any backend."""
    size = du.total_workers(backend)
    x = np.array([0.1, 1 + 2**-40])
    out = du.allreduce(backend, x, "sum")
    assert out.dtype == np.float64 and np.array_equal(out, sum([x] * size))
    assert du.allreduce(backend, 1 + 2**-40, "max") == 1 + 2**-40
    assert np.array_equal(du.bcast(backend, x), x) and du.allgather(backend, x).dtype == np.float64


def test_arrays_without_a_flat_buffer(backend):
    """Transposed, broadcast and sliced arrays reduce like their contiguous copies."""
    size = du.total_workers(backend)
    base = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    for x in (base.T, mx.broadcast_to(base[:1], (3, 4)), base[:, ::2]):
        out = du.allreduce(backend, x, "sum")
        assert out.shape == x.shape and mx.array_equal(out, x * size).item()
        assert mx.array_equal(du.bcast(backend, x), x).item()


def test_ranks(backend):
    rank, size = du.local_rank(backend), du.total_workers(backend)
    assert 0 <= rank < size
    assert du.allgather(backend, rank) == list(range(size))
    # all ranks run on this machine under the test launcher
    assert du.node_rank(backend) == rank


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda b: du.allreduce(b, 1, "mean"), ValueError, "unknown reduction op 'mean'"),
        (lambda b: du.allreduce(b, np.arange(3), "avg"), TypeError, "'avg' needs a floating"),
        (
            lambda b: du.allreduce(b, mx.array([1j], mx.complex64), "max"),
            TypeError,
            "not defined for complex",
        ),
        (lambda b: du.allreduce(b, np.array(["a"]), "sum"), TypeError, "dtype <U1 is not supported"),
        (lambda b: du.allreduce(b, np.array([1j]), "sum"), TypeError, "complex128 is not supported"),
        (lambda b: du.allreduce(b, 1j, "sum"), TypeError, "dtype complex128 is not supported"),
        (lambda b: du.allreduce(b, [1, 2], "sum"), TypeError, "cannot reduce a list"),
        (lambda b: du.bcast(b, 1, root=99), ValueError, "root=99 is not a rank"),
        (
            lambda b: du.allreduce(du.MPIBackend, 1, "sum"),
            TypeError,
            "du.get_distributed_backend(du.MPIBackend)",
        ),
        (lambda b: du.initialize(b), TypeError, "not the backend instance"[4:]),
        (lambda b: du.initialize("mpi"), TypeError, "expected a backend class"),
        (lambda b: du.initialize(du.AbstractBackend), TypeError, "is abstract"),
        (lambda b: du.initialize(du.NCCLBackend), du.BackendUnavailableError, "CUDA build of MLX"),
        (lambda b: du.initialize(du.JACCLBackend), du.BackendUnavailableError, "RDMA"),
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(backend, call, error, words):
    with pytest.raises(error, match=None) as info:
        call(backend)
    assert words in str(info.value)


def test_initialize_is_idempotent(backend):
    assert du.initialize(type(backend)) is backend
    assert du.initialized(type(backend)) and du.get_distributed_backend(type(backend)) is backend


@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
        elements=st.floats(allow_nan=True, allow_infinity=True, width=32),
    )
)
def test_bcast_any_float_array_exactly(backend, data):
    """Root's bits arrive unchanged whatever they are (NaN payloads, -0.0, inf, subnormals)."""
    rank = du.local_rank(backend)
    mine = mx.array(data if rank == 0 else np.full_like(data, rank))
    out = du.bcast(backend, mine, root=0)
    assert np.array_equal(np.array(out).view(np.uint32), data.view(np.uint32))


@given(hnp.arrays(np.int64, hnp.array_shapes(max_dims=2, max_side=5), elements=st.integers(-1000, 1000)))
def test_allreduce_matches_allgather_then_reduce(backend, data):
    rank, size = du.local_rank(backend), du.total_workers(backend)
    mine = mx.array(data * (rank + 1))
    gathered = np.array(du.allgather(backend, mine)).reshape((size,) + data.shape)
    for op, reduce in (("sum", np.sum), ("max", np.max), ("min", np.min)):
        assert np.array_equal(np.array(du.allreduce(backend, mine, op)), reduce(gathered, axis=0))
