"""Checkpoints that survive a job killed at any moment, and resume to the same trajectory.

``save_checkpoint`` is collective: rank 0 writes one safetensors file atomically (a temporary
file in the same directory, fsync, rename over ``path``, fsync of the directory), and every
rank returns only once it is complete, or raises rank 0's error. So ``path`` always holds the
last complete checkpoint, whenever the job dies. ``load_checkpoint`` reads it on rank 0 and
broadcasts it, so the other ranks (on other hosts) need not see the file.

What a checkpoint holds: the model's parameters, the optimizer's state (step, learning rate,
moments), every rank's MLX random state, the step, your data position and an ``extra`` value;
with the same data order (``DistributedDataContainer.batches(epoch=, start=)``) training then
continues bit for bit as if it had never stopped.
"""

import glob
import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .api import _check_backend, allgather
from .backends.base import UINT_BY_SIZE
from .synchronize import synchronize

FORMAT = "distributed_utils.checkpoint/1"

# safetensors dtype names
_CODES = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
    mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.float16: "F16",
    mx.bfloat16: "BF16", mx.float32: "F32", mx.float64: "F64", mx.complex64: "C64",
}  # fmt: skip
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read, or does not fit the model; raised on every rank."""


def save_checkpoint(backend, path, *, model=None, optimizer=None, data=None, step=None, extra=None):
    """Collective: write a checkpoint of this job to ``path`` (rank 0 writes; every rank waits).

    ``model``: an ``nn.Module`` (all its parameters); ``optimizer``: an ``mlx.optimizers``
    optimizer or ``du.DistributedOptimizer`` (its ``state``); ``data``: your position in the
    data as a JSON value (e.g. ``{"epoch": 3, "batch": 120}``), or an object with
    ``state_dict()`` and ``load_state_dict()``; ``step`` and ``extra``: JSON values. Every
    rank's ``mx.random`` state is saved too. Returns once ``path`` holds the new checkpoint.
    """
    _check_backend(backend)
    arrays = {}
    if model is not None:
        arrays.update(_flat("model", model.parameters()))
    if optimizer is not None:
        arrays.update(_flat("optimizer", optimizer.state))
    meta = {
        "format": FORMAT, "step": step, "extra": extra, "world_size": backend.size,
        "data": data.state_dict() if hasattr(data, "state_dict") else data,
        "optimizer": None if optimizer is None else _optimizer_name(optimizer),
    }  # fmt: skip
    try:
        meta_json = json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"save_checkpoint: step, data and extra must be JSON values: {e}") from None
    arrays["rng"] = allgather(backend, mx.random.state[0][None])  # evaluated here, on every rank
    error = None
    if backend.rank == 0:
        try:
            _write_atomically(Path(path), arrays, meta_json)
        except Exception as e:  # the other ranks must hear of it rather than wait
            error = f"{type(e).__name__}: {e}"
    error = backend.bcast_object(error, 0)
    if error is not None:
        raise CheckpointError(f"save_checkpoint: rank 0 could not write {path}: {error}")


def load_checkpoint(backend, path, *, model=None, optimizer=None, data=None):
    """Collective: restore what ``save_checkpoint`` wrote to ``path``, on every rank.

    Rank 0 reads the file and broadcasts it. ``model`` gets the saved parameters in place,
    ``optimizer`` the saved state, ``data`` (if it has ``load_state_dict``) its state, and each
    rank its own random state (when the world size is the one saved). Returns
    ``{"step", "data", "extra"}``, or None on every rank when ``path`` does not exist.
    """
    _check_backend(backend)
    header = None
    if backend.rank == 0:
        try:
            header = _read_header(Path(path)) if os.path.exists(path) else None
        except Exception as e:
            header = e
    header = backend.bcast_object(header, 0)
    if isinstance(header, Exception):
        raise CheckpointError(f"load_checkpoint: rank 0 could not read {path}: {header}")
    if header is None:
        return None
    meta, entries = header
    _check_fits(path, entries, model, optimizer)
    if optimizer is not None and meta["optimizer"] != _optimizer_name(optimizer):
        raise CheckpointError(
            f"load_checkpoint: {path} holds the state of a {meta['optimizer']}, not of a {_optimizer_name(optimizer)}"
        )
    if backend.rank == 0:
        arrays = _read_arrays(Path(path), entries)
    else:
        arrays = {k: mx.zeros(shape, _DTYPES[code]) for k, (code, shape, _) in entries.items()}
    arrays = synchronize(backend, arrays, root=0)
    mx.eval(arrays)
    if model is not None:
        model.update(tree_unflatten(_section(arrays, "model")))
    if optimizer is not None:
        optimizer.state = tree_unflatten(_section(arrays, "optimizer"))
    if meta["world_size"] == backend.size:
        hi, lo = arrays["rng"][backend.rank].tolist()
        mx.random.seed((hi << 32) | lo)  # seed(s) sets the key to [s >> 32, s & 0xffffffff]
    if data is not None and hasattr(data, "load_state_dict"):
        data.load_state_dict(meta["data"])
    return {"step": meta["step"], "data": meta["data"], "extra": meta["extra"]}


# --- the file -------------------------------------------------------------------------------


def _optimizer_name(optimizer) -> str:
    return type(getattr(optimizer, "optimizer", optimizer)).__name__  # through DistributedOptimizer


def _flat(section, tree) -> dict:
    flat = {}
    for key, leaf in tree_flatten(tree):
        if isinstance(leaf, np.ndarray):
            leaf = mx.array(leaf)
        if not isinstance(leaf, mx.array):
            raise TypeError(
                f"save_checkpoint: {section} leaf '{key}' is a {type(leaf).__name__}, not an array; "
                "pass such values in extra="
            )
        flat[f"{section}.{key}"] = leaf
    return flat


def _section(arrays, section) -> list:
    prefix = section + "."
    return [(k[len(prefix) :], v) for k, v in arrays.items() if k.startswith(prefix)]


def _write_atomically(path: Path, arrays: dict, meta_json: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in glob.glob(str(path.parent / f".{path.name}.tmp-*")):  # left by a killed job
        os.remove(stale)
    mx.eval(list(arrays.values()))
    buffers, header, offset = [], {"__metadata__": {"distributed_utils": meta_json}}, 0
    for key, a in arrays.items():
        raw = np.asarray(a.reshape(-1).view(UINT_BY_SIZE[a.dtype.size]) if a.size else mx.zeros(0, mx.uint8))
        header[key] = {"dtype": _CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + raw.nbytes]}
        buffers.append(raw)
        offset += raw.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # safetensors aligns the data to 8 bytes
    buffers.insert(0, np.frombuffer(struct.pack("<Q", len(head)) + head, np.uint8))
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        _write(f, buffers)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


_saves = 0


def _write(f, buffers):
    """Write ``buffers``. Test hook: ``DU_TEST_CRASH_IN_CHECKPOINT=N`` makes the process die
    (``os._exit(99)``) halfway through writing its N-th checkpoint, as a killed job would."""
    global _saves
    _saves += 1
    crash = os.environ.get("DU_TEST_CRASH_IN_CHECKPOINT")
    if crash and int(crash) == _saves:
        total = sum(b.nbytes for b in buffers)
        data = b"".join(bytes(b) for b in buffers)[: total // 2]
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os._exit(99)
    for b in buffers:
        f.write(b.data)


def _read_header(path: Path):
    """``(meta, {key: (dtype code, shape, (start, end))})``; a clear error for a file that is
    not a complete checkpoint."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0] if size >= 8 else None
        if n is None or 8 + n > size:
            raise CheckpointError(f"{path} is not a complete checkpoint (truncated header)")
        header = json.loads(f.read(n))
    try:
        meta = json.loads(header.pop("__metadata__")["distributed_utils"])
        assert meta["format"] == FORMAT
    except (KeyError, TypeError, ValueError, AssertionError):
        raise CheckpointError(f"{path} is a safetensors file but not a distributed_utils checkpoint") from None
    entries = {k: (v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in header.items()}
    end = max((e for _, _, (_, e) in entries.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is not a complete checkpoint ({size} bytes, expected {8 + n + end})")
    return meta, entries


def _read_arrays(path: Path, entries) -> dict:
    blob = np.memmap(path, np.uint8, mode="r")
    start = 8 + struct.unpack("<Q", blob[:8].tobytes())[0]
    out = {}
    for key, (code, shape, (a, b)) in entries.items():
        dtype = _DTYPES[code]
        bits = mx.array(blob[start + a : start + b].view(np.dtype(f"<u{dtype.size}")))
        out[key] = bits.view(dtype).reshape(shape)
    return out


def _check_fits(path, entries, model, optimizer):
    """Raise (on every rank alike: ``entries`` came from rank 0) if ``model`` is not the one saved."""
    for name, given in (("model", model), ("optimizer", optimizer)):
        if given is not None and not any(k.startswith(name + ".") for k in entries):
            raise CheckpointError(f"load_checkpoint: {path} holds no {name} (it was saved without {name}=)")
    if model is None:
        return
    saved = {k[len("model.") :]: (code, shape) for k, (code, shape, _) in entries.items() if k.startswith("model.")}
    have = {k: (_CODES[v.dtype], tuple(v.shape)) for k, v in tree_flatten(model.parameters())}
    if saved == have:
        return
    key = next(k for k in sorted(set(saved) | set(have)) if saved.get(k) != have.get(k))
    raise CheckpointError(
        f"load_checkpoint: {path} does not fit the model: at '{key}' the checkpoint has "
        f"{_show(saved.get(key))} and the model {_show(have.get(key))}"
    )


def _show(sig) -> str:
    if sig is None:
        return "nothing"
    code, shape = sig
    return f"{_DTYPES[code]} {shape}".replace("mlx.core.", "")
