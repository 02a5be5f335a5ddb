"""du.fully_shard alone and under the launcher: N ranks train like one process on the union of
their batches (and bit for bit like the replicated DistributedOptimizer), each rank holding
1/N of the parameters, gradients and optimizer state; frozen parameters, compute dtypes,
clipping, checkpoints, groups, and MLX's own sharded layers."""

import gc
import math
import re
import shutil
import tempfile
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.nn.layers import distributed as mlx_sharded
from mlx.utils import tree_flatten, tree_map
from primitives import counted
from test_optimizer import compiled_step

import distributed_utils as du
from distributed_utils import fsdp


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d + 1)  # (odd sizes: no axis divides by N)
        self.down = nn.Linear(2 * d + 1, d)

    def __call__(self, x):
        return x + self.down(nn.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d=5, blocks=3):
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.blocks = [Block(d) for _ in range(blocks)]
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, 2)

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def loss_fn(model, x, y):
    return nn.losses.mse_loss(model(x), y)


def net(seed=0, **kwargs):
    mx.random.seed(seed)
    model = Net(**kwargs)
    mx.eval(model.parameters())
    return model


def sharded(backend, model, **kwargs):
    for block in model.blocks:
        du.fully_shard(backend, block, **kwargs)
    return du.fully_shard(backend, model, **kwargs)


def batches(backend, steps=3, per_rank=4):
    """Every rank's batches of each step (the same on every rank), and this rank's."""
    mx.random.seed(7)
    every = [(mx.random.normal((per_rank * backend.size, 3)), mx.random.normal((per_rank * backend.size, 2)))]
    every += [(mx.random.normal(x.shape), mx.random.normal(y.shape)) for x, y in every * (steps - 1)]
    rows = slice(backend.rank * per_rank, (backend.rank + 1) * per_rank)
    return every, [(x[rows], y[rows]) for x, y in every]


