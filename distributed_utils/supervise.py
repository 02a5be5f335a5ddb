"""Supervising a job's processes: their output, prefixed with its rank; which rank failed
first, and how; stopping every process when one fails, or when the launcher is stopped.

``supervise`` serves both ways of starting a job: the ring's (one process per rank, started
by du-launch) and mpirun's (one mpirun, which starts and stops the ranks itself and says
which one failed in its own report).
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

GRACE_SECONDS = 3  # between SIGTERM and SIGKILL for the ranks left when one failed
SETTLE_SECONDS = 0.5  # after a rank fails, for the others that fail with it, to tell cause from effect
MPIRUN_GRACE = 5  # for mpirun to end the job once a rank failed (it may wait on a lost host)
WATCHDOG_EXIT = 124  # watchdog.EXIT_CODE


def spawn(argv, env):
    try:
        return subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except FileNotFoundError as e:
        raise SystemExit(f"du-launch: cannot run {argv[0]!r}: {e.strerror}") from None


_TAG = re.compile(rb"^\[\d+,(\d+)\]<std(?:out|err)>: ?")
_WATCHDOG = re.compile(rb"^du watchdog: rank (\d+):")
# mpirun's own report of the rank that ended the job (the lines it prints untagged)
_MPIRUN_RANK = re.compile(rb"process rank (\d+)|Process name: \[\S+,(\d+)\]")
_MPIRUN_SIGNAL = re.compile(rb"^signal (\d+) \(")
_MPIRUN_LOST = re.compile(rb"lost communication with a remote daemon")
# what MLX's ring prints on the ranks that lose a peer: an effect, not the cause, of a failure
_PEER_LOST = re.compile(rb"^\[ring\] (Socket \d+ was closed|Sending to socket|Too many send/recv)|peer was lost")
_print_lock = threading.Lock()


class Report:
    """What the output says about how the job ends: which ranks the watchdog stopped, and
    (for mpirun, which supervises the ranks itself) which rank failed and how."""

    def __init__(self):
        self.watchdog = set()
        self.peer_lost = set()  # ranks that saw a peer go
        self.failed_rank = self.signal = None
        self.lost_host = False
        self.failure = threading.Event()

    def scan(self, line, rank, tagged_line):
        if rank is not None and _PEER_LOST.search(line):
            self.peer_lost.add(rank)
        m = _WATCHDOG.match(line)
        if m:
            self.watchdog.add(int(m.group(1)))
            self.failure.set()
        if tagged_line:
            return
        m = _MPIRUN_RANK.search(line)
        if m and self.failed_rank is None:
            self.failed_rank = int(m.group(1) or m.group(2))
            self.failure.set()
        if _MPIRUN_LOST.search(line):
            self.lost_host = True
            self.failure.set()
        m = _MPIRUN_SIGNAL.match(line)
        if m and self.signal is None:
            self.signal = int(m.group(1))


def forward(stream, out, rank, report):
    """Copy ``stream`` to ``out`` line by line, each line prefixed with its rank
    (``rank=None``: the rank comes from mpirun's ``--output tag`` prefix), and scan it.
    A carriage return ends a line too, so progress bars redraw in place, each with its rank."""
    last_rank, continued = None, False  # continued: the last piece was a progress-bar redraw
    for line in _pieces(stream):
        tagged, line_rank = True, rank
        if rank is None:
            m = _TAG.match(line)
            tagged, line_rank = bool(m) or continued, int(m.group(1)) if m else (last_rank if continued else None)
            line = line[m.end():] if m else line
        prefix = b"[rank %d] " % line_rank if line_rank is not None else b""
        report.scan(line, line_rank, tagged)
        with _print_lock:
            out.write(prefix + line)
            out.flush()
        last_rank, continued = line_rank, line.endswith(b"\r")


def _pieces(stream):
    """``stream``'s bytes in pieces that each end with a newline or a carriage return."""
    rest = b""
    while chunk := stream.read1(1 << 16):
        *pieces, rest = re.split(rb"(?<=\n)|(?<=\r)(?!\n)", rest + chunk)
        yield from pieces
    if rest:
        yield rest


def supervise(procs, world_size, tagged=False):
    """Wait for every process; when one fails, stop the rest. Returns the job's exit code.
    ``tagged``: ``procs`` is one mpirun, which stops the ranks itself (given MPIRUN_GRACE)."""
    report = Report()
    threads = []
    for rank, p in enumerate(procs):
        for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
            t = threading.Thread(target=forward, args=(stream, out, None if tagged else rank, report), daemon=True)
            t.start()
            threads.append(t)
    done = threading.Event()
    failures = []  # (rank, code), in the order the launcher saw them exit

    def wait(rank, p):
        code = p.wait()
        if code != 0:
            failures.append((rank, code))
        done.set()

    for rank, p in enumerate(procs):
        threading.Thread(target=wait, args=(rank, p), daemon=True).start()
    forward_signals(procs)
    if tagged:
        code = wait_mpirun(procs[0], report)
    else:
        while any(p.poll() is None for p in procs) and not failures:
            done.wait()
            done.clear()
        code = 0
        if failures:
            settle = time.monotonic() + SETTLE_SECONDS
            while any(p.poll() is None for p in procs) and time.monotonic() < settle:
                done.wait(timeout=max(0, settle - time.monotonic()))
                done.clear()
            # Ranks that exit within a few ms of each other are reaped in any order: the cause
            # is the first one that did not merely lose a peer.
            rank, code = next((f for f in failures if f[0] not in report.peer_lost), failures[0])
            log(f"rank {rank} {how_it_ended(code)}; stopping the other ranks")
            stop(procs)
            code = 128 - code if code < 0 else code
    deadline = time.monotonic() + GRACE_SECONDS  # for the output still in the pipes
    for t in threads:  # (a process left on a lost host may hold them open)
        t.join(timeout=max(0, deadline - time.monotonic()))
    if report.watchdog:
        log(watchdog_summary(report.watchdog, world_size))
    return code


def wait_mpirun(proc, report):
    """mpirun's exit code, naming the failed rank from its report; stops an mpirun that has
    not ended the job MPIRUN_GRACE seconds after a rank failed (a host it cannot reach)."""
    while proc.poll() is None:
        if report.failure.wait(timeout=1):
            try:
                proc.wait(timeout=MPIRUN_GRACE)
            except subprocess.TimeoutExpired:
                log(f"mpirun has not ended the job {MPIRUN_GRACE} s after a rank failed; stopping it")
                stop([proc])
                return WATCHDOG_EXIT if report.watchdog else 1
    code = proc.returncode
    code = 128 - code if code < 0 else code
    if code == 0 and report.lost_host:  # mpirun says so, then exits 0
        log("mpirun lost a host and ended the job")
        code = 1
    if code and report.failed_rank is not None:
        how = how_it_ended(-report.signal if report.signal else code)
        log(f"rank {report.failed_rank} {how}; mpirun stopped the other ranks")
    return code


def how_it_ended(code) -> str:
    """``code`` from Popen.returncode: negative for a signal."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == WATCHDOG_EXIT:
        return f"exited with code {code} (the watchdog's: stuck past the timeout)"
    return f"exited with code {code}"


def watchdog_summary(stopped, world_size) -> str:
    others = sorted(set(range(world_size)) - stopped)
    text = f"the watchdog ended the job: ranks {sorted(stopped)} waited past the timeout (see their reports)"
    if others:
        text += (
            f"; ranks {others} did not report waiting: they are behind, stuck elsewhere, failed "
            "otherwise, or their report was lost"
        )
    return text


def stop(procs):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                pass


def forward_signals(procs):
    """Ctrl-C or a SIGTERM to the launcher stops the whole job."""

    def handler(signum, frame):
        log(f"received {signal.Signals(signum).name}; stopping all ranks")
        stop(procs)
        sys.exit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def log(message):
    with _print_lock:
        print(f"du-launch: {message}", file=sys.stderr, flush=True)

