"""The watchdog: a collective that does not finish in time ends the job with a report, not a hang.

Every collective the library issues runs inside ``collective(...)``: it gets a sequence number
and an entry in this process's table of collectives in flight. A daemon thread checks the
table; when an entry is older than the timeout it prints, for this rank, what it waits on and
since when, waits ``GRACE`` seconds (so that the other ranks stuck in the same collective print
theirs), and ends the process with ``EXIT_CODE`` through ``os._exit``: the main thread is stuck
in C code and cannot be interrupted. The launcher (or mpirun) then stops the other ranks.

MLX collectives are lazy: the library's own functions evaluate them inside their watched
region, but a lazy result the user evaluates later (``mx.eval`` after ``opt.update``) is
watched only inside ``watch("train step")``.

Debug mode (``DU_DEBUG=1`` or ``initialize(..., debug=True)``): before it runs, every collective
compares its sequence number, op, dtypes and shapes across ranks (one extra allgather) and
raises CollectiveMismatchError on every rank at the first difference. Off by default.
"""

import contextlib
import itertools
import os
import sys
import threading
import time

import mlx.core as mx
import numpy as np

EXIT_CODE = 124  # like coreutils' timeout(1)
DEFAULT_TIMEOUT = 300.0
GRACE = 2.0
_POLL = 0.25


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (debug mode); raised on every rank with the same message."""


class _Entry:
    __slots__ = ("seq", "what", "summary", "rank", "start", "timeout")

    def __init__(self, seq, what, summary, rank, timeout):
        self.seq, self.what, self.summary, self.rank, self.timeout = seq, what, summary, rank, timeout
        self.start = time.monotonic()


class _State:
    def __init__(self):
        self.timeout = self.debug = None  # None: not configured yet (read the environment)
        self.lock = threading.Lock()  # for starting the thread
        self.inflight = {}  # id(entry) -> entry; one C-level dict operation at a time (GIL)
        self.counter = itertools.count(1)
        self.seq = 0  # the last collective's sequence number on this rank
        self.done = 0  # the last one that finished
        self.rank = None
        self.thread = None
        self.local = threading.local()  # .depth: collectives nested in the current one


_state = _State()


def configure(timeout=None, debug=None):
    """Set this process's timeout in seconds (0: never) and debug mode. ``None`` keeps the current
    setting, initially ``DU_TIMEOUT`` (default 300) and ``DU_DEBUG`` (default off)."""
    if timeout is None and _state.timeout is None:
        timeout = _env_timeout()
    if timeout is not None:
        timeout = float(timeout)
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0 (0: never), got {timeout!r}")
        _state.timeout = timeout
    if debug is None and _state.debug is None:
        debug = os.environ.get("DU_DEBUG", "0") not in ("", "0", "false", "no")
    if debug is not None:
        _state.debug = bool(debug)


def timeout() -> float:
    """The current timeout in seconds (0: never)."""
    configure()
    return _state.timeout


def debug() -> bool:
    """Whether debug mode checks every collective across ranks."""
    configure()
    return _state.debug


def _env_timeout():
    value = os.environ.get("DU_TIMEOUT", "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"DU_TIMEOUT={value!r} is not a number of seconds") from None


class collective:
    """Context manager that watches one collective of ``backend``: ``what`` names it, ``args``
    are its arguments (arrays, op name, root). Collectives nested in it (a primitive built
    from others) are part of it. Costs a few microseconds."""

    __slots__ = ("backend", "what", "args", "entry")

    def __init__(self, backend, what: str, args: tuple):
        self.backend, self.what, self.args, self.entry = backend, what, args, None

    def __enter__(self):
        if getattr(_state.local, "depth", 0):
            return self
        if _state.timeout is None or _state.debug is None:
            configure()
        # The inputs' own computation (a whole backward pass, say) is not the collective's:
        # it runs before the clock starts, so a slow but healthy step is never taken for stuck.
        evaluate(*(a for arg in self.args for a in (arg if isinstance(arg, (list, tuple)) else [arg])))
        seq = _state.seq = next(_state.counter)
        _state.rank = self.backend.rank
        self.entry = _register(seq, self.what, _summary(self.what, self.args), self.backend.rank, _state.timeout)
        _state.local.depth = 1
        if _state.debug and self.backend.size > 1:
            try:
                _check_across_ranks(self.backend, self.entry, self.args)
            except BaseException:
                self.__exit__(*sys.exc_info())
                raise
        return self

    def __exit__(self, kind, error, tb):
        if self.entry is None:
            return
        _state.local.depth = 0
        _unregister(self.entry)
        if kind is None:
            _state.done = self.entry.seq
        self.entry = self.args = None


def evaluate(*values):
    """``mx.eval`` the mx.arrays among ``values``, unless MLX is tracing a function
    (``mx.compile``, ``vmap``), where they must stay lazy graph nodes."""
    arrays = [v for v in values if isinstance(v, mx.array)]
    try:
        mx.eval(arrays)
    except ValueError as e:
        if "function transformations" not in str(e):
            raise


@contextlib.contextmanager
def watch(what: str, timeout=None):
    """Put a region under the watchdog: if it runs longer than ``timeout`` (default: the
    library's), this rank reports it and exits. Use it around a training step whose lazy
    MLX collectives run at your own ``mx.eval``:

        with du.watch("train step"):
            loss, grads = loss_and_grad(model, x, y)
            opt.update(model, grads)
            mx.eval(loss, model.parameters(), opt.state)
    """
    configure()
    entry = _register(None, what, (), _state.rank, _state.timeout if timeout is None else float(timeout))
    try:
        yield
    finally:
        _unregister(entry)


@contextlib.contextmanager
def connecting(what: str):
    """``watch`` for a transport's start. MLX's ring holds Python's GIL while it connects, so
    the watchdog thread cannot run: faulthandler's C thread backs it up, printing where the
    process is stuck ("Timeout (...)!" and a traceback through ``initialize``) and exiting 1."""
    configure()
    limit = _state.timeout
    armed = False
    if limit:
        try:
            import faulthandler

            faulthandler.dump_traceback_later(limit + GRACE, exit=True, file=sys.__stderr__)
            armed = True
        except (AttributeError, ValueError, OSError):  # no usable stderr: the thread alone
            pass
    try:
        with watch(what):
            yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def _register(seq, what, summary, rank, limit):
    entry = _Entry(seq, what, summary, rank, limit)
    _state.inflight[id(entry)] = entry
    if _state.thread is None:
        with _state.lock:
            if _state.thread is None:
                _state.thread = threading.Thread(target=_watch_loop, name="du-watchdog", daemon=True)
                _state.thread.start()
    return entry


def _unregister(entry):
    _state.inflight.pop(id(entry), None)


def _watch_loop():
    while True:
        time.sleep(_POLL)
        now = time.monotonic()
        entries = list(_state.inflight.copy().values())
        if any(e.timeout and now - e.start > e.timeout for e in entries):
            _expire(sorted(entries, key=lambda e: e.start))


def _expire(entries):
    now = time.monotonic()
    for e in entries:
        rank = _launched_rank() if e.rank is None else e.rank
        name = f"collective #{e.seq} {e.what}{_format(e.summary)}" if e.seq else f"'{e.what}'"
        since = time.strftime("%H:%M:%S", time.localtime(time.time() - (now - e.start)))
        _say(
            f"du watchdog: rank {rank}: {name} waiting since {since} ({now - e.start:.1f} s, "
            f"timeout {e.timeout:g} s; last finished collective: #{_state.done}); exiting"
        )
    time.sleep(GRACE)
    os._exit(EXIT_CODE)


def _launched_rank() -> str:
    """This process's rank as the launcher set it (before any backend knows it)."""
    for key in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if key in os.environ:
            return os.environ[key]
    return "?"


def _say(message):
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except Exception:  # stderr may be closed or replaced; the exit is what matters
        pass


# --- what a collective is called with ----------------------------------------------------


def _is_array(x) -> bool:
    return isinstance(x, (mx.array, np.ndarray))


def _sig(x):
    """An array's ``(dtype, shape)``; a list of arrays' list of those; an op or root as it is."""
    if _is_array(x):
        return _sig_of(x.dtype, x.shape)
    if isinstance(x, (list, tuple)) and all(_is_array(a) for a in x):
        return [_sig(a) for a in x]
    if isinstance(x, (str, int, np.integer)):
        return x if isinstance(x, str) else int(x)
    return type(x).__name__


def _payload(what, args):
    """The arguments that must agree across ranks: an object collective's object need not."""
    return args[1:] if what.endswith("_object") else args


def _summary(what, args) -> tuple:
    """What the report shows of ``args``: kept without a reference to the arrays, and cheap
    (it is taken for every collective; ``_format`` makes the text only for a report)."""
    out = []
    for a in _payload(what, args):
        if _is_array(a):
            out.append((a.dtype, a.shape))
        elif isinstance(a, (list, tuple)) and a and _is_array(a[0]):
            out.append((len(a), [(x.dtype, x.shape) for x in a[:3]]))
        elif isinstance(a, str) or (isinstance(a, (int, np.integer)) and not isinstance(a, bool)):
            out.append(a)
    return tuple(out)


def _format(summary) -> str:
    parts, arrays = [], []
    for a in summary:
        if isinstance(a, str):
            parts.append(a)
        elif not isinstance(a, tuple):
            parts.append(f"root={int(a)}")
        elif isinstance(a[1], list):
            shown = ", ".join(_show(_sig_of(*x)) for x in a[1])
            arrays.append(f"[{a[0]} arrays: {shown}{', ...' if a[0] > 3 else ''}]")
        else:
            arrays.append(_show(_sig_of(*a)))
    return (f"({', '.join(parts)})" if parts else "") + "".join(" " + a for a in arrays)


def _sig_of(dtype, shape):
    return (str(dtype).removeprefix("mlx.core."), tuple(shape))


def _show(sig) -> str:
    dtype, shape = sig
    return f"{dtype}{shape}"


def _check_across_ranks(backend, entry, args):
    mine = (entry.seq, entry.what, [_sig(a) for a in _payload(entry.what, args)])
    everyone = backend.allgather_object(mine)  # nested: part of this collective
    if all(e == everyone[0] for e in everyone):
        return
    groups = {}
    for rank, e in enumerate(everyone):
        groups.setdefault(repr(e), (e, []))[1].append(rank)
    calls = "; ".join(f"ranks {ranks} call #{e[0]} {e[1]}{_describe(e[2])}" for e, ranks in groups.values())
    raise CollectiveMismatchError(f"ranks issued different collectives (DU_DEBUG): {calls}")


def _describe(sigs) -> str:
    parts = []
    for s in sigs:
        if isinstance(s, tuple):
            parts.append(_show(s))
        elif isinstance(s, list):
            parts.append("[" + ", ".join(_show(x) for x in s) + "]")
        elif isinstance(s, str):
            parts.append(s)
        else:
            parts.append(f"root={s}")
    return "(" + ", ".join(parts) + ")"
