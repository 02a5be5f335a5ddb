"""Bad input gets the same clear error on every rank (never a hang), and checkpoints round-trip
exactly, on every rank. (The watchdog and dead ranks: tests/test_reliability.py.)"""

import json
import re
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_optimizer import dataset, mlp, train

import distributed_utils as du
from distributed_utils.tree import TreeMismatchError


def other_backend_type(backend):
    return du.RingBackend if isinstance(backend, du.MPIBackend) else du.MPIBackend


def debug_allreduce(backend):
    du.initialize(debug=True)
    try:
        du.allreduce(backend, mx.zeros((2 + backend.rank,)), "sum")
    finally:
        du.initialize(debug=False)


def checkpoint_then_load_other_model(backend, tmp):
    du.save_checkpoint(backend, tmp / "ck", model=nn.Linear(3, 4))
    du.load_checkpoint(backend, tmp / "ck", model=nn.Linear(4, 4))


def load_truncated(backend, tmp):
    du.save_checkpoint(backend, tmp / "ck", model=nn.Linear(3, 4))
    data = (tmp / "ck").read_bytes() if backend.rank == 0 else b""
    (tmp / "ck").write_bytes(data[: len(data) // 2])
    du.load_checkpoint(backend, tmp / "ck", model=nn.Linear(3, 4))


def flip_a_byte(path, key):
    """Flip one bit in the middle of ``key``'s bytes in the checkpoint at ``path`` (rank 0's)."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + n])[key]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def load_a_flipped_byte(backend, tmp):
    du.save_checkpoint(backend, tmp / "ck", model=nn.Linear(30, 40))
    if backend.rank == 0:
        flip_a_byte(tmp / "ck", "model.weight")
    du.load_checkpoint(backend, tmp / "ck", model=nn.Linear(30, 40))


class _Optimizer(optim.SGD):
    def init_single(self, parameter, state):
        state["count"] = 0  # not an array


def save_non_array_leaf(backend, tmp):
    opt = _Optimizer(0.1)
    opt.init({"w": mx.zeros(2)})
    du.save_checkpoint(backend, tmp / "ck", optimizer=opt)


# (what, call(backend, tmp_path), needs 2 ranks, error, words in the message)
BAD_INPUT = [
    ("a backend name", lambda b, t: du.initialize("ring"), False, TypeError, "expected a backend class"),
    ("a backend object", lambda b, t: du.initialize(b), False, TypeError, "got the backend instance"),
    (
        "a backend class to a collective",
        lambda b, t: du.allreduce(type(b), 1, "sum"),
        False,
        TypeError,
        "du.get_distributed_backend(du.",
    ),
    (
        "use before initialize",
        lambda b, t: du.get_distributed_backend(other_backend_type(b)),
        False,
        RuntimeError,
        "is not initialized: call du.initialize(",
    ),
    (
        "a negative timeout",
        lambda b, t: du.initialize(type(b), timeout=-1),
        False,
        ValueError,
        "timeout=-1 is not a number of seconds from 0 to 1e9 (0: never)",
    ),
    (
        "an infinite timeout (faulthandler's timer overflowed: found by an adversarial test)",
        lambda b, t: du.initialize(type(b), timeout=float("inf")),
        False,
        ValueError,
        "timeout=inf is not a number of seconds from 0 to 1e9",
    ),
    (
        "mismatched trees",
        lambda b, t: du.synchronize(b, {"w": mx.zeros((2 + b.rank,))}),
        True,
        TreeMismatchError,
        "first difference at key 'w'",
    ),
    (
        "mismatched gradient trees",
        lambda b, t: du.DistributedOptimizer(b, optim.SGD(0.1)).reduce_gradients({f"w{b.rank}": mx.zeros(2)}),
        True,
        TreeMismatchError,
        "ranks hold different trees",
    ),
    (
        "mismatched shapes (DU_DEBUG)",
        lambda b, t: debug_allreduce(b),
        True,
        du.CollectiveMismatchError,
        "ranks issued different collectives",
    ),
    (
        "a non-array to reduce",
        lambda b, t: du.allreduce(b, [1, 2], "sum"),
        False,
        TypeError,
        "cannot reduce a list",
    ),
    (
        "an optimizer wrapped twice (its sums would be summed again)",
        lambda b, t: du.DistributedOptimizer(b, du.DistributedOptimizer(b, optim.SGD(0.1), op="sum")),
        False,
        TypeError,
        "the optimizer is already distributed (DistributedOptimizer)",
    ),
    (
        "DiLoCo wrapped",
        lambda b, t: du.DistributedOptimizer(b, du.DiLoCo(b, optim.SGD(0.1))),
        False,
        TypeError,
        "the optimizer is already distributed (DiLoCo)",
    ),
    (
        "a non-array leaf in a checkpoint",
        save_non_array_leaf,
        False,
        TypeError,
        "optimizer leaf 'w.count' is a int, not an array",
    ),
    (
        "an unsupported dtype",
        lambda b, t: du.allreduce(b, np.array(["a"]), "sum"),
        False,
        TypeError,
        "dtype <U1 is not supported",
    ),
    (
        "float64 complex",
        lambda b, t: du.bcast(b, np.zeros(2, np.complex128)),
        False,
        TypeError,
        "complex128 is not supported",
    ),
    ("empty data", lambda b, t: du.DistributedDataContainer(b, []), False, ValueError, "data is empty"),
    (
        "a checkpoint of another model",
        checkpoint_then_load_other_model,
        False,
        du.CheckpointError,
        "does not fit the model: at 'weight'",
    ),
    ("a truncated checkpoint", load_truncated, False, du.CheckpointError, "ck is incomplete or corrupt"),
    (
        "a flipped bit in a checkpoint",
        load_a_flipped_byte,
        False,
        du.CheckpointError,
        "ck is damaged: the bytes of 'model.weight' do not match their checksum",
    ),
    (
        "a checkpoint value that is not JSON",
        lambda b, t: du.save_checkpoint(b, t / "ck", extra={1j}),
        False,
        TypeError,
        "must be JSON values",
    ),
    (
        "keep= without a step",
        lambda b, t: du.save_checkpoint(b, t / "ck", keep=2),
        False,
        TypeError,
        "save_checkpoint(keep=...): step must be an int >= 0, got None",
    ),
    (
        "keep= with a negative step (its file would sort as the oldest)",
        lambda b, t: du.save_checkpoint(b, t / "ck", step=-1, keep=2),
        False,
        ValueError,
        "save_checkpoint(keep=...): step must be an int >= 0, got -1",
    ),
]


@pytest.mark.parametrize(
    "what, call, needs_ranks, error, words",
    [
        pytest.param(*row, id=row[0], marks=[pytest.mark.world(min_size=2)] if row[2] else [])
        for row in BAD_INPUT
    ],
)  # rows that need ranks to disagree run in worlds of 2 or more
def test_bad_input_is_a_clear_error_on_every_rank(backend, tmp_path, what, call, needs_ranks, error, words):
    try:
        call(backend, tmp_path)
        got = None
    except Exception as e:
        got = e
    outcomes = du.allgather(backend, (isinstance(got, error) and words in str(got), repr(got)))
    assert all(ok for ok, _ in outcomes), outcomes  # every rank raised it (and none hangs)


DTYPES = [mx.float32, mx.bfloat16, mx.float16, mx.float64, mx.int32, mx.uint8, mx.bool_, mx.complex64]


class Everything(nn.Module):
    """A parameter of every dtype, holding rank-dependent values."""

    def __init__(self, rank):
        super().__init__()
        self.p = {
            str(d).removeprefix("mlx.core."): (mx.arange(6).reshape(2, 3) + rank).astype(d) for d in DTYPES
        }
        self.p["nan"] = mx.array([np.nan, -0.0, np.inf], mx.float32)


def test_a_checkpoint_restores_rank_0s_model_and_state_and_each_ranks_random_state(backend, tmp_path):
    rank = du.local_rank(backend)
    path = du.bcast(backend, str(tmp_path / "ck"))  # rank 0's directory
    model = Everything(rank)
    opt = optim.Adam(1e-3)
    opt.init({"w": mx.ones(3) * rank})
    mx.random.seed(100 + rank)
    du.save_checkpoint(
        backend, path, model=model, optimizer=opt, step=7, data={"epoch": 1, "batch": 2}, extra=[rank]
    )
    saved_params = tree_flatten(Everything(0).parameters())
    draws = mx.random.uniform(shape=(4,))

    restored, opt2 = Everything(rank + 10), optim.Adam(1e-3)
    mx.random.seed(0)
    state = du.load_checkpoint(backend, path, model=restored, optimizer=opt2)
    assert state == {
        "step": 7,
        "data": {"epoch": 1, "batch": 2},
        "extra": [0],
        "world_size": du.total_workers(backend),
    }
    for (key, want), (_, got) in zip(saved_params, tree_flatten(restored.parameters())):
        assert got.dtype == want.dtype, key
        assert np.array_equal(np.array(got.view(mx.uint8)), np.array(want.view(mx.uint8))), key
    assert mx.array_equal(opt2.state["w"]["m"], mx.zeros(3)).item() and opt2.state["step"].dtype == mx.uint64
    assert mx.array_equal(mx.random.uniform(shape=(4,)), draws).item()  # this rank's own stream


def test_a_checkpoint_gives_trees_back_in_their_order(backend, tmp_path):
    """MLX's safetensors header sorts the keys, but a tree's order decides DiLoCo's fragments and
    how gradients are packed (so the order of the sums across 3 or more ranks): it comes back."""
    path = du.bcast(backend, str(tmp_path / "ck"))
    opt = optim.Adam(1e-3)
    opt.init({"z": mx.ones(2), "a": {"y": mx.ones(1), "b": mx.ones(3)}})
    du.save_checkpoint(backend, path, optimizer=opt)
    again = optim.Adam(1e-3)
    du.load_checkpoint(backend, path, optimizer=again)
    keys = [k for k, _ in tree_flatten(opt.state)]
    assert keys != sorted(keys) and [k for k, _ in tree_flatten(again.state)] == keys


def test_loading_a_missing_checkpoint_gives_none_on_every_rank(backend, tmp_path):
    path = du.bcast(backend, str(tmp_path / "none"))
    assert du.load_checkpoint(backend, path, model=nn.Linear(2, 2)) is None


@pytest.mark.world(min_size=2)
def test_debug_mode_shows_each_ranks_collective(backend):
    """How debug mode (and the watchdog's reports) show a collective: its name, each array's dtype and shape,
    its op or root (its numbering: tests/test_reliability.py). Every rank raises, naming every rank's."""
    calls = [
        lambda: du.allreduce(backend, mx.ones((4, 2), mx.bfloat16), du.avg),
        lambda: du.bcast(backend, np.zeros(3, np.int64), root=1),
        lambda: du.bcast(backend, {"an": "object"}),
    ]
    du.initialize(debug=True)
    try:
        with pytest.raises(du.CollectiveMismatchError, match="ranks issued different collectives") as raised:
            calls[min(backend.rank, 2)]()
    finally:
        du.initialize(debug=False)
    shown = re.findall(r"rank (\d+): '#\d+ ([^']*)'", str(raised.value))
    expected = ["allreduce(bfloat16(4, 2), avg)", "bcast(int64(3,), root=1)", "bcast_object(root=0)"]
    assert shown == [(str(r), expected[min(r, 2)]) for r in range(backend.size)], raised.value


@pytest.mark.parametrize("read_only", [False, True])
def test_a_directory_of_checkpoints_falls_back_to_the_newest_intact_one(
    backend, tmp_path, monkeypatch, read_only
):
    """A damaged newest checkpoint is set aside and the one before loads; in a folder where it cannot be set
    aside (read-only), the one before still loads, with a warning that it stays."""
    folder = du.bcast(backend, str(tmp_path / "cks"))
    for step in (1, 2, 3):
        model = nn.Linear(3, 4)
        model.update({"bias": mx.full((4,), float(step))})
        du.save_checkpoint(backend, folder, model=model, step=step, keep=3)
    damaged = tmp_path / "cks" / "step-000000000003.safetensors"
    if du.local_rank(backend) == 0:
        flip_a_byte(damaged, "model.bias")
    if read_only:

        def rename(path, to):
            raise OSError(30, "Read-only file system", str(path))

        monkeypatch.setattr(Path, "rename", rename)
    model = nn.Linear(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = du.load_checkpoint(backend, folder, model=model)
    assert state["step"] == 2 and (np.array(model.bias) == 2.0).all()
    if du.local_rank(backend) == 0:  # rank 0 reads the files, and warns
        said = "could not set aside damaged .*Read-only file system" if read_only else r"\.damaged \(loading"
        assert any(re.search(said, str(w.message)) and "model.bias" in str(w.message) for w in caught), [
            str(w.message) for w in caught
        ]
        assert damaged.exists() == read_only


def test_a_save_after_a_fallback_that_could_not_set_aside_says_its_file_is_in_place(
    backend, tmp_path, monkeypatch
):
    """Found by an adversarial test: where the load could not set the damaged newer checkpoint aside (it
    stays), the next save (of an earlier step) failed to set it aside as superseded and said it "could not
    write" its file, which was in place, and which the next load loaded."""
    folder = du.bcast(backend, str(tmp_path / "cks"))
    for step in (1, 2, 3):
        du.save_checkpoint(backend, folder, model=nn.Linear(3, 4), step=step, keep=3)
    if du.local_rank(backend) == 0:
        flip_a_byte(tmp_path / "cks" / "step-000000000003.safetensors", "model.bias")

    def rename(path, to):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "rename", rename)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert du.load_checkpoint(backend, folder, model=nn.Linear(3, 4))["step"] == 2
    model = nn.Linear(3, 4)
    model.update({"bias": mx.full((4,), 7.0)})
    with pytest.raises(
        du.CheckpointError,
        match=r"could not finish the save after writing .*step-000000000002.safetensors \(it is in place\): "
        r"OSError: .*Read-only file system: .*step-000000000003.safetensors",
    ):
        du.save_checkpoint(backend, folder, model=model, step=2, keep=3)
    loaded = nn.Linear(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert du.load_checkpoint(backend, folder, model=loaded)["step"] == 2
    assert (np.array(loaded.bias) == 7.0).all()


def rewrite_header(path, change):
    """Rewrite the safetensors header of the file at ``path`` with ``change(header)``."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    change(header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n :])


def as_written_before(meta, crc32=True):
    """A checkpoint as an older version wrote it: format 1, no header checksum (nor checksums)."""
    meta["__metadata__"]["distributed_utils"] = meta["__metadata__"]["distributed_utils"].replace(
        du.checkpoint.FORMAT, "distributed_utils.checkpoint/1"
    )
    del meta["__metadata__"]["header_crc32"]
    if not crc32:
        del meta["__metadata__"]["crc32"]


@pytest.mark.parametrize("crc32", [True, False], ids=["format-1", "no-checksums"])
def test_a_checkpoint_of_an_older_version_loads_unverified(backend, tmp_path, crc32):
    """Files written before checksums, or before the checksum of the metadata: they load, with a warning."""
    path = du.bcast(backend, str(tmp_path / "old"))
    du.save_checkpoint(backend, path, model=nn.Linear(3, 4), step=5)
    if du.local_rank(backend) == 0:
        rewrite_header(tmp_path / "old", lambda header: as_written_before(header, crc32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert du.load_checkpoint(backend, path, model=nn.Linear(3, 4))["step"] == 5
    if du.local_rank(backend) == 0:
        said = "written without checksums" if not crc32 else "written without a checksum of its metadata"
        assert any(said in str(w.message) for w in caught), [str(w.message) for w in caught]


OLD_FILE = Path(__file__).parent / "data" / "format-3-one-crc-per-array.safetensors"


def test_a_file_with_one_crc_per_array_loads_and_is_still_verified(backend, tmp_path):
    """Written by the version before one writer (15f9e65: a replicated array's CRC-32 as one int, not a list of
    its pieces'), of ``mx.random.seed(7); nn.Linear(3, 4)`` and a fresh Adam: it loads, checked."""
    _, saved = mx.load(str(OLD_FILE), return_metadata=True)
    assert all(isinstance(crc, int) for crc in json.loads(saved["crc32"]).values())  # (the old form indeed)
    mx.random.seed(7)
    expected = nn.Linear(3, 4)
    model, opt = nn.Linear(3, 4), optim.Adam(1e-2)
    state = du.load_checkpoint(backend, OLD_FILE, model=model, optimizer=opt)
    assert state["step"] == 5 and state["extra"] == {"written by": "distributed_utils at 15f9e65"}
    assert mx.array_equal(model.weight, expected.weight).item() and opt.state["step"].item() == 0
    damaged = du.bcast(backend, str(tmp_path / "damaged"))
    if backend.rank == 0:
        Path(damaged).write_bytes(OLD_FILE.read_bytes())
        flip_a_byte(Path(damaged), "model.weight")
    with pytest.raises(du.CheckpointError, match="the bytes of 'model.weight' do not match their checksum"):
        du.load_checkpoint(backend, damaged, model=model)


FRESH_OPTIMIZERS = {
    "Adam": lambda b: optim.Adam(1e-2),
    "replicated": lambda b: du.DistributedOptimizer(b, optim.Adam(1e-2)),
    "accumulating": lambda b: du.DistributedOptimizer(b, optim.SGD(0.1, momentum=0.9), accumulate_steps=2),
    "sharded": lambda b: du.DistributedOptimizer(b, optim.AdamW(1e-2), shard_optimizer_state=True),
    "DiLoCo": lambda b: du.DiLoCo(b, optim.AdamW(1e-2), sync_every=4, fragments=2, fragment_sync_delay=1),
}


@pytest.mark.parametrize("initialized", [False, True], ids=["into-a-new-one", "into-an-initialized-one"])
@pytest.mark.parametrize("name", FRESH_OPTIMIZERS)
def test_every_optimizer_saves_and_loads_before_its_first_update(backend, tmp_path, name, initialized):
    """#26.9: a job saved (or preempted) at step 0 restarts from it, and trains bit for bit as if
    it had never stopped, whether the new optimizer is initialized before the load (as
    examples/lora.py does) or not."""
    path = du.bcast(backend, str(tmp_path / "ck"))
    x, y = dataset(du.local_rank(backend), 6 * 4)
    batches = [(x[s * 4 : (s + 1) * 4], y[s * 4 : (s + 1) * 4]) for s in range(6)]
    first, opt = mlp(), FRESH_OPTIMIZERS[name](backend)
    du.save_checkpoint(backend, path, model=first, optimizer=opt, step=0)
    train(first, opt, batches)
    again, opt = mlp(seed=1), FRESH_OPTIMIZERS[name](backend)
    if initialized:
        opt.init(again.trainable_parameters())
    assert du.load_checkpoint(backend, path, model=again, optimizer=opt)["step"] == 0
    train(again, opt, batches)
    for (key, a), (_, b) in zip(tree_flatten(first.parameters()), tree_flatten(again.parameters())):
        assert mx.array_equal(a, b).item(), key


def test_an_accumulating_optimizer_is_saved_between_its_cycles(backend, tmp_path):
    """Found by an adversarial test: saved in the middle of a cycle, the gradients summed so far were lost
    (0.13 off the uninterrupted run, silently). Now that is a ValueError on every rank, and the save after
    the cycle's last call stands."""
    path = du.bcast(backend, str(tmp_path / "ck"))
    x, y = dataset(du.local_rank(backend), 2 * 4)
    model, opt = mlp(), FRESH_OPTIMIZERS["accumulating"](backend)
    train(model, opt, [(x[:4], y[:4])])
    with pytest.raises(ValueError, match="at call 1 of an accumulation cycle of 2 its state would lose"):
        du.save_checkpoint(backend, path, model=model, optimizer=opt)
    train(model, opt, [(x[4:], y[4:])])
    du.save_checkpoint(backend, path, model=model, optimizer=opt)
    assert du.load_checkpoint(backend, path, model=mlp(seed=1), optimizer=opt) is not None


def files_in(backend, folder) -> list:
    """The names in ``folder`` as rank 0 sees them, on every rank."""
    return du.bcast(
        backend, sorted(p.name for p in Path(folder).iterdir()) if du.local_rank(backend) == 0 else None
    )


def save_step(backend, folder, step, keep):
    model = nn.Linear(3, 4)
    model.update({"bias": mx.full((4,), float(step))})
    du.save_checkpoint(backend, folder, model=model, step=step, keep=keep)


def loaded_step(backend, folder):
    model = nn.Linear(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = du.load_checkpoint(backend, folder, model=model)["step"]
    assert (np.array(model.bias) == float(step)).all()
    return step


@pytest.mark.parametrize("keep", [1, 2])
def test_saves_after_a_fallback_keep_themselves_and_the_damaged_file_is_set_aside(backend, tmp_path, keep):
    """#26.2: the newest checkpoint (20) is damaged; the load falls back to 15 and sets 20 aside;
    the run goes on from 15 and saves 16 and 17: they stay (keep=1 deleted each before), and a
    load finds the newest of them."""
    folder = du.bcast(backend, str(tmp_path / "cks"))
    for step in (15, 20):
        save_step(backend, folder, step, keep=2)
    if du.local_rank(backend) == 0:
        flip_a_byte(tmp_path / "cks" / "step-000000000020.safetensors", "model.bias")
    assert loaded_step(backend, folder) == 15
    for step in (16, 17):
        save_step(backend, folder, step, keep=keep)
    kept = ["step-000000000016.safetensors"] * (keep == 2) + ["step-000000000017.safetensors"]
    assert files_in(backend, folder) == kept + ["step-000000000020.safetensors.damaged"]
    assert loaded_step(backend, folder) == 17


def test_a_run_resumed_from_an_older_checkpoint_sets_the_later_ones_aside(backend, tmp_path):
    """Steps that go backwards: a run resumed from 15 while 20 is intact (the user's choice) saves
    16; 20 belongs to a trajectory left behind, and must not be what the next load takes."""
    folder = du.bcast(backend, str(tmp_path / "cks"))
    for step in (15, 20):
        save_step(backend, folder, step, keep=3)
    assert loaded_step(backend, f"{folder}/step-000000000015.safetensors") == 15
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_step(backend, folder, 16, keep=3)
    if du.local_rank(backend) == 0:  # rank 0 writes, and warns
        assert any("as step-000000000020.safetensors.superseded" in str(w.message) for w in caught)
    assert files_in(backend, folder) == [
        "step-000000000015.safetensors",
        "step-000000000016.safetensors",
        "step-000000000020.safetensors.superseded",
    ]
    assert loaded_step(backend, folder) == 16
    for step in (20, 17):  # a step 20 again, then once more from 15: the first set aside stays too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_step(backend, folder, step, keep=3)
    assert files_in(backend, folder)[-2:] == [
        "step-000000000020.safetensors.superseded",
        "step-000000000020.safetensors.superseded-2",
    ]


def test_a_killed_saves_temporary_file_goes_at_the_next_save_of_a_keep_folder(backend, tmp_path):
    """#26.3: a temporary file of another step's killed save (another name) goes too."""
    folder = du.bcast(backend, str(tmp_path / "cks"))
    save_step(backend, folder, 1, keep=2)
    if du.local_rank(backend) == 0:
        (tmp_path / "cks" / ".step-000000000002.safetensors.tmp-99999").write_bytes(b"half a checkpoint")
    save_step(backend, folder, 3, keep=2)
    assert files_in(backend, folder) == ["step-000000000001.safetensors", "step-000000000003.safetensors"]


@pytest.mark.parametrize("name", ["sharded", "DiLoCo"])
def test_a_checkpoint_after_updates_loads_into_an_initialized_optimizer(backend, tmp_path, name):
    """The fit is checked on what every rank holds alike (a sharded state's rank may hold no slice;
    DiLoCo's checkpoint holds every rank's local state too): it loads and goes on bit for bit."""
    path = du.bcast(backend, str(tmp_path / "ck"))
    x, y = dataset(du.local_rank(backend), 8 * 4)
    batches = [(x[s * 4 : (s + 1) * 4], y[s * 4 : (s + 1) * 4]) for s in range(8)]
    first, opt = mlp(), FRESH_OPTIMIZERS[name](backend)
    train(first, opt, batches[:3])
    du.save_checkpoint(backend, path, model=first, optimizer=opt, step=3)
    train(first, opt, batches[3:])
    again, opt = mlp(seed=1), FRESH_OPTIMIZERS[name](backend)
    opt.init(again.trainable_parameters())
    du.load_checkpoint(backend, path, model=again, optimizer=opt)
    train(again, opt, batches[3:])
    for (key, a), (_, b) in zip(tree_flatten(first.parameters()), tree_flatten(again.parameters())):
        assert mx.array_equal(a, b).item(), key


@pytest.mark.world(min_size=2)
def test_a_sharded_state_of_which_a_rank_holds_nothing_saves_loads_and_synchronizes(backend, tmp_path):
    """One parameter of one element: rank 1 holds no slice of the state, yet it is initialized
    like the others (before, it said otherwise, and load_checkpoint made a collective the
    others did not)."""
    path = du.bcast(backend, str(tmp_path / "ck"))
    params = {"w": mx.zeros((1,))}
    opt = du.DistributedOptimizer(backend, optim.Adam(1e-2), shard_optimizer_state=True)
    opt.init(params)
    params = opt.apply_gradients({"w": mx.ones((1,))}, params)
    du.save_checkpoint(backend, path, optimizer=opt, step=1)
    again = du.DistributedOptimizer(backend, optim.Adam(1e-2), shard_optimizer_state=True)
    again.init({"w": mx.zeros((1,))})
    du.load_checkpoint(backend, path, optimizer=again)
    du.synchronize(backend, again)
    assert again.whole_state()["w"]["m"].tolist() == opt.whole_state()["w"]["m"].tolist()


def test_a_writer_that_cannot_open_the_file_is_named_on_every_rank(backend, tmp_path, monkeypatch):
    """Found by an adversarial test: rank 0, failing to open its temporary file (too many open files, say),
    raised a TypeError alone while the others waited; now a CheckpointError on every rank, and no file."""
    path = Path(du.bcast(backend, str(tmp_path / "ck")))

    def failing(file, mode="r", *args, **kwargs):
        if mode == "r+b" and backend.rank == 0:
            raise OSError(24, "Too many open files")
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(du.checkpoint, "open", failing, raising=False)
    with pytest.raises(du.CheckpointError, match="rank 0 could not write .*Too many open files"):
        du.save_checkpoint(backend, path, model=nn.Linear(3, 4))
    if backend.rank == 0:
        assert list(path.parent.glob(".ck.tmp-*")) == [] and not path.exists()
