"""Checkpoints that survive a job killed at any moment, and resume to the same trajectory (bit for
bit, with the same data order). One safetensors file is written atomically (CRC-32s of each array's
pieces, one over the metadata and the header), so ``path`` always holds the last complete checkpoint.
An array is pieces: a replicated one rank 0's, a fully sharded model's one per rank; each rank writes
its own where every rank sees rank 0's folder, else rank 0 writes all (gathering one shard at a time).
Rank 0 reads it back for every rank (the others need not see it), each keeping only its shards: no
rank ever holds the whole of a fully sharded model."""

import contextlib
import itertools
import json
import math
import os
import struct
import warnings
import zlib
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import fsdp, watchdog
from .arrays import MX_DTYPES, bits, dtype_name, show, signature, to_mx
from .collectives import allgather, barrier, check_backend, check_count, run_on_root
from .state import of
from .tree import describe

FORMAT = "distributed_utils.checkpoint/3"  # (3: each array's CRC-32s, one per piece; one int read too)
_FORMAT_1 = "distributed_utils.checkpoint/1"  # (read too: without the checksum of the metadata)
SAFETENSORS_NAMES = {"bool": "BOOL", "bfloat16": "BF16"}  # (the others: F32, U8, ...: a letter, the bits)
_PIECE_BYTES = 64 * 2**20  # the most one write takes; a barrier after each of rank 0's; fsync every 4


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read, or does not fit the model; raised on every rank."""


@watchdog.watch("save_checkpoint", timeout=0)  # (a region of the timeline; its collectives are watched)
def save_checkpoint(
    backend,
    path,
    *,
    model=None,
    optimizer=None,
    data=None,
    step=None,
    extra=None,
    keep=None,
    trainable_only=False,
):
    """Collective: rank 0 writes a checkpoint to ``path``; every rank returns once it is there,
    or raises CheckpointError if rank 0 could not (leaving no temporary file).

    ``model``: its parameters (``trainable_only``: the trainable ones). ``optimizer``: any
    optimizer, ``DistributedOptimizer`` or ``DiLoCo`` (its whole state, which loads into any
    world size; before the first update too). ``data``: a JSON value or an object with
    ``state_dict()``/``load_state_dict()``. ``step``, ``extra``: JSON values. Every rank's
    ``mx.random`` state is saved too. ``keep=k``: ``path`` is a directory of
    ``step-{step}.safetensors`` files: the newest k by step stay, and a save's later steps
    (a trajectory left when the job resumed from an older one) are set aside as ``.superseded``."""
    path, shards = Path(path), _shards(backend, model, optimizer, "save_checkpoint")
    if keep is not None:  # (the files' names sort by step)
        check_count(keep, 1, "save_checkpoint: keep")
        check_count(step, 0, "save_checkpoint(keep=...): step")
        folder, path = path, path / f"step-{step:012d}.safetensors"
    arrays, layouts = {}, {"model": shards, "optimizer": shards}  # (each rank's shards, written whole)
    if model is not None:
        arrays.update(_flat("model", model.trainable_parameters() if trainable_only else model.parameters()))
    state = None if optimizer is None else of(optimizer)
    if state is not None:  # (a plain optimizer of a fully sharded model holds shards by the model's layout)
        held, layout = state.held_state()
        layouts["optimizer"] = {**shards, **layout}
        arrays.update(_flat("optimizer", held))
    meta = dict(format=FORMAT, step=step, extra=extra, world_size=backend.size, trainable_only=trainable_only)
    meta["data"] = data.state_dict() if hasattr(data, "state_dict") else data
    meta["optimizer"] = None if state is None else state.rule_name()
    meta["optimizer_initialized"] = state is not None and state.initialized()
    try:
        meta_json = json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"save_checkpoint: step, data and extra must be JSON values: {e}") from None
    arrays["rng"] = allgather(backend, mx.random.state[0][None])

    def prune():  # (the later steps set aside: else the next load would go back to them)
        _set_aside([p for p in _checkpoints_in(folder) if p.name > path.name], "superseded")
        for old in _checkpoints_in(folder)[:-keep]:
            old.unlink()

    stale = ".step-*.safetensors.tmp-*" if keep is not None else None  # (in a keep folder: any step's)
    _write(backend, path, arrays, _wholes(arrays, layouts), meta_json, prune if keep else None, stale)


def _write(backend, path: Path, arrays: dict, wholes: dict, meta_json: str, then=None, stale=None):
    """Collective: ``arrays`` written to ``path`` in pieces, as the module's docstring says (each at a key
    of ``wholes``, ``{key: (whole shape, backend)}``, a rank's shard of its whole); rank 0 reads the file back
    against every piece's CRC-32, replaces ``path`` with it, then runs ``then()``."""
    specs = {k: (a.dtype, wholes[k][0] if k in wholes else a.shape) for k, a in arrays.items()}
    counts = {k: wholes[k][1].size if k in wholes else 1 for k in arrays}  # (the pieces of each array)
    specs, metadata, room, offsets = _layout(specs, meta_json, counts)  # (the metadata, so offsets: rank 0's)
    tmp, token, offsets = _on_rank_0(backend, lambda: (*_started(path, stale), offsets), f"write {path}")
    one_group = bool(wholes) and backend.size > 1 and all(b is backend for _, b in wholes.values())
    shared = one_group and _seen_everywhere(backend, tmp, token)  # (hybrid sharding: rank 0 writes all)
    writer = _Writer(tmp if shared or backend.rank == 0 else None)
    _write_arrays(backend, writer, arrays, wholes, specs, counts, offsets, shared)
    writer.close()
    everyone = allgather(backend, (writer.crcs, writer.error))
    errors = [f"rank {r} could not write {path}: {error}" for r, (_, error) in enumerate(everyone) if error]
    # (an empty piece, of ranks past a small array's end: crc32(b"") == 0)
    crcs = {k: [everyone[r if shared else 0][0].get((k, r), 0) for r in range(n)] for k, n in counts.items()}
    header = _header(specs, metadata, crcs)
    try:  # (any rank's failure: rank 0 removes the temporary file)
        if errors:
            raise CheckpointError("; ".join(errors))
        written = {k: (dtype_name(dtype), shape) for k, (dtype, shape) in specs.items()}
        _read_back(backend, tmp, written, crcs, offsets)  # (as a load reads it)
        _on_rank_0(backend, partial(_finished, tmp, path, room, header), f"write {path}")
    except CheckpointError:
        if backend.rank == 0:
            tmp.unlink(missing_ok=True)
        raise
    if then:  # (path is in place: a failure now is not one of writing it)
        _on_rank_0(backend, then, f"finish the save after writing {path} (it is in place)")


