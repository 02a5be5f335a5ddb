"""The watchdog: a collective that does not finish in time ends the job with a report, not a hang.

A daemon thread checks the regions in flight (``Collective``, ``watch``): one past its timeout is reported;
``GRACE`` seconds later (for the others' reports) ``os._exit(WATCHDOG_EXIT)``; the launcher stops the rest.
At exit, the rank's account goes to du-launch (a record), and with ``DU_TIMELINE`` its timeline to a file."""

import atexit
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time

from .arrays import show, signature
from .backends import contract
from .backends.contract import WATCHDOG_EXIT, launched_rank, record, report_path, say_record, timeline_path

DEFAULT_TIMEOUT = 300.0
GRACE = 2.0
_POLL = 0.25


class _State:
    timeout, debug = None, None  # None: not configured yet (read the environment)
    rank, thread, parent = None, None, None  # parent: the launcher's pid, to exit with it
    done = "#0"  # the last collective that finished on this rank (its number, and its group)
    depth = 0  # 1 inside a collective: the collectives it makes itself are part of it
    waited = 0.0  # seconds spent in collectives
    first, last = None, None  # when the first collective began, and the last ended
    steps, sent = 0, 0  # optimizer steps, and bytes given to collectives
    timeline = None  # with DU_TIMELINE: (seq, group, what, start, end, bytes) of each collective and region
    timeline_file = None  # DU_TIMELINE's, read with the first collective
    lock = threading.Lock()  # for starting the thread
    inflight = {}  # the regions in flight (as keys); one C-level dict operation at a time (GIL)
    stopped = []  # (from, to): when this process did not run


# (an instance: assigning to a class's attributes at every collective invalidates type caches)
_state = _State()


def configure(timeout=None, debug=None):
    """Set this process's timeout in seconds (0: never) and debug mode. ``None`` keeps the current
    setting, initially ``DU_TIMEOUT`` (default 300) and ``DU_DEBUG`` (default off)."""
    where = "timeout"
    if timeout is None and _state.timeout is None:  # (the environment is read once, not at every watch)
        where, timeout = "DU_TIMEOUT", contract.watchdog_environment()["timeout"] or DEFAULT_TIMEOUT
    if timeout is not None:
        try:
            seconds = float(timeout)
        except (TypeError, ValueError):
            seconds = float("nan")
        if not 0 <= seconds <= 1e9:  # (faulthandler's timer holds at most about 9e9 seconds)
            raise ValueError(f"{where}={timeout!r} is not a number of seconds from 0 to 1e9 (0: never)")
        _state.timeout = seconds
    if debug is not None or _state.debug is None:
        _state.debug = contract.watchdog_environment()["debug"] if debug is None else bool(debug)


class Collective:
    """``with Collective(backend, what, details, arrays) as call``: watch one collective of this rank
    (``call`` is None when nested in another: part of it), numbered on ``backend`` (its group), shown
    (``text``) only when asked. A ``watch`` region is a Collective registered without entering it (``seq`` 0)."""

    start = None  # when it began, once registered
    seq = 0
    group = ""  # "" for the whole job, else " in group [0, 2]": its members

    def __init__(self, backend, what: str, details=(), arrays=()):  # (backend None: a region's)
        self.backend, self.what, self.details = backend, what, details
        self.rank = _state.rank if backend is None else backend.rank
        self.arrays = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]

    def __enter__(self):
        if _state.depth:
            return None
        configure()
        _state.depth, _state.rank, self.timeout, self.debug = 1, self.rank, _state.timeout, _state.debug
        # (not kept: a backend a traceback kept till exit outlived MLX's MPI: exit 1 in half the runs)
        backend, self.backend = self.backend, None
        backend.seq += 1
        self.seq = backend.seq
        if backend.members is not None:
            self.group = f" in group {list(backend.members)}"
        _register(self)
        return self

    def __exit__(self, *exception):
        if self.start is not None:
            _state.depth = 0
            _finished(self)

    def text(self, limit=None) -> str:
        """What reports show and debug mode checks: ``#5 allreduce(float32(3,), sum)`` (``limit`` arrays)."""
        shown = [show(signature(a)) for a in self.arrays[:limit]]
        more = [f"... ({len(self.arrays)} arrays)"] if limit is not None and len(self.arrays) > limit else []
        return f"#{self.seq}{self.group} {self.what}({', '.join(shown + more + list(self.details))})"


def waited() -> float:
    """Seconds this process has spent in collectives: the rest of a step is its own work."""
    return _state.waited


@contextlib.contextmanager
def watch(what: str, timeout=None):
    """Put a region under the watchdog: if it runs longer than ``timeout`` (default: the
    library's), this rank reports it and exits. For work that waits on other ranks, such as a
    compiled step whose collectives run at your ``mx.eval``: ``with du.watch("train step"): ...``."""
    configure()
    region = Collective(None, what)
    region.timeout = _state.timeout if timeout is None else float(timeout)
    _register(region)
    try:
        yield
    finally:
        _finished(region)


@contextlib.contextmanager
def holding_the_gil():
    """For a call into a transport that may wait holding the GIL (MLX's ring connecting, MLX's MPI
    splitting), where the watchdog's thread cannot run: faulthandler's C thread backs it up (a
    "Timeout" traceback through the call, exit 1)."""
    configure()
    armed = False
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no usable stderr: the thread alone
        if _state.timeout:
            faulthandler.dump_traceback_later(_state.timeout + GRACE, exit=True, file=sys.__stderr__)
            armed = True
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def connecting(what: str, exit_with_launcher=False):
    """``watch`` for a transport's start (``holding_the_gil``). Once started, ``exit_with_launcher``:
    this process ends when its parent (du-launch) is gone."""
    with holding_the_gil(), watch(what):
        yield
    if exit_with_launcher:  # (SIGKILLed, say; the watch started the thread that checks)
        _state.parent = os.getppid()