def train(model, opt, steps):
    step = nn.value_and_grad(model, loss_fn)
    for x, y in steps:
        _, grads = step(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    return model


def whole(backend, model) -> dict:
    """``model``'s parameters whole, as a user gets them: ``du.save_adapters(..., trainable_only=False)``."""
    folder = du.bcast(backend, tempfile.mkdtemp() if backend.rank == 0 else None)
    du.save_adapters(backend, f"{folder}/whole.safetensors", model, trainable_only=False)
    arrays = mx.load(f"{folder}/whole.safetensors")
    du.barrier(backend)  # (every rank has read it)
    if backend.rank == 0:
        shutil.rmtree(folder)
    return arrays


def assert_close(a, b, atol=2e-5):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape, key
        assert mx.allclose(a[key], b[key], atol=atol).item(), (key, mx.abs(a[key] - b[key]).max().item())


@pytest.mark.parametrize("reshard", [True, False])
def test_n_ranks_train_like_one_process_on_the_union(backend, reshard):
    every, mine = batches(backend)
    model = train(
        sharded(backend, net(), reshard_after_forward=reshard),
        du.DistributedOptimizer(backend, optim.Adam(1e-2)),
        mine,
    )
    one = train(net(), optim.Adam(1e-2), every)
    assert_close(whole(backend, model), dict(tree_flatten(one.parameters())))


class Peek(nn.Linear):
    seen = []  # what each call saw

    def __call__(self, x):
        Peek.seen.append(("linear", self.weight.ndim))
        return super().__call__(x)


class Dropping(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = Peek(d, 2 * d + 1), Peek(2 * d + 1, d)

    def __call__(self, x):
        Peek.seen.append(("block", self.up.weight.ndim, self.down.weight.ndim))
        return x + self.down(nn.Dropout(0.5)(nn.gelu(self.up(x))))


def test_layers_sharded_before_their_block_hold_their_whole_parameters_in_their_own_call_alone(backend):
    """Each layer a unit of its own (sharded before its block): its whole parameters live in its own call,
    forward and backward (where only it is recomputed); the block sees its layers' shards and runs once
    (dropout in it composes), and its gradients are those of one process. The block alone recomputes
    itself in the backward pass, and so refuses to draw random numbers, compiled too."""
    mx.random.seed(0)
    block, one, alone = Dropping(5), Dropping(5), du.fully_shard(backend, Dropping(5))
    for unit in (block.up, block.down, block):
        du.fully_shard(backend, unit)
    one.update(fsdp.whole_tree(block.parameters(), fsdp.sharded(block)))
    x, Peek.seen[:] = mx.random.normal((4, 5)), []
    grads = []
    for model in (block, one):
        mx.random.seed(1)  # (the same dropout mask on every rank and in the one process)
        grads.append(nn.value_and_grad(model, lambda m, x: m(x).sum())(model, x)[1])
    assert Peek.seen[:5] == [("block", 1, 1)] + [("linear", 2)] * 4, Peek.seen
    sharded = dict(tree_flatten(fsdp.whole_tree(grads[0], fsdp.sharded(block))))
    assert_close(sharded, dict(tree_flatten(grads[1])), atol=1e-6)
    for compiled in (False, True):  # (found by review: a compiled step was silently wrong)
        step = lambda x: nn.value_and_grad(alone, lambda m, x: m(x).sum())(alone, x)  # noqa: E731
        with pytest.raises(ValueError, match="draws random numbers"):
            (mx.compile(step, inputs=[mx.random.state], outputs=[mx.random.state]) if compiled else step)(x)


def test_like_the_replicated_optimizer_bit_for_bit_at_two_ranks(backend):
    """The same sums of the same gradients, scaled alike (at 3 or more ranks a sum's order may
    differ from the all-reduce's: to rounding)."""
    _, mine = batches(backend)
    opt, replicated_opt = (du.DistributedOptimizer(backend, optim.AdamW(1e-2)) for _ in range(2))
    model = train(sharded(backend, net()), opt, mine)
    replicated = train(net(), replicated_opt, mine)
    expected = dict(tree_flatten(replicated.parameters()))
    # the optimizer's whole_state is whole (its shards gathered), as the replicated optimizer's state
    expected_state, state = dict(tree_flatten(replicated_opt.state)), dict(tree_flatten(opt.whole_state()))
    assert state.keys() == expected_state.keys()
    assert all(state[k].shape == a.shape for k, a in expected_state.items())
    # which loads back as this rank's shards (found by an adversarial test: the whole entries were kept)
    again = du.DistributedOptimizer(backend, optim.AdamW(1e-2))
    again.load_whole_state(opt.whole_state(), model=model)
    held, loaded = dict(tree_flatten(opt.state)), dict(tree_flatten(again.state))
    assert loaded.keys() == held.keys() and all(mx.array_equal(loaded[k], a).item() for k, a in held.items())
    if backend.size > 2:
        assert_close(state, expected_state, atol=1e-6)
        return assert_close(whole(backend, model), expected, atol=1e-6)
    for key, a in {**whole(backend, model), **state}.items():
        assert mx.array_equal(a, {**expected, **expected_state}[key]).item(), key


def test_each_rank_holds_one_nth_of_the_parameters_and_state(backend):
    model, full = sharded(backend, net()), net()
    opt = du.DistributedOptimizer(backend, optim.Adam(1e-2))
    _, mine = batches(backend, steps=1)
    train(model, opt, mine)
    mine_params, whole_params = dict(tree_flatten(model.parameters())), dict(tree_flatten(full.parameters()))
    assert mine_params.keys() == whole_params.keys()
    for key, shard in mine_params.items():
        assert shard.shape == (math.ceil(whole_params[key].size / backend.size),), key
        assert dict(tree_flatten(opt.state))[key + ".m"].shape == shard.shape
    # each shard is this rank's part of rank 0's parameters (fully_shard starts from rank 0's values)
    fresh = sharded(backend, net(seed=backend.rank))  # other values on other ranks
    assert_close(whole(backend, fresh), dict(tree_flatten(net(seed=0).parameters())), atol=0)


def test_frozen_parameters_are_gathered_and_never_reduced(backend):
    every, mine = batches(backend)
    model, one = net(), net()
    model.embed.freeze()
    one.embed.freeze()
    model = sharded(backend, model)
    frozen_before = dict(tree_flatten(model.embed.parameters()))
    model = train(model, du.DistributedOptimizer(backend, optim.SGD(0.1)), mine)
    train(one, optim.SGD(0.1), every)
    assert_close(whole(backend, model), dict(tree_flatten(one.parameters())))
    for key, a in tree_flatten(model.embed.parameters()):
        assert mx.array_equal(a, frozen_before[key]).item()


def test_a_compute_dtype_gathers_and_computes_in_it_and_keeps_the_parameters(backend):
    every, mine = batches(backend)
    model = sharded(backend, net(), compute_dtype=mx.bfloat16)
    train(model, du.DistributedOptimizer(backend, optim.SGD(0.1)), mine)
    assert all(a.dtype == mx.float32 for _, a in tree_flatten(model.parameters()))
    one = net()
    one.set_dtype(mx.bfloat16)
    train(one, optim.SGD(0.1), every)
    assert_close(
        whole(backend, model), {k: a.astype(mx.float32) for k, a in tree_flatten(one.parameters())}, atol=3e-2
    )


def test_clip_grad_norm_is_the_norm_over_every_ranks_shards(backend):
    every, mine = batches(backend, steps=1)
    model = sharded(backend, net())
    _, grads = nn.value_and_grad(model, loss_fn)(model, *mine[0])
    clipped, norm = du.clip_grad_norm(backend, grads, 0.01)
    one = net()
    _, full = nn.value_and_grad(one, loss_fn)(one, *every[0])
    expected, expected_norm = optim.clip_grad_norm(full, 0.01)
    assert abs(norm.item() - expected_norm.item()) < 1e-5 * expected_norm.item()
    gathered = dict(tree_flatten(fsdp.whole_tree(clipped, fsdp.sharded(model))))
    assert_close(gathered, dict(tree_flatten(expected)), atol=1e-7)


def not_in_one_folder(monkeypatch, backend):
    """The last rank does not see rank 0's folder (on another host, without a shared file system)."""

    def elsewhere(path, *_):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    if backend.rank == backend.size - 1 > 0:
        monkeypatch.setattr(du.checkpoint, "open", elsewhere, raising=False)


@pytest.mark.parametrize("folder", ["shared", "not shared"])
def test_a_checkpoint_holds_the_whole_model_and_resumes_bit_for_bit(backend, tmp_path, monkeypatch, folder):
    """Each rank writes its own shards into the file where every rank sees rank 0's folder; else rank 0
    writes all, gathering one shard at a time. The same file either way: the whole model, loadable anywhere."""
    if folder == "not shared":
        not_in_one_folder(monkeypatch, backend)
    written = []  # (this rank's arrays written)
    monkeypatch.setattr(du.checkpoint, "_write_pieces", lambda f, data, _: written.append(f.write(data)))
    _, mine = batches(backend, steps=4)
    path = tmp_path / "ck.safetensors" if backend.rank == 0 else None
    path = du.bcast(backend, str(path))
    model, opt = sharded(backend, net()), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    train(model, opt, mine[:2])
    du.save_checkpoint(
        backend, path, model=model, optimizer=opt, step=2, extra={"from": "rank " * backend.rank}
    )
    writers = du.allgather(backend, len(written) > 0)
    assert writers == [True] * backend.size if folder == "shared" else [True] + [False] * (backend.size - 1)
    train(model, opt, mine[2:])
    again, opt2 = sharded(backend, net(seed=3)), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    assert du.load_checkpoint(backend, path, model=again, optimizer=opt2)["extra"] == {"from": ""}  # rank 0's
    train(again, opt2, mine[2:])
    resumed, expected = (
        whole(backend, again),
        whole(backend, model),
    )  # (each a gather of every parameter: once)
    for key, a in expected.items():
        assert mx.array_equal(a, resumed[key]).item(), key
    saved = mx.load(path)  # the whole parameters, at their own keys (a plain safetensors file)
    assert saved["model.head.weight"].shape == (2, 5)
    weights = du.bcast(backend, str(tmp_path / "weights.safetensors"))  # consolidated, as mlx-lm reads
    du.save_adapters(backend, weights, model, trainable_only=False)
    plain = net(seed=5).load_weights(weights)
    for key, a in tree_flatten(plain.parameters()):
        assert mx.array_equal(a, expected[key]).item(), key


def test_every_rank_writing_and_rank_0_writing_all_give_the_same_bytes(backend, tmp_path, monkeypatch):
    """The one writer: each rank its own pieces (one folder), or rank 0 every piece (not), in writes of at
    most ``_PIECE_BYTES`` (here 40: a piece in several writes, a barrier after each 40 bytes of rank 0's):
    the same file, byte for byte, as one save in 64 MiB writes."""
    folder = Path(du.bcast(backend, str(tmp_path)))
    model, opt = sharded(backend, net()), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    train(model, opt, batches(backend, steps=1)[1])
    du.save_checkpoint(backend, folder / "whole", model=model, optimizer=opt, step=1)
    monkeypatch.setattr(du.checkpoint, "_PIECE_BYTES", 40)
    du.save_checkpoint(backend, folder / "shared", model=model, optimizer=opt, step=1)
    not_in_one_folder(monkeypatch, backend)
    du.save_checkpoint(backend, folder / "not shared", model=model, optimizer=opt, step=1)
    if backend.rank == 0:
        whole = (folder / "whole").read_bytes()
        assert (folder / "shared").read_bytes() == whole and (folder / "not shared").read_bytes() == whole


@pytest.mark.world(min_size=2)
def test_no_rank_holds_the_whole_model_to_save_or_load_it(backend, tmp_path, monkeypatch):
    path = du.bcast(backend, str(tmp_path / "ck.safetensors"))

    def trained(seed):  # 8 sharded layers of 32 KB, and Adam's m and v
        mx.random.seed(seed)
        layers = [du.fully_shard(backend, nn.Linear(90, 90, bias=False)) for _ in range(8)]
        model, opt = (
            du.fully_shard(backend, nn.Sequential(*layers)),
            du.DistributedOptimizer(backend, optim.Adam(0.1)),
        )
        opt.update(model, nn.value_and_grad(model, lambda m: m(mx.ones((2, 90))).sum())(model)[1])
        mx.eval(model.parameters(), opt.state)
        return model, opt

    def extra_peak(run):  # MLX's peak memory above what this rank held before
        gc.collect()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        run()
        return mx.get_peak_memory() - before

    (model, opt), (again, opt2) = trained(0), trained(1)
    saving = extra_peak(lambda: du.save_checkpoint(backend, path, model=model, optimizer=opt))
    monkeypatch.setattr(du.checkpoint, "_PIECE_BYTES", 2**12)  # (sent back one array at a time)
    loading = extra_peak(lambda: du.load_checkpoint(backend, path, model=again, optimizer=opt2))
    everything, largest = 3 * 8 * 90 * 90 * 4, 90 * 90 * 4
    assert saving < 4 * largest < everything / backend.size, (saving, largest, everything)
    # loading: its new shards, and a few copies of the parameter in flight
    assert loading < everything / backend.size + 8 * largest < everything, (loading, largest, everything)
    resumed, expected = (
        whole(backend, again),
        whole(backend, model),
    )  # (each a gather of every parameter: once)
    for key, a in expected.items():
        assert mx.array_equal(a, resumed[key]).item(), key


def test_a_disk_that_fills_halfway_through_a_sharded_save_fails_on_every_rank(backend, tmp_path, monkeypatch):
    folder = du.bcast(backend, str(tmp_path))
    model, opt = sharded(backend, net()), du.DistributedOptimizer(backend, optim.Adam(1e-2))
    train(model, opt, batches(backend, steps=1)[1])
    written = []

    def full(f, data, heartbeat):  # the last rank's disk fills at the third array it writes
        written.append(data)
        if len(written) == 3 and backend.rank == backend.size - 1:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(du.checkpoint, "_write_pieces", full)
    last = backend.size - 1  # (each rank writes its shards: one folder seen by every rank)
    with pytest.raises(du.CheckpointError, match=f"rank {last} could not write .*No space left on device"):
        du.save_checkpoint(backend, f"{folder}/ck.safetensors", model=model, optimizer=opt)
    assert du.allgather(backend, sorted(p.name for p in tmp_path.iterdir())) == [[]] * backend.size
    train(model, opt, batches(backend, steps=1)[1])  # (the ranks are still in step)


def test_once_a_model_was_fully_sharded_an_optimizer_without_model_is_refused_on_every_rank(
    backend, tmp_path
):
    """Whether a plain optimizer's state holds shards only the model tells: once ``du.fully_shard`` ran in
    the process, an optimizer is refused without ``model=``, on every rank alike, whether that model lives or
    not (a garbage collector's reach differs by rank; found by the suite). With ``model=``: as usual."""
    opt, model = optim.SGD(0.1, momentum=0.9), net()
    opt.init(model.trainable_parameters())
    opt.state["step"] = mx.array(backend.rank)
    du.fully_shard(backend, net())
    gc.collect()  # (that module is gone)
    path = du.bcast(backend, str(tmp_path / "ck.safetensors"))
    for call in (
        lambda: du.synchronize(backend, opt),
        lambda: du.save_checkpoint(backend, path, optimizer=opt),
    ):
        with pytest.raises(ValueError, match=r"may hold the state of a fully sharded model's shards.*model="):
            call()
    du.synchronize(backend, opt, model=model)
    assert opt.state["step"].item() == 0  # (root's)


def test_refused_where_it_cannot_be_right(backend):
    _, mine = batches(backend, steps=1)
    model = sharded(backend, net())
    _, grads = nn.value_and_grad(model, loss_fn)(model, *mine[0])
    with pytest.raises(ValueError, match="averaged in its backward pass"):
        du.DistributedOptimizer(backend, optim.SGD(0.1)).update(model, grads, weight=1.0)
    with pytest.raises(ValueError, match="element-by-element"):
        du.DistributedOptimizer(backend, optim.Adafactor()).update(model, grads)
    with pytest.raises(ValueError, match="use update"):
        du.DistributedOptimizer(backend, optim.SGD(0.1)).apply_gradients(grads, model.parameters())
    with pytest.raises(ValueError, match="DiLoCo does not compose with du.fully_shard"):
        du.DiLoCo(backend, optim.SGD(0.1)).update(model, grads)
    plain = net()  # (an unsharded model tells DiLoCo it holds no shards; a tree of parameters cannot)
    plain_grads = nn.value_and_grad(plain, loss_fn)(plain, *mine[0])[1]
    du.DiLoCo(backend, optim.SGD(0.1)).update(plain, plain_grads)
    with pytest.raises(ValueError, match=r"DiLoCo: the optimizer may hold .* \(use update\(model"):
        du.DiLoCo(backend, optim.SGD(0.1)).apply_gradients(plain_grads, plain.parameters())
    norm = du.fully_shard(backend, nn.BatchNorm(3))  # (training: it assigns its running statistics)
    with pytest.raises(ValueError, match=r"assigned \['running_mean', 'running_var'\]"):
        norm(mx.ones((2, 3)))
    tied = nn.Sequential(nn.Linear(3, 3))
    tied.layers.append(tied.layers[0])  # (one frozen layer at two keys: no assignment, found by review)
    tied.freeze()
    assert du.fully_shard(backend, tied)(mx.ones((2, 3))).shape == (2, 3)


@pytest.mark.world(min_size=2)
def test_mlx_own_sharded_layers_are_refused_on_every_rank(backend, tmp_path):
    group = backend.group if isinstance(backend, du.MLXBackend) else mx.distributed.init()  # (MPI: MLX's)
    model = nn.Sequential(
        mlx_sharded.AllToShardedLinear.from_linear(nn.Linear(4, 4 * backend.size), group=group)
    )
    for call in (
        lambda: du.synchronize(backend, model),
        lambda: du.DistributedOptimizer(backend, optim.SGD(0.1)).update(model, model.parameters()),
        lambda: du.save_checkpoint(backend, tmp_path / "x", model=model),
        lambda: du.load_checkpoint(backend, tmp_path / "x", model=model),
        lambda: du.DiLoCo(backend, optim.SGD(0.1)).update(model, model.parameters()),
        lambda: du.fully_shard(backend, model),
    ):
        with pytest.raises(ValueError, match="AllToShardedLinear"):
            call()


def test_split_gives_a_backend_over_the_ranks_of_a_color(backend):
    if isinstance(backend, du.RingBackend) and backend.size > 1:
        with pytest.raises(du.BackendUnavailableError, match="cannot split"):
            du.split(backend, backend.rank % 2)
        return
    # (found by an adversarial test: rank 0 alone raised, and the others waited in the split)
    with pytest.raises(ValueError, match=r"du.split: rank 0's color must be an int in \[0, 2147483647\]"):
        du.split(backend, 2**31 if backend.rank == 0 else 0)
    pairs = du.split(backend, backend.rank // 2)
    assert pairs.size == min(2, backend.size - backend.rank // 2 * 2) and pairs.rank == backend.rank % 2
    assert du.allreduce(pairs, float(backend.rank), "sum") == sum(
        range(backend.rank // 2 * 2, backend.rank // 2 * 2 + pairs.size)
    )


@pytest.mark.world(min_size=4, backend=(du.MPIBackend, du.MLXMPIBackend))  # (MLX's ring cannot split)
def test_hybrid_sharding_shards_within_a_group_and_averages_across(backend):
    every, mine = batches(backend)
    local, across = du.split(backend, backend.rank // 2), du.split(backend, backend.rank % 2)
    model = train(sharded(local, net()), du.DistributedOptimizer(across, optim.Adam(1e-2)), mine)
    _, grads = nn.value_and_grad(model, loss_fn)(model, *mine[0])
    with pytest.raises(ValueError, match="element-by-element"):  # (the shards of another group's units)
        du.DistributedOptimizer(across, optim.Adafactor()).update(model, grads)
    # over the whole job (found by an adversarial test: it told to synchronize the parameters, in vain)
    with pytest.raises(ValueError, match="give the optimizer one across the ranks of a shard"):
        du.DistributedOptimizer(backend, optim.Adam(1e-2)).update(model, grads)
    plain = optim.Adam(1e-2)  # (its state may be shards of another group's units: refused without model=)
    plain.init(model.trainable_parameters())
    with pytest.raises(ValueError, match="pass model="):
        du.synchronize(across, plain)
    one = train(net(), optim.Adam(1e-2), every)
    assert_close(whole(backend, model), dict(tree_flatten(one.parameters())))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_the_reduce_scatter_of_every_backend_is_its_part_of_the_sum(backend, dtype):
    """Exact on integers: rank r's part of the all-reduce, scaled (MPI's Reduce_scatter; MLX's ring
    and MPI: a ring of send/recv; NCCL and JACCL: sum_scatter), of 0 to 40001 elements a rank."""
    mx.random.seed(backend.rank)
    for n in (0, backend.size, 1000 * backend.size, 40001 * backend.size):
        x = mx.random.randint(-32, 32, (n,)).astype(dtype)  # (every partial sum exact in bfloat16)
        c = n // backend.size
        whole = du.allreduce(backend, x, "sum")
        expected = (whole[backend.rank * c : (backend.rank + 1) * c] * 0.5).astype(dtype)
        assert mx.array_equal(backend.reduce_scatter(x, 0.5), expected).item()


def test_accumulation_and_a_schedule_train_like_one_process(backend):
    every, mine = batches(backend, steps=4)
    schedule = lambda: optim.Adam(optim.cosine_decay(1e-2, 4))  # noqa: E731
    model = sharded(backend, net())
    train(model, du.DistributedOptimizer(backend, schedule(), accumulate_steps=2), mine)
    one, opt = net(), schedule()
    step = nn.value_and_grad(one, loss_fn)
    for pair in (every[:2], every[2:]):  # one process: the mean of the two calls' gradients
        grads = [step(one, x, y)[1] for x, y in pair]
        opt.update(one, tree_map(lambda a, b: (a + b) / 2, *grads))
        mx.eval(one.parameters(), opt.state)
    assert_close(whole(backend, model), dict(tree_flatten(one.parameters())))


def test_synchronize_keeps_each_ranks_shards_and_sends_roots_replicated_parameters(backend, tmp_path):
    model = net(seed=backend.rank)  # other values on every rank
    for block in model.blocks:  # (the root stays replicated: embed, norm and head)
        du.fully_shard(backend, block)
    shards = {k: a for k, a in tree_flatten(model.parameters()) if k.startswith("blocks")}
    opt = du.DistributedOptimizer(backend, optim.Adam(1e-2))
    opt.init(model.trainable_parameters())
    opt.state["step"] = mx.array(backend.rank)
    with pytest.raises(ValueError, match="pass model="):
        du.synchronize(backend, opt)
    with pytest.raises(ValueError, match=r"whole_state\(\): the optimizer may hold .* \(update first"):
        opt.whole_state()  # (its state: this rank's shards, by a model it does not know yet)
    du.synchronize(backend, model)
    du.synchronize(backend, opt, model=model)
    root = dict(tree_flatten(net(seed=0).parameters()))
    for key, a in tree_flatten(model.parameters()):
        expected = shards[key] if key in shards else root[key]
        assert mx.array_equal(a, expected).item(), key
    assert opt.state["step"].item() == 0
    opt.update(model, nn.value_and_grad(model, loss_fn)(model, *batches(backend, steps=1)[1][0])[1])
    held, path = dict(tree_flatten(opt.state)), du.bcast(backend, str(tmp_path / "ck.safetensors"))
    # updated, it knows its shards: no model= needed (found by an adversarial test: "pass model=")
    du.synchronize(backend, opt)
    with pytest.raises(ValueError, match="pass model="):  # (a new one does not: found by review, kept whole)
        du.DistributedOptimizer(backend, optim.Adam(1e-2)).load_whole_state(opt.whole_state())
    du.save_checkpoint(backend, path, optimizer=opt)
    du.load_checkpoint(backend, path, optimizer=opt)
    assert all(mx.array_equal(a, held[k]).item() for k, a in tree_flatten(opt.state))


@pytest.mark.world(min_size=4, backend=(du.MPIBackend, du.MLXMPIBackend))  # (MLX's ring cannot split)
def test_data_parallel_over_one_group_and_mlx_tensor_parallel_layers_over_the_other(backend):
    """Ranks {0, 1} and {2, 3} each hold one model in tensor-parallel halves (MLX's shard_linear)
    and train on their own batch; du averages over {0, 2} and {1, 3}: like one process on both."""
    tensor = mx.distributed.init().split(backend.rank // 2)
    data = du.split(backend, backend.rank % 2)
    mx.random.seed(0)
    whole = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    one = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    one.update(whole.parameters())
    layers = [mlx_sharded.shard_linear(whole.layers[0], "all-to-sharded", group=tensor), nn.GELU()]
    model = nn.Sequential(*layers, mlx_sharded.shard_linear(whole.layers[2], "sharded-to-all", group=tensor))
    opt, reference = du.DistributedOptimizer(data, optim.SGD(0.1)), optim.SGD(0.1)
    with pytest.raises(ValueError, match="MLX.s (AllToSharded|ShardedToAll)Linear"):  # over the tensor pairs
        du.synchronize(backend, model)
    for step in range(3):
        mx.random.seed(step)
        x, y = mx.random.normal((2, 8, 4)), mx.random.normal((2, 8, 2))
        _, grads = nn.value_and_grad(model, loss_fn)(model, x[backend.rank // 2], y[backend.rank // 2])
        opt.update(model, grads)
        _, grads = nn.value_and_grad(one, loss_fn)(one, x.reshape(16, 4), y.reshape(16, 2))
        reference.update(one, grads)
        mx.eval(model.parameters(), one.parameters())
    probe = mx.random.normal((5, 4))
    assert mx.allclose(model(probe), one(probe), atol=1e-5).item()
    # MLX caches sum_gradients(group) for ever: a split MPI group then outlives MPI_Finalize (abort)
    del model, layers, tensor
    mlx_sharded.sum_gradients.cache_clear()
    gc.collect()


@pytest.mark.world(min_size=2)
def test_ranks_that_shard_different_modules_get_a_clear_error_on_every_rank(backend):
    with pytest.raises(ValueError, match="every rank needs the same parameters"):
        du.fully_shard(backend, Block(5 + backend.rank % 2))
    with pytest.raises(ValueError, match="every rank needs the same reshard_after_forward"):
        du.fully_shard(backend, Block(5), reshard_after_forward=backend.rank == 0)
    with pytest.raises(TypeError, match="expected an mlx.nn.Module"):
        du.fully_shard(backend, {"weight": mx.zeros(3)})


def test_a_compiled_step_trains_like_the_uncompiled_one(backend):
    """Under mx.compile the gathers and reduce-scatters are traced (MPIBackend: MLX's own MPI)."""
    _, mine = batches(backend)
    model, opt = sharded(backend, net()), du.DistributedOptimizer(backend, optim.SGD(0.1))
    loss_and_grad, state = nn.value_and_grad(model, loss_fn), [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        return loss

    for x, y in mine:
        with du.watch("compiled step"):
            mx.eval(step(x, y), state)
    expected = train(sharded(backend, net()), du.DistributedOptimizer(backend, optim.SGD(0.1)), mine)
    assert_close(whole(backend, model), whole(backend, expected), atol=1e-6)


def test_a_float16_reduce_scatter_scales_before_it_sums(backend):
    """As the all-reduce does: the sum of N halves of 40000 never overflows float16 on the way."""
    big = mx.full((4 * backend.size,), 40000.0, mx.float16)
    reduction = du.reduction.Reduction(backend, "avg")
    scattered = reduction.reduce({"g": big}, scatter=True).wait()["g"]
    assert mx.array_equal(scattered, mx.full(scattered.shape, 40000.0, mx.float16)).item()


def test_the_refusals_hold_in_a_compiled_step(backend):
    _, mine = batches(backend, steps=1)
    model = sharded(backend, net())
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1))
    step = mx.compile(
        lambda x, y: opt.update(model, nn.value_and_grad(model, loss_fn)(model, x, y)[1], weight=1.0)
    )
    with pytest.raises(ValueError, match="weight= cannot apply"):
        step(*mine[0])


def test_compute_dtype_leaves_integer_quantized_parameters_alone(backend):
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(64, 8))
    quantized.freeze()
    du.fully_shard(backend, quantized, compute_dtype=mx.bfloat16)
    assert quantized(mx.ones((2, 64))).shape == (2, 8)


def test_a_block_sharded_after_its_root_is_refused(backend):
    """Its parameters are shards of the root's already: sharded again, they would be cut twice (also once the
    root is gone: a block kept from it still holds the root's shards)."""
    root = net()
    du.fully_shard(backend, root)
    with pytest.raises(ValueError, match="inside a fully sharded one"):
        du.fully_shard(backend, root.blocks[0])
    block = root.blocks[0]
    del root
    gc.collect()
    with pytest.raises(ValueError, match="inside a fully sharded one"):
        du.fully_shard(backend, block)


class TwoHeads(nn.Module):
    """One of two models sharing an encoder (tied across two heads, a reference model's embedding)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(5, 2)

    def __call__(self, x):
        return self.head(self.encoder(x))


def test_a_module_shared_with_a_fully_sharded_model_is_refused(backend):
    """Found by an adversarial test: the second model's root sharded the shared encoder's shards again (no
    error; the first model then failed naming whole weights loaded after sharding, or, where a shard is of one
    element, computed with another rank's values). Shared as a unit of its own, sharded first, it trains."""
    mx.random.seed(0)
    encoder = Block(5)
    first, second = TwoHeads(encoder), TwoHeads(encoder)
    du.synchronize(backend, first)
    du.synchronize(backend, second)
    du.fully_shard(backend, first)
    with pytest.raises(ValueError, match="its 'encoder' is inside a fully sharded one"):
        du.fully_shard(backend, second)
    with pytest.raises(ValueError, match="its 'encoder' is inside a fully sharded one"):
        du.fully_shard(backend, TwoHeads(encoder.up))  # (a module wrapping one inside a unit: LoRA's)
    encoder = Block(5)
    first, second = TwoHeads(encoder), TwoHeads(encoder)
    du.synchronize(backend, first)
    du.synchronize(backend, second)
    x = mx.random.normal((2, 5))
    expected = [first(x), second(x)]
    du.fully_shard(backend, encoder)
    for model, want in zip((first, second), expected):
        assert_close({"out": du.fully_shard(backend, model)(x)}, {"out": want}, atol=1e-6)


@pytest.mark.world(min_size=2)
def test_a_compiled_step_that_retraces_on_one_rank_alone_is_no_call_of_its_units(backend):
    """Found by an adversarial test: each trace of a compiled step counted its units' calls, so a rank whose
    last batch was shorter (a trace of its own) gathered at the next uncompiled call (an evaluation) under
    another call than the others: a false "the ranks gather different fully sharded units"."""
    model = sharded(backend, net())
    opt = du.DistributedOptimizer(backend, optim.Adam(1e-2))
    step = compiled_step(model, opt, loss_fn)
    for i, (x, y) in enumerate(batches(backend)[1]):
        rows = 3 if i == 2 and backend.rank == 0 else 4  # (rank 0's last batch is shorter: it traces again)
        mx.eval(step(x[:rows], y[:rows]), model.state, opt.state)
    mx.eval(model(mx.ones((2, 3))))  # (uncompiled: its gathers are checked)


def test_a_unit_not_made_on_every_rank_is_named_so(backend):
    """Found by an adversarial test: a rank's gather met another rank's of a unit it had not made (made on some
    ranks only, or bytes of another collective), and the check raised IndexError naming nothing."""
    tags = np.array([[0, 1], [8, 1], [9, 1]], np.int64)
    with pytest.raises(ValueError, match=r"rank 0: unit 0 \(Block\), call 1; rank 1: unit 8 \(\?\), call 1"):
        fsdp._check_tags(tags, ["Block"])


class SkipsOnRank1(Net):
    """Stochastic depth drawn per rank (a mixture of experts routing differently fails alike): rank 1 skips
    block 0 at the first call, so that its gathers meet the others' gathers of other, same-shaped blocks."""

    def __call__(self, x):
        h = self.embed(x)
        skip = self._rank == 1 and not self._called
        self._called = True
        for i, block in enumerate(self.blocks):
            if not (skip and i == 0):
                h = block(h)
        return self.head(self.norm(h))


@pytest.mark.world(min_size=2)
@pytest.mark.parametrize("reshard", [True, False])
def test_ranks_that_call_different_fully_sharded_units_fail_on_every_rank_naming_them(backend, reshard):
    """#38: the shards of two blocks mixed with no error (parameters 0.004-0.010 off one process's)."""
    mx.random.seed(0)
    model = SkipsOnRank1()
    model._rank, model._called = backend.rank, False
    mx.eval(model.parameters())
    sharded(backend, model, reshard_after_forward=reshard)
    x, y = batches(backend, steps=1)[1][0]
    with pytest.raises(ValueError) as raised:
        nn.value_and_grad(model, loss_fn)(model, x, y)
    units = re.search(
        r"rank 0: unit (\d+) \(Block\), call 1; rank 1: unit (\d+) \(Block\), call 1", str(raised.value)
    )
    assert "the ranks gather different fully sharded units" in str(raised.value), raised.value
    assert units and int(units[2]) == int(units[1]) + 1, raised.value  # (rank 1 is in the next block)


class ReversedOnRank1(Net):
    """Rank 1 calls its blocks in the reverse order: as many gathers as the others, of other blocks."""

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks[:: -1 if self._rank == 1 else 1]:
            h = block(h)
        return self.head(self.norm(h))


@pytest.mark.world(min_size=2)
def test_ranks_that_call_different_units_in_a_compiled_step_get_nan_on_every_rank(backend):
    """Found by an adversarial test: while MLX traces no error can be raised, and the shards mixed silently
    (a plausible loss). Now every gathered value is NaN on every rank; uncompiled, the error names the units."""
    mx.random.seed(0)
    model = ReversedOnRank1()
    model._rank = backend.rank
    mx.eval(model.parameters())
    opt = du.DistributedOptimizer(backend, optim.SGD(0.1))
    loss = compiled_step(sharded(backend, model), opt)(*batches(backend, steps=1)[1][0])
    mx.eval(loss, model.state, opt.state)
    assert mx.isnan(loss).item()
    with pytest.raises(ValueError, match="the ranks gather different fully sharded units"):
        model(mx.ones((2, 3)))


@pytest.mark.world(min_size=2, backend=(du.MPIBackend, du.MLXMPIBackend))  # (MLX's ring cannot split)
def test_units_of_groups_do_not_unsettle_the_numbers_of_the_jobs_units(backend):
    """Found by review: units were numbered across the process, so a rank that had made a unit over a group
    of its own gathered the job's first unit under another number than the others: a false "the ranks gather
    different fully sharded units". Each backend numbers its own."""
    alone = du.split(backend, backend.rank)  # (each rank a group of its own)
    for _ in range(backend.rank):
        du.fully_shard(alone, Block(5))
    every, mine = batches(backend)
    model = train(sharded(backend, net()), du.DistributedOptimizer(backend, optim.Adam(1e-2)), mine)
    one = train(net(), optim.Adam(1e-2), every)
    assert_close(whole(backend, model), dict(tree_flatten(one.parameters())))


class WithNothing(Block):
    """A block holding a parameter of no elements (an empty bias, a LoRA of rank 0)."""

    def __init__(self, d):
        super().__init__(d)
        self.nothing = mx.zeros((0, d))

    def __call__(self, x):
        return super().__call__(x) + self.nothing.sum()


@pytest.mark.parametrize("reshard", [True, False])
def test_one_all_gather_per_unit_call_and_a_parameter_of_no_elements(backend, reshard):
    """#40: a unit's parameters travel in one all-gather (was one per parameter), their gradients in one
    reduce-scatter (#39: was one per parameter); #38: a 0-element parameter (at 3 MPI ranks the gather of
    one came back on numpy's memory, and MLX hung reducing it)."""
    mx.random.seed(0)
    block = WithNothing(5)
    du.synchronize(backend, block)
    x = mx.random.normal((2, 5))
    expected = block(x)
    step = nn.value_and_grad(block, lambda m: m(x).sum())
    loss, grads = step(block)
    du.fully_shard(backend, block, reshard_after_forward=reshard)
    with counted(backend) as calls:
        out = block(x)
        mx.eval(out)
    assert calls == ["allgather"], calls
    assert_close({"out": out}, {"out": expected}, atol=1e-6)
    with counted(backend) as calls:
        sharded_loss, sharded_grads = step(block)
        mx.eval(sharded_grads)
    assert calls == ["allgather"] * (1 + reshard) + ["reduce_scatter"] * (backend.size > 1), calls
    assert sharded_grads["nothing"].shape == (0,) and mx.allclose(sharded_loss, loss).item()
    for key, g in tree_flatten(grads):  # (each parameter's shard of the average of the whole gradients)
        mine = fsdp.shard_of(du.allreduce(backend, g, "avg"), backend.size, backend.rank)
        assert mx.allclose(tree_flatten(sharded_grads, destination={})[key], mine, atol=1e-6).item(), key


def test_clip_grad_norm_of_gradients_whose_squares_overflow_float32(backend):
    """#38: gradients of 5e37 (squares past float32) gave a norm of inf and were all clipped to 0 (as MLX's clip_grad_norm does)."""
    grads = {"w": mx.full((3,), 5e37, mx.float32), "b": mx.array([1.0, -2.0]), "nothing": mx.zeros((0,))}
    clipped, norm = du.clip_grad_norm(backend, grads, 1.0)
    n = backend.size  # (every rank's gradients count: the norm over all of them)
    assert math.isclose(norm.item(), 5e37 * math.sqrt(3 * n), rel_tol=1e-5), norm
    assert math.isclose(clipped["w"][0].item(), 1 / math.sqrt(3 * n), rel_tol=1e-5), clipped["w"]
    assert clipped["b"][1].item() < 0 and clipped["nothing"].shape == (0,)
    inf = du.clip_grad_norm(backend, {"w": mx.array([float("inf"), 1.0])}, 1.0)[1]
    assert inf.item() == float("inf")  # (an infinite gradient: an infinite norm, as before)


def test_whole_weights_loaded_after_sharding_are_named(backend, tmp_path):
    """#38: it ended in an MLX shape error that did not say what happened ("[reshape] Cannot reshape array
    of size 48 into shape (6,4)")."""
    block = Block(5)
    path = str(du.bcast(backend, str(tmp_path / "block.safetensors")))
    if backend.rank == 0:
        block.save_weights(path)
    du.barrier(backend)
    du.fully_shard(backend, block)
    block.load_weights(path, strict=False)  # (mlx-lm's load_adapters does so)
    with pytest.raises(
        ValueError, match=r"'up.weight' holds an array of shape \(11, 5\), not this rank's shard"
    ):
        block(mx.ones((2, 5)))


@pytest.mark.world(max_size=1)  # (refused before any collective; mlx-lm's import takes seconds a rank)
def test_grad_checkpoint_applied_before_sharding_is_named(backend):
    """#38: it ended in an rms_norm size error that did not say what happened."""
    from mlx_lm.tuner.trainer import grad_checkpoint

    class Checkpointed(Block):
        pass

    grad_checkpoint(Checkpointed(5))
    with pytest.raises(
        ValueError, match="runs through mlx-lm's grad_checkpoint, applied before du.fully_shard"
    ):
        du.fully_shard(backend, Checkpointed(5))