def _on_rank_0(backend, fn, doing: str):
    return run_on_root(backend, fn, 0, CheckpointError, doing)


def _seen_everywhere(backend, tmp: Path, token: bytes) -> bool:
    """Collective: whether every rank reads ``token`` in ``tmp`` (one folder, or a shared file system)."""
    seen = False
    with contextlib.suppress(OSError), open(tmp, "rb") as f:  # (a file of that name elsewhere: not the token)
        seen = f.read(8 + len(token))[8:] == token
    return all(allgather(backend, seen))


def _write_arrays(backend, writer, arrays: dict, wholes: dict, specs, counts, offsets, shared: bool):
    """Collective: each array's pieces written by their writers (``shared``: piece r by rank r, else all by
    rank 0, of a sharded array gathered whole first), in ``_steps``: after each, every rank joins a barrier
    (a save longer than the timeout is no stall; a rank 0 that stops writing is)."""
    current = None  # (the array being written)
    for step in _steps(specs, counts):
        for key, r, first, start, stop in step:
            if key != current:
                current, a = key, arrays[key]
                if key in wholes and not shared:
                    a = fsdp.gather(wholes[key][1], [a], [specs[key][1]])[0]
                flat = None if writer.file is None else np.asarray(bits(a))
            if backend.rank == (r if shared else 0) and flat is not None:  # (None: its open failed)
                origin = first if shared else 0  # (where the array this rank holds starts in the whole)
                data = flat[start - origin : stop - origin]
                writer.write((key, r), offsets[key] + start * specs[key][0].size, data)
        barrier(backend)


