"""du.synchronize: after it every rank holds root's values, bit for bit. Trees are drawn by
hypothesis (the same structure on every rank); their values are a function of the rank, so
every rank can build root's tree and compare."""

import collections
import dataclasses
import fractions
import hashlib
import pickle
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mlx.utils import tree_flatten
from test_collectives import DTYPES

import distributed_utils as du
from distributed_utils.tree import TreeMismatchError

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Tag:
    rank: int


MX_DTYPES = DTYPES  # every dtype that travels
NP_DTYPES = [
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.uint16,
        np.int32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        np.longdouble,
        "<U3",
        "S5",
        "datetime64[ns]",
        [("a", "<i2"), ("b", "<f8")],
    )
]
KEYS = st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True)
SCALARS = ["int", "float", "bool", "complex", "none", "str", "bytes", "object"]
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
leaf_specs = st.one_of(
    st.tuples(st.just("mx"), st.sampled_from(MX_DTYPES), shapes),
    st.tuples(st.just("np"), st.sampled_from(NP_DTYPES), shapes),
    st.tuples(st.sampled_from(SCALARS)),
)
tree_specs = st.recursive(
    leaf_specs,
    lambda kids: st.one_of(
        st.tuples(st.just("list"), st.lists(kids, max_size=4)),
        st.tuples(st.just("tuple"), st.lists(kids, max_size=4)),
        st.tuples(st.just("pair"), st.lists(kids, min_size=2, max_size=2)),
        st.tuples(st.just("dict"), st.dictionaries(KEYS, kids, max_size=4)),
    ),
    max_leaves=12,
)


def random_bits(rng, dtype, shape):
    """An array of ``dtype`` whose bytes are random (NaN payloads, -0.0, padding bytes...)."""
    n = int(np.prod(shape)) * dtype.itemsize
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    return (raw % 2 if dtype == np.bool_ else raw).view(dtype).reshape(shape)


def build(spec, rank, rng=None):
    """The tree ``spec`` describes, with rank ``rank``'s values."""
    rng = np.random.default_rng(rank) if rng is None else rng
    kind, *args = spec
    if kind == "mx":
        dtype, shape = args
        width = np.dtype(f"u{dtype.size}") if dtype != mx.bool_ else np.dtype(np.bool_)
        return mx.array(random_bits(rng, width, shape)).view(dtype)
    if kind == "np":
        return random_bits(rng, *args)
    if kind in ("list", "tuple", "pair"):
        items = [build(s, rank, rng) for s in args[0]]
        return {"list": list, "tuple": tuple, "pair": lambda x: Pair(*x)}[kind](items)
    if kind == "dict":
        return {k: build(s, rank, rng) for k, s in args[0].items()}
    value = rng.integers(0, 2**62)
    return {
        "int": rank * 10**30 + int(value),
        "float": float(rng.choice([-0.0, np.nan, value / 7])),
        "bool": rank % 2 == 0,
        "complex": complex(rank, -0.0),
        "none": None,
        "str": f"rank {rank}",
        "bytes": bytes([rank]) * 3,
        "object": (Tag(rank), fractions.Fraction(rank, 3), frozenset({rank})),
    }[kind]


def bits(a) -> np.ndarray:
    if isinstance(a, mx.array):
        return np.array(a.reshape(-1).view(mx.uint8))
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_identical(got, want, key="x"):
    """Same container types, keys, array kinds, dtypes, shapes and bits; same pickled scalars."""
    assert type(got) is type(want), key
    if isinstance(want, (mx.array, np.ndarray)):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), key
        assert np.array_equal(bits(got), bits(want)), key
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), key
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{key}.{i}")
    elif isinstance(want, dict):
        assert list(got) == list(want), key
        for k in want:
            assert_identical(got[k], want[k], f"{key}.{k}")
    else:  # pickle keeps a float's bits (-0.0, NaN)
        assert pickle.dumps(got) == pickle.dumps(want), key


def fingerprint(tree) -> str:
    h = hashlib.sha256()
    for key, a in tree_flatten(tree):
        h.update(key.encode() + str(a.dtype).encode() + bits(a).tobytes())
    return h.hexdigest()


def same_everywhere(backend, value) -> bool:
    return all(v == value for v in du.allgather(backend, value))


@given(spec=tree_specs, root=st.integers(0, 3))
def test_every_rank_gets_roots_tree_bit_for_bit(backend, spec, root):
    rank, size = du.local_rank(backend), du.total_workers(backend)
    root %= size
    mine = build(spec, rank)
    out = du.synchronize(backend, mine, root=root)
    assert_identical(out, build(spec, root))
    if rank == root:
        assert out is mine
    else:
        assert_identical(mine, build(spec, rank))  # the input is left as it was