def _register(region):
    region.start = time.monotonic()
    _state.inflight[region] = None
    if _state.thread is None:  # (started: no lock to take at every collective)
        with _state.lock:
            if _state.thread is None:
                _state.timeline_file = contract.watchdog_environment()["timeline"]
                _state.timeline = [] if _state.timeline_file else None
                atexit.register(_account)
                _state.thread = threading.Thread(target=_watch_loop, name="du-watchdog", daemon=True)
                _state.thread.start()


def _finished(region):
    end, nbytes = time.monotonic(), sum(getattr(a, "nbytes", 0) for a in region.arrays)
    _state.inflight.pop(region, None)
    if region.seq:  # (a collective, in the account; a watch region's seq is 0)
        _state.waited, _state.sent = _state.waited + end - region.start, _state.sent + nbytes
        _state.done, _state.last = f"#{region.seq}{region.group}", end
        _state.first = _state.first or region.start
    if _state.timeline is not None:
        _state.timeline.append((region.seq, region.group.strip(), region.what, region.start, end, nbytes))


def stepped():
    _state.steps += 1


def _account(say=True):
    """At exit: this rank's account (from its first collective to its last) for du-launch (``say``); with
    ``DU_TIMELINE=trace.json``, its timeline in ``trace.rank-R.json`` (a Chrome trace; du-launch merges)."""
    if _state.first is None:
        return
    r = launched_rank()  # (the job's rank: a collective's may be a group's, du.split)
    r, seconds = _state.rank if r == "?" else r, _state.last - _state.first
    if say:
        account = dict(steps=_state.steps, seconds=seconds, collectives=_state.waited, bytes=_state.sent)
        say_record(contract.ACCOUNT, **account)
    if _state.timeline is not None:
        t0 = (time.time() - time.monotonic()) * 1e6  # (on the wall clock: the hosts' agree)
        trace = []
        for s, g, w, a, b, n in _state.timeline:
            span = dict(name=w, ph="X", ts=a * 1e6 + t0, dur=(b - a) * 1e6, pid=r, tid=0)
            trace.append({**span, "args": dict(seq=s, group=g, bytes=n)})
        path = timeline_path(_state.timeline_file, r)
        with open(path + ".tmp", "w") as f:  # (whole or not at all: a rank may be stopped meanwhile)
            json.dump(trace, f)
        os.replace(path + ".tmp", path)


def _watch_loop():
    last = time.monotonic()
    while True:
        time.sleep(_POLL)
        if _state.parent is not None and os.getppid() != _state.parent:
            rank = launched_rank() if _state.rank is None else _state.rank
            _say(f"du watchdog: rank {rank}: the launcher (pid {_state.parent}) is gone; exiting")
            os._exit(WATCHDOG_EXIT)
        now = time.monotonic()
        if now - last > max(1.0, 8 * _POLL):  # this process did not run (SIGSTOP, a frozen VM):
            _state.stopped.append((last, now))  # its own waits are not the others' fault
        last = now
        entries = list(_state.inflight.copy())
        if any(e.timeout and now - e.start > e.timeout for e in entries):
            _expire(sorted((e for e in entries if e.timeout), key=lambda e: e.start), now)


def _expire(entries, now):
    for e in entries:
        rank = launched_rank() if e.rank is None else e.rank
        name = f"collective {e.text(limit=3)}" if e.seq else f"'{e.what}'"
        since = time.strftime("%H:%M:%S", time.localtime(time.time() - (now - e.start)))
        stopped = sum(min(b, now) - max(a, e.start) for a, b in _state.stopped if b > e.start)
        also = f"; this process itself was stopped for {stopped:.1f} s of it" if stopped > 1 else ""
        _say(
            f"du watchdog: rank {rank}: {name} waiting since {since} ({now - e.start:.1f} s, timeout {e.timeout:g} s; "
            f"last finished collective: {_state.done}); exiting{also}"
        )
        _say(record(contract.WATCHDOG, rank=rank, waiting=name, stopped=stopped > 1))
    threading.Timer(GRACE, os._exit, (WATCHDOG_EXIT,)).start()  # (the exit, even if the writes below hang)
    with contextlib.suppress(Exception):  # the timeline as it stands: where this rank waits
        for e in list(_state.inflight):
            _finished(e)
        _account(say=False)  # (a job the watchdog ended has no account)
    threading.Event().wait()  # (for the timer)


def _say(message):
    """``message`` to stderr, the process's own (pytest may capture sys.stderr) and the report file; None
    (a ``record`` where du-launch did not start this process): nothing."""
    if message is None:
        return
    streams, path = [sys.stderr, sys.__stderr__], report_path()
    with contextlib.suppress(Exception):  # (a replacement without a file descriptor: write to both)
        if sys.stderr.fileno() == sys.__stderr__.fileno():
            streams = [sys.stderr]
    for stream in streams:
        with contextlib.suppress(Exception):  # closed or missing; the exit is what matters
            stream.write(message + "\n")
            stream.flush()
    with contextlib.suppress(OSError):  # a remote host without the launcher's directory
        if path:
            with open(path, "a") as f:
                f.write(message + "\n")