def _steps(specs: dict, counts: dict):
    """Lists of ``(key, piece, first, start, stop)``: each array's ``counts[key]`` pieces of ceil(size / n)
    (``first``: where one starts; none past the end) in parts, steps of at most ``_PIECE_BYTES`` on every rank."""
    step, nbytes = [], 0
    for key, (dtype, shape) in specs.items():
        size, n = math.prod(shape), counts[key]
        c, most = -(-size // n), max(1, _PIECE_BYTES // dtype.size)  # (a piece's and a part's elements)
        for r in range(n):
            for start in range(r * c, max(1, min(size, r * c + c)), most):  # (a 0-element array: one part)
                stop = min(size, r * c + c, start + most)
                if step and nbytes + (stop - start) * dtype.size > _PIECE_BYTES:
                    yield step
                    step, nbytes = [], 0
                step.append((key, r, r * c, start, stop))
                nbytes += (stop - start) * dtype.size
    if step:
        yield step


class _Writer:
    """One rank's writes into the temporary file (None: it writes nothing): the CRC-32 of each piece it
    wrote (``{(key, rank): crc}``), and its first error, after which it writes no more."""

    def __init__(self, tmp):
        self.crcs, self.error, self.file, self.written = {}, None, None, 0
        self._do(lambda: setattr(self, "file", None if tmp is None else open(tmp, "r+b")))

    def write(self, piece, offset: int, data):
        self.crcs[piece] = zlib.crc32(data, self.crcs.get(piece, 0))
        before, self.written = self.written, self.written + data.nbytes
        sync = before // (4 * _PIECE_BYTES) < self.written // (4 * _PIECE_BYTES)  # (fsynced as it goes)
        self._do(lambda: self.file.seek(offset), lambda: _write_pieces(self.file, data, sync))

    def close(self):
        if self.file is not None:
            self._do(self.file.flush, lambda: os.fsync(self.file.fileno()))
            with contextlib.suppress(OSError):  # (a flush that failed fails again: the first error is kept)
                self.file.close()

    def _do(self, *steps):
        if self.error is None:
            try:
                for step in steps:
                    step()
            except Exception as e:  # (every rank hears of it after the writes; rank 0 removes the file)
                self.error = f"{type(e).__name__}: {e}"


@watchdog.watch("load_checkpoint", timeout=0)
def load_checkpoint(backend, path, *, model=None, optimizer=None, data=None):
    """Collective: rank 0 reads ``path`` (a ``keep`` directory: its newest intact one; newer damaged ones
    set aside as ``.damaged``) into ``model`` (in place), ``optimizer``, ``data`` and each rank's random
    state (at the world size saved). Returns ``{"step", "data", "extra", "world_size"}``, or None when
    there is none; CheckpointError on every rank for a damaged file or one that does not fit."""
    shards = _shards(backend, model, optimizer, "load_checkpoint")
    path, header = _newest_intact(backend, Path(path))
    if header is None:
        return None
    meta, saved, crcs, offsets = header
    if model is not None:  # (a file saved with trainable_only holds those alone)
        parameters = model.trainable_parameters() if meta.get("trainable_only") else model.parameters()
        _check_fits(path, "model", saved, fsdp.whole_shapes(parameters, shards))
    state = None if optimizer is None else of(optimizer)
    # (the rule's name; DiLoCo's files of before 2026-11-29 name its class alone)
    if state is not None and meta["optimizer"] in (None, state.rule_name(), type(state).__name__):
        # the entries both hold, when both have them (saved or loaded before the first update: any)
        both = meta.get("optimizer_initialized", True) and state.initialized()
        shared = fsdp.whole_shapes(state.shared_state(), shards) if both else None
        _check_fits(path, "optimizer", saved, shared, exact=False)
    elif state is not None:
        raise CheckpointError(
            f"load_checkpoint: {path} holds the state of a {meta['optimizer']}, not of a {state.rule_name()}"
        )
    wholes = _wholes(saved, {"model": shards, "optimizer": shards})
    arrays = _read_back(backend, path, saved, crcs, offsets, delivered=wholes)
    if model is not None:
        model.update(tree_unflatten(_section(arrays, "model")))
    if state is not None:  # (DiLoCo sets the model's parameters to this rank's local ones)
        state.load_whole_state(tree_unflatten(_section(arrays, "optimizer")), model)
    if meta["world_size"] == backend.size:
        hi, lo = arrays["rng"][backend.rank].tolist()
        mx.random.seed((hi << 32) | lo)  # seed(s) sets the key to [s >> 32, s & 0xffffffff]
    if data is not None and hasattr(data, "load_state_dict"):
        data.load_state_dict(meta["data"])
    return {key: meta[key] for key in ("step", "data", "extra", "world_size")}


def _shards(backend, model, optimizer, who) -> dict:
    check_backend(backend)
    fsdp.check_mlx_sharding(backend, model, who, replicated_ok=False)
    return fsdp.state_shards(None if optimizer is None else of(optimizer), model, who)


def _wholes(keys, layouts: dict) -> dict:
    """``fsdp.layout_of`` for section keys ("model.w") by ``{section: its layout of parameter keys}``."""
    prefixed = {f"{section}.{k}": whole for section, shards in layouts.items() for k, whole in shards.items()}
    return fsdp.layout_of(keys, prefixed)


def _flat(section, tree) -> dict:
    flat = {}
    for key, leaf in tree_flatten(tree):
        leaf = to_mx(leaf)
        if not isinstance(leaf, mx.array):
            raise TypeError(
                f"save_checkpoint: {section} leaf '{key}' is a {type(leaf).__name__}, not an array; "
                "pass such values in extra="
            )
        flat[f"{section}.{key}"] = leaf
    return flat


def _section(arrays, section) -> list:
    return [(k.removeprefix(section + "."), v) for k, v in arrays.items() if k.startswith(section + ".")]


def _layout(specs: dict, meta_json: str, counts: dict):
    """``(specs, metadata, room, offsets)`` of a file of ``specs``'s arrays (float64 as its bits), each in
    ``counts`` pieces: the room its header takes with the widest CRC-32s, each array's offset."""
    doubles = [key for key, (dtype, _) in specs.items() if dtype == mx.float64]
    specs = {k: (mx.uint64 if k in doubles else dtype, shape) for k, (dtype, shape) in specs.items()}
    metadata = {"distributed_utils": meta_json, "float64": json.dumps(doubles)}
    metadata["keys"] = json.dumps(list(specs))  # (mx.load's own order is not theirs)
    header = _header(specs, metadata, {key: [2**32 - 1] * n for key, n in counts.items()})
    room = len(header) + 10
    offsets = {k: 8 + room + v["data_offsets"][0] for k, v in json.loads(header).items() if k in specs}
    return specs, metadata, room, offsets


def _started(path: Path, stale=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(stale or f".{path.name}.tmp-*"):  # left by a killed job
        old.unlink(missing_ok=True)
    tmp, token = path.parent / f".{path.name}.tmp-{os.getpid()}", os.urandom(16)
    tmp.write_bytes(bytes(8) + token)
    return tmp, token


def _finished(tmp: Path, path: Path, room: int, header: bytes):
    with open(tmp, "r+b") as f:
        f.write(struct.pack("<Q", room) + header.ljust(room))
        f.flush()
        os.fsync(f.fileno())
    mx.load(str(tmp), format="safetensors")  # (the header read as a load will: lazily, alone)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _header(specs: dict, metadata: dict, crcs: dict) -> bytes:
    metadata = {**metadata, "crc32": json.dumps(crcs)}
    metadata["header_crc32"] = _header_crc(metadata, specs)
    header, start = {"__metadata__": metadata}, 0
    for key, (dtype, shape) in specs.items():
        name = dtype_name(dtype)  # safetensors' names: F32, BF16, U8, BOOL, ...
        name = SAFETENSORS_NAMES.get(name, name[0].upper() + "".join(filter(str.isdigit, name)))
        end = start + math.prod(shape) * dtype.size
        header[key] = {"dtype": name, "shape": list(shape), "data_offsets": [start, end]}
        start = end
    return json.dumps(header).encode()


def _header_crc(metadata: dict, specs: dict) -> str:
    """A CRC-32 of the metadata and each array's name, dtype and shape: all a load trusts but the bytes."""
    parts = [metadata.get(k, "") for k in ("distributed_utils", "crc32", "float64", "keys")]
    parts += [f"{key} {dtype} {tuple(shape)}" for key, (dtype, shape) in sorted(specs.items())]
    return str(zlib.crc32("\n".join(parts).encode()))


def _write_pieces(f, data, sync: bool):
    f.write(memoryview(data).cast("B"))
    if sync:
        f.flush()
        os.fsync(f.fileno())


def _checkpoints_in(folder: Path) -> list:
    """The checkpoints ``save_checkpoint(keep=)`` wrote to ``folder``, by step (oldest first)."""
    return sorted(folder.glob("step-*.safetensors"))


def _set_aside(paths: list, why: str, note=""):
    """Rename each of ``paths`` to ``path.why`` (``.why-2``, ...: never over another); warn with ``note``."""
    for path in paths:
        names = (f"{path.name}.{why}" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
        aside = next(path.with_name(name) for name in names if not path.with_name(name).exists())
        path.rename(aside)
        warnings.warn(f"set aside {path} as {aside.name}{note}")


def _newest_intact(backend, path: Path):
    """Collective: ``(path, _header_of(path))`` of the checkpoint at ``path`` (a ``keep`` directory: its newest
    intact one by every byte, newer damaged ones set aside); ``(path, None)``: there is none."""
    folder, candidates = _on_rank_0(backend, lambda: _candidates(path), f"read {path}")
    damaged = {}
    for candidate in candidates:
        try:  # (the header, then a folder's every byte; a file's are checked as the load delivers them)
            header = _on_rank_0(backend, partial(_header_of, candidate), f"read {path}")
            if folder:
                _read_back(backend, candidate, *header[1:])
        except CheckpointError as e:
            if not folder:
                raise
            damaged[candidate] = str(e)
            continue
        if damaged:  # (only once an intact one is found: else nothing is moved)
            note = f" (loading {candidate}, older): {'; '.join(damaged.values())}"
            set_aside = partial(_set_aside, list(damaged), "damaged", note)
            try:
                _on_rank_0(backend, set_aside, f"set aside damaged checkpoints in {path}")
            except CheckpointError as e:  # (a read-only folder: they stay; the older one still loads)
                if backend.rank == 0:
                    warnings.warn(f"{e}{note}")
        return candidate, header
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {path}: {'; '.join(damaged.values())}")
    return path, None


def _candidates(path: Path):
    if path.is_dir():
        return True, list(reversed(_checkpoints_in(path)))
    return False, [path] if path.exists() else []


def _read_back(backend, path: Path, saved: dict, want: dict, offsets: dict, delivered=None) -> dict:
    """Collective: rank 0 reads ``path``'s arrays (``_header_of``'s) in steps of at most ``_PIECE_BYTES``, each
    a collective every rank joins, checking each piece's CRC-32 (CheckpointError on every rank). ``delivered``:
    the arrays on every rank; at its keys (a fully sharded model's ``{key: (whole shape, backend)}``) shards."""
    specs = {key: (MX_DTYPES[name], shape) for key, (name, shape) in saved.items()}
    crcs = {key: [0] * (1 if want is None else len(want[key])) for key in specs}  # (rank 0's, of each piece)
    wholes, out = {}, {}  # (the arrays being received)

    def read(f, step):  # (an array's pieces checked at its last part)
        got = []
        for key, piece, _, start, stop in step:
            (dtype, shape), nbytes = specs[key], (stop - start) * specs[key][0].size
            f.seek(offsets[key] + start * dtype.size)
            got.append(f.read(nbytes))
            if len(got[-1]) < nbytes:
                raise CheckpointError(f"{path} is incomplete or corrupt: it ends inside '{key}'")
            crcs[key][piece] = zlib.crc32(got[-1], crcs[key][piece])
            if want is not None and stop == math.prod(shape) and crcs[key] != want[key]:
                raise CheckpointError(f"{path} is damaged: the bytes of '{key}' do not match their checksum")
        return None if delivered is None else got

    with open(path, "rb") if backend.rank == 0 else contextlib.nullcontext() as f:
        for step in _steps(specs, {key: len(pieces) for key, pieces in crcs.items()}):
            got = _on_rank_0(backend, partial(read, f, step), f"read {path}")
            for (key, _, _, start, _), data in zip(step, got or []):  # (an array once its last part came)
                dtype, shape = specs[key]
                if start == 0:  # (its first part)
                    wholes[key] = bytearray(math.prod(shape) * dtype.size)
                wholes[key][start * dtype.size : start * dtype.size + len(data)] = data
                if start * dtype.size + len(data) == len(wholes[key]):  # (where sharded, this rank's shard)
                    a = mx.array(np.frombuffer(wholes.pop(key), f"u{dtype.size}")).view(dtype).reshape(shape)
                    out[key] = fsdp.own_shard(a, delivered[key][1]) if key in delivered else a
                    mx.eval(out[key])
    return out


def _header_of(path: Path):
    """``(meta, {key: (dtype name, shape)}, {key: CRC-32s, one per piece} or None (older files), {key: where its
    bytes start})`` of the checkpoint at ``path``, its metadata verified; else CheckpointError."""
    try:  # (MLX checks the header as a load does; lazily: no bytes are read)
        arrays, saved = mx.load(str(path), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path} is incomplete or corrupt: {e}") from None
    damaged = CheckpointError(f"{path} is damaged: its metadata or header do not match their checksum")
    specs = {key: (a.dtype, a.shape) for key, a in arrays.items()}
    if "header_crc32" in saved and saved["header_crc32"] != _header_crc(saved, specs):
        raise damaged
    try:
        meta = json.loads(saved["distributed_utils"])
        crcs = json.loads(saved["crc32"]) if "crc32" in saved else None
        keys = json.loads(saved.get("keys", "null")) or list(arrays)
        doubles = json.loads(saved.get("float64", "[]"))  # (written as their bits; a view reads nothing)
        arrays = {key: arrays[key].view(mx.float64) if key in doubles else arrays[key] for key in keys}
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path} is not a distributed_utils checkpoint (no metadata)") from None
    missing = {"format", "step", "extra", "world_size", "data", "optimizer"} - set(meta)
    if meta.get("format") not in (FORMAT, "distributed_utils.checkpoint/2", _FORMAT_1) or missing:
        why = f"format {meta.get('format')!r}, missing {sorted(missing)}"
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint ({why})")
    if meta["format"] != _FORMAT_1 and "header_crc32" not in saved:
        raise damaged
    if crcs is None or meta["format"] == _FORMAT_1:
        unverified = "checksums" if crcs is None else "a checksum of its metadata"
        warnings.warn(f"{path} was written without {unverified} (by an older version): loaded unverified")
    if crcs is not None:  # (one int an array in older files: one piece)
        crcs = {key: want if isinstance(want, list) else [want] for key, want in crcs.items()}
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        places = json.loads(f.read(length))
    offsets = {key: 8 + length + places[key]["data_offsets"][0] for key in keys}
    return meta, {key: signature(a) for key, a in arrays.items()}, crcs, offsets


def _check_fits(path, section, saved, tree, exact=True):
    """Raise unless the signatures ``saved`` (rank 0's) hold ``section`` with the keys, dtypes and
    shapes of ``tree`` (None: any; not ``exact``: at ``tree``'s keys)."""
    saved = dict(_section(saved, section))
    if not saved:
        raise CheckpointError(f"load_checkpoint: {path} holds no {section} (it was saved without {section}=)")
    have = {} if tree is None else dict(describe(tree))
    keys = sorted(set(have) | (set(saved) if exact and tree is not None else set()))
    key = next((k for k in keys if saved.get(k) != have.get(k)), None)
    if key is not None:
        shown = ["nothing" if sig is None else show(sig) for sig in (saved.get(key), have.get(key))]
        raise CheckpointError(
            f"load_checkpoint: {path} does not fit the {section}: at '{key}' the checkpoint has "
            f"{shown[0]} and the {section} {shown[1]}"
        )


def save_adapters(backend, path, model, config=None, *, trainable_only=True):
    """Collective: rank 0 writes ``model``'s trainable parameters (LoRA adapters, say; with
    ``trainable_only=False`` all of them: a plain weights file) to ``path`` atomically, as mlx-lm
    does (``model.load_weights(path, strict=False)`` reads them), a fully sharded model's whole, and
    ``config`` (a JSON value, else TypeError) beside it as ``adapter_config.json``; CheckpointError on every
    rank if it could not."""
    path, shards = Path(path), _shards(backend, model, None, "save_adapters")
    config_file = path.parent / "adapter_config.json"
    write_config = None if config is None else partial(config_file.write_text, json.dumps(config, indent=4))
    arrays = dict(tree_flatten(model.trainable_parameters() if trainable_only else model.parameters()))
    wholes = fsdp.layout_of(arrays, shards)
    _write(backend, path, arrays, wholes, json.dumps({"format": "adapters"}), write_config)