def test_special_floats_arrive_exactly(backend):
    rank = du.local_rank(backend)
    specials = np.array([0x7FC00123, 0xFFC00001, 0x80000000, 0x7F800000, 0x00000001, 0x7F800001], np.uint32)
    tree = {
        "f32": mx.array(specials).view(mx.float32),
        "f64": np.array([-0.0, np.nan, -np.inf]),
        "f16": mx.array(specials.astype(np.uint16)).view(mx.float16),
        "bf16": mx.array((specials >> 16).astype(np.uint16)).view(mx.bfloat16),
    }
    other = {
        k: np.full_like(v, rank) if isinstance(v, np.ndarray) else mx.full(v.shape, rank, v.dtype)
        for k, v in tree.items()
    }
    mine = tree if rank == 0 else other
    out = du.synchronize(backend, mine)
    assert_identical(out, tree)
    assert np.signbit(out["f64"][0]) and np.isnan(out["f64"][1])


def test_local_rank_gives_root(backend):
    for root in range(du.total_workers(backend)):
        assert du.synchronize(backend, du.local_rank(backend), root=root) == root


def test_non_array_leaves_and_containers_are_roots_whatever_they_are_elsewhere(backend):
    rank = du.local_rank(backend)
    config = {"lr": 0.1, "name": "run", "tags": ("a", Tag(0))}
    assert du.synchronize(backend, config if rank == 0 else None) == config
    out = du.synchronize(backend, {"w": mx.full((2,), rank), "epoch": 7 if rank == 0 else None})
    assert out["epoch"] == 7 and out["w"].tolist() == [0, 0]
    tree = collections.OrderedDict(w=mx.full((2,), rank), seen=collections.defaultdict(list, {"a": [rank]}))
    out = du.synchronize(backend, tree)
    assert type(out) is collections.OrderedDict and out["w"].tolist() == [0, 0]
    assert type(out["seen"]) is collections.defaultdict and out["seen"]["a"] == [0] and out["seen"]["b"] == []


def test_a_tree_travels_in_one_broadcast_per_item_size(backend, monkeypatch):
    calls = collections.Counter()
    for name in ("bcast", "allgather", "allreduce"):

        def counted(*args, _name=name, _original=getattr(backend, name)):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(backend, name, counted)
    tree = {
        "layers": [{"w": mx.zeros((8, 8 + i)), "b": mx.zeros((8,), mx.bfloat16)} for i in range(50)],
        "step": mx.array(3, mx.int64),
        "mask": np.ones(5, bool),
        "name": "x",
        "n": 3,
    }
    du.initialize(debug=False)  # (debug mode adds allgathers of its own)
    du.synchronize(backend, tree)
    # one allgather to check the structure, two broadcasts for the pickle (size, bytes) and one
    # allgather for every rank to say it could unpickle it, one broadcast per item size (1, 2, 4, 8 bytes)
    want = {} if du.total_workers(backend) == 1 else {"allgather": 1 + 1, "bcast": 2 + 4}
    assert dict(calls) == want


def test_arrays_travel_in_runs_of_bounded_size(backend, monkeypatch):
    monkeypatch.setattr(sys.modules["distributed_utils.synchronize"], "BROADCAST_BUCKET_BYTES", 100)
    calls = collections.Counter()
    monkeypatch.setattr(
        backend, "bcast", lambda *a, _bcast=backend.bcast: calls.update(["bcast"]) or _bcast(*a)
    )
    rank = du.local_rank(backend)
    tree = [mx.arange(n, dtype=mx.float32) + rank for n in (10, 10, 30, 5, 0, 40)] + [np.arange(7) * rank]
    out = du.synchronize(backend, tree)
    assert_identical(
        out, [mx.arange(n, dtype=mx.float32) for n in (10, 10, 30, 5, 0, 40)] + [np.arange(7) * 0]
    )
    # 4-byte runs [40 + 40], [120] (alone, over the limit), [20 + 0], [160]; 8-byte [56]; plus the pickle
    assert calls["bcast"] == (0 if du.total_workers(backend) == 1 else 2 + 5)


