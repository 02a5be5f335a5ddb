"""SparseLoCo's codec (arXiv 2508.15706) for DiLoCo's pseudo-gradients. Each rank adds its pseudo-
gradient to its error-feedback buffer (e <- decay * e + delta, float32), sends the k largest magnitudes
of each chunk of e, quantized, and keeps the rest (e <- e - sent). Every rank decodes the same
all-gathered bytes in the same order, so every rank's average is the same to the bit.

Per array of n values (flattened): chunks of c = min(chunk, n) values (the last padded with zeros), kk =
min(k, c) of each kept, in order of decreasing magnitude. With ``bits`` b, the value at place i of that
order becomes sign * level[i * L // kk]: L = 2**(b - 1) groups of places, a group's level the mean
magnitude of the chunk's values in it (so the value's b - 1 magnitude bits travel as its place). On the
wire, per array, in this order:

    indices  chunks * kk, each within its chunk: uint8 for c <= 256, uint16 for c <= 65536, else uint32
    signs    ceil(chunks * kk / 8) bytes (bits, packed; 1: negative)  | bits=None (or 32): chunks * kk
    levels   chunks * L float32                                        | float32 values, no levels

and per rank 4 bytes more, its weight (float32; 1.0 unweighted): ``nbytes`` adds it up. Each rank's
values are decoded into float32 zeros in rank order, ``out[index] += value * share_r`` (indices unique
within a rank's array; share_r = w_r / sum w, or 1/N)."""

import dataclasses

import mlx.core as mx
import numpy as np

from .collectives import allgather, check_count
from .reduction import check_weights, weighted_shares


@dataclasses.dataclass(frozen=True)
class SparseCodec:
    """``DiLoCo(compression=SparseCodec(...))``; ``compression="sparse"`` is these defaults (the paper's):
    ``k`` values kept of each ``chunk``, ``bits`` per value (None or 32: float32), ``decay`` the error
    feedback's beta. The buffers are DiLoCo's (one per rank, in its checkpoints); this holds settings."""

    k: int = 64
    chunk: int = 4096
    bits: int | None = 2
    decay: float = 0.95

    def __post_init__(self):
        check_count(self.chunk, 1, "SparseCodec: chunk")
        check_count(self.k, 1, f"SparseCodec: k (values kept of each chunk of {self.chunk})", self.chunk)
        if self.bits not in (None, 32):
            check_count(self.bits, 1, "SparseCodec: bits (or None or 32: float32 values)", 8)
        if not 0 <= self.decay <= 1:
            raise ValueError(f"SparseCodec: decay must be in [0, 1], got {self.decay!r}")

    @property
    def levels(self):
        """Magnitude levels per chunk (L), or None: float32 values."""
        return None if self.bits in (None, 32) else 2 ** (self.bits - 1)

    def _layout(self, n: int) -> tuple:
        """An array of ``n`` values: (chunk length c, kept per chunk kk, chunks, the indices' dtype)."""
        c = min(self.chunk, max(n, 1))
        index = next(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32) if c <= np.iinfo(t).max + 1)
        return c, min(self.k, c), -(-n // c), index

    def _sizes(self, n: int) -> list:
        """The bytes of an array of ``n`` values on the wire: [indices, signs or values, levels]."""
        _, kk, chunks, index = self._layout(n)
        if self.levels is None:
            return [chunks * kk * index.itemsize, chunks * kk * 4, 0]
        return [chunks * kk * index.itemsize, -(-chunks * kk // 8), chunks * self.levels * 4]

    def nbytes(self, sizes) -> int:
        """What one rank gives the all-gather for arrays of ``sizes`` values (the module's table)."""
        return 4 + sum(sum(self._sizes(n)) for n in sizes)

    def _encode(self, e: np.ndarray) -> tuple:
        """``e`` (flat float32): its bytes on the wire, and ``e`` less what they carry."""
        c, kk, chunks, index = self._layout(e.size)
        rows = np.pad(np.asarray(e, np.float32), (0, chunks * c - e.size)).reshape(chunks, c)
        top = np.argpartition(-np.abs(rows), kk - 1, axis=1)[:, :kk]
        values = np.take_along_axis(rows, top, 1)
        order = np.argsort(-np.abs(values), axis=1, kind="stable")  # decreasing magnitude
        top, values = np.take_along_axis(top, order, 1), np.take_along_axis(values, order, 1)
        if self.levels is None:
            wire = [top.astype(index), values]
        else:
            group = np.arange(kk) * self.levels // kk
            levels = np.zeros((chunks, self.levels), np.float32)
            for g in np.unique(group):
                levels[:, g] = np.abs(values[:, group == g]).mean(axis=1)
            negative = values < 0
            values = np.where(negative, -levels[:, group], levels[:, group])
            wire = [top.astype(index), np.packbits(negative), levels]
        np.put_along_axis(rows, top, np.take_along_axis(rows, top, 1) - values, 1)
        return b"".join(a.tobytes() for a in wire), rows.ravel()[: e.size]

    def _decode(self, wire: np.ndarray, n: int) -> tuple:
        """One rank's bytes of an array of ``n`` values: (positions in the padded array, values)."""
        c, kk, chunks, index = self._layout(n)
        sizes = np.cumsum(self._sizes(n))
        top = wire[: sizes[0]].view(index).reshape(chunks, kk).astype(np.int64)
        positions = (top + c * np.arange(chunks)[:, None]).ravel()
        if self.levels is None:
            return positions, wire[sizes[0] : sizes[1]].view(np.float32)
        negative = np.unpackbits(wire[sizes[0] : sizes[1]], count=chunks * kk).reshape(chunks, kk)
        levels = wire[sizes[1] : sizes[2]].view(np.float32).reshape(chunks, self.levels)
        magnitudes = levels[:, np.arange(kk) * self.levels // kk]
        return positions, np.where(negative == 1, -magnitudes, magnitudes).ravel()

    def reduce(self, backend, pseudo: dict, feedback: dict, weight=None) -> tuple:
        """Collective, one all-gather: ({key: the average of every rank's sent part}, in the dtypes of
        ``pseudo``, the same bits on every rank; {key: this rank's new feedback}). ``weight``: this rank's
        (an mx.array or number; a weight < 0 or not finite is a ValueError on every rank)."""
        mine = [np.array([1.0 if weight is None else float(weight)], np.float32).tobytes()]
        kept = {}
        for key, delta in pseudo.items():
            before = np.array(feedback.get(key, 0.0), np.float32).ravel()  # (none yet: zeros)
            e = self.decay * before + np.array(delta.astype(mx.float32)).ravel()
            wire, residual = self._encode(e)
            mine.append(wire)
            kept[key] = mx.array(residual.reshape(delta.shape))
        gathered = allgather(backend, np.frombuffer(b"".join(mine), np.uint8)).reshape(backend.size, -1)
        weights = gathered[:, :4].copy().view(np.float32).ravel()
        check_weights(weights.tolist(), "DiLoCo's sparse sync")
        shares = np.array(weighted_shares(mx.array(weights)))  # (as the dense reduction's, bit for bit)
        averaged, offset = {}, 4
        for key, delta in pseudo.items():
            size = sum(self._sizes(delta.size))
            c, _, chunks, _ = self._layout(delta.size)
            out = np.zeros(chunks * c, np.float32)
            for r in range(backend.size):  # (in rank order; positions unique within a rank's array)
                positions, values = self._decode(gathered[r, offset : offset + size], delta.size)
                out[positions] += values * shares[r]
            averaged[key] = mx.array(out[: delta.size].reshape(delta.shape)).astype(delta.dtype)
            offset += size
        return averaged, kept