class Net(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.layers = [nn.Linear(4, width), nn.Linear(width, 2)]
        self.norm = nn.BatchNorm(width)
        self.head = nn.Linear(2, 2)
        self.head.freeze()

    def __call__(self, x):
        return self.head(self.layers[1](nn.relu(self.norm(self.layers[0](x)))))


def train_step(model, opt, seed):
    x = mx.random.normal((16, 4), key=mx.random.key(seed))
    loss_and_grad = nn.value_and_grad(model, lambda x: (model(x) ** 2).mean())
    _, grads = loss_and_grad(x)
    opt.update(model, grads)
    mx.eval(model.parameters(), opt.state)


def test_module_and_adam_trained_on_root_only_are_everywhere(backend):
    rank, size = du.local_rank(backend), du.total_workers(backend)
    root = size - 1
    mx.random.seed(rank)
    model, opt = Net(), optim.Adam(1e-2)
    if rank == root:
        train_step(model, opt, seed=0)
        opt.learning_rate = 0.5
    before = fingerprint(model.parameters()), fingerprint(opt.state)
    assert size == 1 or not same_everywhere(backend, before[0])  # the test could fail
    roots = du.allgather(backend, before)[root]

    assert du.synchronize(backend, model, root=root) is model
    assert du.synchronize(backend, opt, root=root, model=model) is opt  # model= initializes opt elsewhere
    # parameters() has the frozen head and BatchNorm's running statistics: they differed too
    assert (fingerprint(model.parameters()), fingerprint(opt.state)) == roots
    assert opt.step.item() == 1 and opt.learning_rate.item() == 0.5
    train_step(model, opt, seed=1)  # the same step everywhere keeps them identical
    assert same_everywhere(backend, (fingerprint(model.parameters()), fingerprint(opt.state)))
    assert opt.step.item() == 2


def test_root_and_a_world_of_one_get_x_itself(backend):
    rank = du.local_rank(backend)
    x, model = {"a": np.full(4, rank), "s": "x"}, Net()
    params = tree_flatten(model.parameters())
    out = du.synchronize(backend, x)
    assert du.synchronize(backend, model) is model
    if rank == 0:
        assert out is x and all(a is b for (_, a), (_, b) in zip(tree_flatten(model.parameters()), params))
    else:  # new numpy arrays; the input is left as it was
        assert out["a"] is not x["a"] and out["a"].tolist() == [0] * 4 and x["a"].tolist() == [rank] * 4


def test_an_uninitialized_optimizer_is_a_clear_error(backend):
    with pytest.raises(ValueError, match=r"opt.init\(model.trainable_parameters\(\)\)"):
        du.synchronize(backend, optim.SGD(0.1, momentum=0.9))
    opt = du.synchronize(backend, optim.SGD(0.1, momentum=0.9), model=nn.Linear(2, 3))
    assert set(opt.state) == {"step", "learning_rate", "weight", "bias"}


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda r: threading.Lock() if r == 0 else None, TypeError, "pickle"),
        (lambda r: {"m": nn.Linear(2, 2)}, TypeError, "a tree holds a Linear: synchronize it on its own"),
    ],
)
def test_what_root_cannot_send_raises_on_every_rank(backend, make, error, words):
    if du.total_workers(backend) == 1:  # nothing is sent
        x = make(0)
        assert du.synchronize(backend, x) is x
        return
    with pytest.raises(error, match=words):
        du.synchronize(backend, make(du.local_rank(backend)))
    assert du.synchronize(backend, du.local_rank(backend)) == 0  # the job goes on


def last_differs(backend, same, different):
    return different if du.local_rank(backend) == du.total_workers(backend) - 1 else same


def adam_initialized_but_on_last(backend):
    opt = optim.Adam(0.1)
    if du.local_rank(backend) != du.total_workers(backend) - 1:
        opt.init(nn.Linear(2, 2).trainable_parameters())
    return opt


MISMATCHES = {
    "shape": (lambda b: {"a": mx.zeros(3), "b": mx.zeros(last_differs(b, 4, 5))}, "'b'", "shape (5,)"),
    "dtype": (lambda b: [np.zeros(2, last_differs(b, np.float32, np.int32))], "'0'", "int32 array"),
    "key": (
        lambda b: last_differs(b, {"w": mx.zeros(2)}, {"w": mx.zeros(2), "v": mx.zeros(1)}),
        "'v'",
        "no such key",
    ),
    "array vs int": (lambda b: {"w": last_differs(b, mx.zeros(2), 2)}, "'w'", "no such key"),
    "module": (lambda b: nn.Linear(3, last_differs(b, 4, 5)), "'weight'", "shape (5, 3)"),
    "optimizer": (adam_initialized_but_on_last, "'weight.m'", "opt.init(model.trainable_parameters())"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_a_mismatch_raises_on_every_rank_naming_key_and_rank(backend, case):
    make, key, words = MISMATCHES[case]
    x, size = make(backend), du.total_workers(backend)
    if size == 1:  # nothing to compare with: x is returned as it is (an empty optimizer is an error)
        if isinstance(x, optim.Optimizer):
            with pytest.raises(ValueError, match="not initialized"):
                du.synchronize(backend, x)
        else:
            assert du.synchronize(backend, x) is x
        return
    with pytest.raises(TreeMismatchError) as info:  # (a hang instead would end the job at the watchdog)
        du.synchronize(backend, x)
    message = str(info.value)
    assert key in message and words in message and f"ranks [{size - 1}] differ from rank 0" in message
    assert same_everywhere(backend, message)
    assert du.synchronize(backend, du.local_rank(backend)) == 0  # the job goes on
