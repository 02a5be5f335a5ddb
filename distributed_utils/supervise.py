"""Supervising a job's processes: their output, prefixed with its rank; which rank failed
first, and how; stopping every process when one fails, or when the launcher is stopped."""

import collections
import contextlib
import ctypes
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .backends import contract
from .backends.contract import RECORD_PREFIX, SIGNAL_EXIT, WATCHDOG_EXIT, read_record, timeline_path

GRACE_SECONDS = 3  # between SIGTERM and SIGKILL for the ranks left when one failed
SETTLE_SECONDS = 0.5  # after a rank fails, for the others that fail with it, to tell cause from effect
MPIRUN_GRACE = 5  # for mpirun to end the job once a rank failed (it may wait on a lost host)
TAIL_LINES = 12  # of a failed rank's output, repeated in the failure's summary
# The account advises on the transfers only past this many seconds in them (the least a rank spent): in a
# shorter job start-up and timer noise decide (a 30-step job of 0.03 s was told to find a faster link).
ADVISE_SECONDS = 5

_TAG = re.compile(rb"^\[\d+,(\d+)\]<std(?:out|err)>: ?")
# mpirun's own report of the rank that ended the job (the lines it prints untagged)
_MPIRUN_RANK = re.compile(rb"process rank (\d+)|Process name: \[\S+,(\d+)\]")
_MPIRUN_SIGNAL = re.compile(rb"^signal (\d+) \(")
_MPIRUN_LOST = re.compile(rb"lost communication with a remote daemon")
# seen once in CI: transient
_MPIRUN_NOT_STARTED = re.compile(rb"The PMIx server's listener thread failed to start")
# what MLX's ring prints on the ranks that lose a peer: an effect, not the cause, of a failure
_PEER_LOST = re.compile(
    rb"^\[ring\] (Socket \d+ was closed|Sending to socket|Too many send/recv)|peer was lost"
)
_print_lock = threading.RLock()  # (reentrant: a signal handler may log while the main thread does)


def spawn(argv, env, *, die_with_launcher=signal.SIGKILL):
    """Start ``argv`` in a session of its own, its output piped to the launcher. On Linux it gets
    ``die_with_launcher`` when the launcher dies, even by SIGKILL (prctl 1: PR_SET_PDEATHSIG); elsewhere
    the ranks notice their parent's death themselves (run.py)."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    try:
        return subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=(lambda: libc.prctl(1, int(die_with_launcher), 0, 0, 0)) if libc else None,
        )
    except FileNotFoundError as e:
        raise SystemExit(f"du-launch: cannot run {argv[0]!r}: {e.strerror}") from None


class Report:
    """What the job's output says of it: each rank's last lines and records (``contract.record``); which
    ranks lost a peer, or the watchdog ended (and had been stopped); from mpirun's, which failed and how.
    ``token``: the job's ``DU_RECORD_TOKEN``; a record line without it is a rank's output."""

    def __init__(self, world_size, token=None):
        self.world_size, self.token = world_size, token
        self.tails = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self.records = collections.defaultdict(dict)  # event -> rank -> the rank's record of it
        self.peer_lost, self.watchdog, self.stopped = set(), set(), set()
        self.failed_rank, self.signal = None, None
        self.lost_host, self.not_started = False, False  # not_started: mpirun could not start the job
        self.preempted = None  # the signal to du-launch that preempted the job
        self.stopping = None  # the signal on which du-launch stops the job itself
        self.grace = None  # the timer that stops a preempted job after --grace
        self.failure = threading.Event()

    def scan(self, line, rank, from_rank) -> bool:
        """Note what ``line`` says; return whether to show it."""
        record = read_record(line, self.token)
        if record is not None:  # (the rank whose stream it came in, not what it says)
            event, rank = record.get("event"), record.get("rank") if rank is None else rank
            self.records[event][rank] = record
            if event == contract.WATCHDOG:
                self.watchdog.add(rank)
                if record.get("stopped"):
                    self.stopped.add(rank)
                self.failure.set()
            return False
        if rank is not None:
            self.tails[rank].append(line.decode(errors="replace").rstrip())
            if _PEER_LOST.search(line):
                self.peer_lost.add(rank)
        if not from_rank:  # mpirun's own lines
            m = _MPIRUN_RANK.search(line)
            if m and self.failed_rank is None:
                self.failed_rank = int(m.group(1) or m.group(2))
                self.failure.set()
            if _MPIRUN_LOST.search(line):
                self.lost_host = True
                self.failure.set()
            self.not_started = self.not_started or bool(_MPIRUN_NOT_STARTED.search(line))
            m = _MPIRUN_SIGNAL.match(line)
            if m and self.signal is None:
                self.signal = int(m.group(1))
        return True

    def watchdog_summary(self) -> str:
        text = f"the watchdog ended the job: ranks {sorted(self.watchdog)} waited past the timeout (see their reports)"
        if self.stopped:
            text += f"; ranks {sorted(self.stopped)} had been stopped (SIGSTOP or frozen) while waiting: the cause"
            return text
        silent, finished = set(range(self.world_size)) - self.watchdog, set(self.records[contract.FINISHED])
        early, rest = sorted(finished & silent), sorted(silent - finished)
        if early:
            text += f"; ranks {early} had already finished their program: they left the job early"
        if rest:
            text += f"; ranks {rest} did not report waiting: they are behind, stuck elsewhere, failed otherwise, or their report was lost"
        return text


def show_account(report, checked=None, account=None):
    """The closing account of a training job (one whose ranks all exited normally, some making steps): each
    rank's steps, its time computing and in collectives (first to last), of that waiting for the others
    (beyond the least a rank spent in them); the straggler (returned, or None); the bus bandwidth (``checked``:
    what --check measured). ``account`` (--account): the file for every rank's record and the straggler, as JSON."""
    ranks, n = report.records[contract.ACCOUNT], report.world_size
    if len(ranks) < n or n < 2 or not any(a["steps"] for a in ranks.values()):
        return None
    computing = {r: a["seconds"] - a["collectives"] for r, a in sorted(ranks.items())}
    least = min(a["collectives"] for a in ranks.values())  # (the straggler's: it waits for no one)
    row = "rank {}: {} steps, {:.2f} s computing, {:.2f} s in collectives ({:.2f} s waiting for the others)"
    for r, a in sorted(ranks.items()):
        log(row.format(r, a["steps"], computing[r], a["collectives"], a["collectives"] - least))
    slow = max(computing, key=computing.get)
    others = max(statistics.median(c for r, c in computing.items() if r != slow), 1e-9)
    straggler = slow if computing[slow] > 1.1 * others + 0.1 * ranks[slow]["seconds"] + 0.5 else None
    if straggler is not None:
        log(
            f"rank {slow} is the straggler, computing {computing[slow] / others:.2f}x as long as the others: "
            "give it a smaller share (DistributedDataContainer.batches(share='auto')) or a faster machine"
        )
    bus = statistics.median(a["bytes"] for a in ranks.values()) * 2 * (n - 1) / n / max(least, 1e-9) / 1e9
    links = f"--check measured {checked:.2f} GB/s" if checked else "what the links can do: du-launch --check"
    said = f"the collectives' bus bandwidth: {bus:.2f} GB/s ({links})"
    advice = "; more time in transfers than in computing: a faster link, compression= or DiLoCo"
    transfers_dominate = least > max(ADVISE_SECONDS, statistics.median(computing.values()))
    log(said + (advice if transfers_dominate else ""))
    if account:
        try:
            Path(account).write_text(json.dumps(dict(ranks=dict(sorted(ranks.items())), straggler=straggler)))
        except OSError as e:
            log(f"could not write the account to {account}: {e}")
    return straggler


def merge_timeline(path, n, straggler=None):
    """The ranks' timelines (``trace.rank-R.json``, those on this host) merged into ``path``, a row per
    rank: the compute between collectives shown, and each collective's wait for the last rank to start it."""
    files = [Path(timeline_path(path, r)) for r in range(n)]
    merged, by_seq = [], collections.defaultdict(dict)  # a collective's (group, number) -> rank -> its event
    for r, events in [(r, json.loads(f.read_text())) for r, f in enumerate(files) if f.exists()]:
        name = f"rank {r}" + (" (the straggler)" if r == straggler else "")
        ours = [e for e in events if e["args"]["seq"]]
        merged += [dict(name="process_name", ph="M", pid=r, args=dict(name=name)), *events]
        merged += [
            dict(a, name="compute", ts=a["ts"] + a["dur"], dur=b["ts"] - a["ts"] - a["dur"], args={})
            for a, b in zip(ours, ours[1:])
        ]
        for e in ours:  # (each group numbers its own collectives)
            by_seq[e["args"].get("group", ""), e["args"]["seq"]][r] = e
    for started in by_seq.values():
        last = max(started, key=lambda r: started[r]["ts"])
        for e in started.values():
            e["args"].update(waited_ms=(started[last]["ts"] - e["ts"]) / 1e3, for_rank=last)
    Path(path).write_text(json.dumps({"traceEvents": merged}))
    rows = sorted({e["pid"] for e in merged})
    log(f"the timeline: {path} (open it in https://ui.perfetto.dev), with rows for ranks {rows}")


def forward(stream, out, report, rank=None):
    """Copy ``stream`` to ``out`` line by line, each line prefixed with its rank, and scan it. ``rank=None``:
    mpirun's stream, whose ``--output tag`` names each line's rank (its own lines have none). A carriage
    return ends a line too: progress bars redraw in place, each with its rank."""
    last_rank, redraw = None, False  # redraw: the last piece ended with a carriage return
    for line in _pieces(stream, tagged=rank is None):
        line_rank, from_rank = rank, True
        if rank is None:
            if m := _TAG.match(line):  # (mpirun's pseudo-terminal leaves a NUL when a rank aborts)
                line_rank, line = int(m.group(1)), line[m.end() :].replace(b"\0", b"")
            else:  # the rest of a redrawn line, or mpirun's own
                line_rank, from_rank = (last_rank, True) if redraw else (None, False)
        if not line:
            continue
        if not line.endswith((b"\n", b"\r")):  # a last line without its end: not glued to the next
            line += b"\n"
        if report.scan(line, line_rank, from_rank):
            # a redraw ("\rbar") returns first, then draws with one prefix
            body = line.lstrip(b"\r")
            prefix = b"[rank %d] " % line_rank if line_rank is not None and body else b""
            with _print_lock, contextlib.suppress(BrokenPipeError):  # (no reader left: the job goes on)
                out.write(line[: len(line) - len(body)] + prefix + body)
                out.flush()
        last_rank, redraw = line_rank, line.endswith(b"\r")


def _pieces(stream, tagged=False):
    """``stream``'s bytes in pieces that each end with a newline or a carriage return, or before a record
    (a progress bar may leave its line without an end; not right after mpirun's tag), or, ``tagged``, before
    mpirun's tag (a rank's last line may have no end); and the rest."""
    ends = [rb"(?<=\n)", rb"(?<=\r)(?!\n)", rb"(?<=.)(?<!>: )(?=" + re.escape(RECORD_PREFIX.encode()) + rb")"]
    if tagged:
        ends.append(rb"(?<=.)(?=\[\d+,\d+\]<std(?:out|err)>: )")
    ends = b"|".join(ends)
    rest = b""
    while chunk := stream.read1(1 << 16):
        *pieces, rest = re.split(ends, rest + chunk)
        yield from pieces
    if rest:
        yield rest


#: How a job failed: its exit code, the rank that caused it (None when not known), and how.
Failure = collections.namedtuple("Failure", "code rank how")


def supervise(procs, world_size, env, tagged=False, grace=0, checked=None, account=None):
    """Wait for every process; when one fails, stop the rest; then the job's account. Returns (exit code,
    Report, Failure or None). ``env``: what du-launch gave the ranks; ``tagged``: ``procs`` is one mpirun,
    which stops the ranks itself; ``grace``: see ``stop_on_signals``; ``checked``, ``account``: see show_account."""
    report = Report(world_size, env.get("DU_RECORD_TOKEN"))
    stop_on_signals(procs, report, grace)  # (before any output shows: a line seen means they are set)
    readers = {}  # rank (0 for mpirun) -> the threads reading its output
    for rank, p in enumerate(procs):
        for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
            t = threading.Thread(
                target=forward, args=(stream, out, report, None if tagged else rank), daemon=True
            )
            t.start()
            readers.setdefault(rank, []).append(t)
    failure = wait_mpirun(procs[0], report) if tagged else wait_ranks(procs, report, readers)
    stop(procs)  # (the ranks left when one failed)
    if report.grace is not None:  # ended in time: the grace period no longer runs
        report.grace.cancel()
    deadline = time.monotonic() + GRACE_SECONDS  # for the output still in the pipes
    for t in [t for ts in readers.values() for t in ts]:  # (a process on a lost host may hold them open)
        t.join(timeout=max(0, deadline - time.monotonic()))
    show_lost_reports(report, env["DU_REPORT_DIR"])
    if report.watchdog and failure is not None:  # (a collective that ended within the grace: no failure)
        log(report.watchdog_summary())
    straggler = show_account(report, checked, account) if failure is None else None
    if env.get("DU_TIMELINE"):  # (also of a job that failed: the ranks that ended normally)
        try:
            merge_timeline(env["DU_TIMELINE"], world_size, straggler)
        except (OSError, ValueError) as e:  # (a rank's file cut short: the job's exit code comes first)
            log(f"could not merge the timeline {env['DU_TIMELINE']}: {e}")
    return (0 if failure is None else failure.code), report, failure


def wait_ranks(procs, report, readers):
    """The ring's processes, one per rank: wait until all exit 0 (None), or one fails: then let
    the others that fail with it settle, and name the cause (a Failure; ``supervise`` stops the rest)."""
    exited, exits = queue.SimpleQueue(), []  # (rank, code), in the order the launcher saw them
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r, p: exited.put((r, p.wait())), args=(rank, p), daemon=True).start()
    while len(exits) < len(procs) and all(code == 0 for _, code in exits):
        exits.append(exited.get())
    if all(code == 0 for _, code in exits):
        return None
    deadline = time.monotonic() + SETTLE_SECONDS  # for the others that fail with it
    with contextlib.suppress(queue.Empty):
        while len(exits) < len(procs):
            exits.append(exited.get(timeout=max(0, deadline - time.monotonic())))
    failures = [(r, c) for r, c in exits if c]
    ended = _launchers_own(report, [-c for _, c in failures])
    if ended is not None:
        return ended
    deadline = time.monotonic() + SETTLE_SECONDS  # their last words say whether they only lost a peer
    for t in [t for r, _ in failures for t in readers[r]]:
        t.join(timeout=max(0, deadline - time.monotonic()))
    # Ranks that exit within a few ms of each other are reaped in any order: the cause is the
    # first one that did not merely lose a peer; if they all did, a rank that left early.
    cause = next((f for f in failures if f[0] not in report.peer_lost), None)
    early = [r for r, c in exits if c == 0]  # (reaped in any order too)
    if cause is None and early:
        log(
            f"rank {early[0]} exited with code 0 while the others still ran: it left the job early "
            f"(ranks {sorted(report.peer_lost)} lost it as a peer); stopping the other ranks"
        )
        return Failure(exit_code(failures[0][1]), early[0], "left the job early (exit code 0)")
    rank, code = cause or failures[0]
    log(f"rank {rank} {how_it_ended(code)}; stopping the other ranks")
    return Failure(exit_code(code), rank, how_it_ended(code))


def wait_mpirun(proc, report):
    """mpirun's exit: None, or a Failure naming the failed rank from mpirun's report. Stops an
    mpirun that has not ended the job MPIRUN_GRACE seconds after a rank failed (a lost host)."""
    while proc.poll() is None:
        if report.failure.wait(timeout=1):
            try:
                proc.wait(timeout=MPIRUN_GRACE)
            except subprocess.TimeoutExpired:
                log(f"mpirun has not ended the job {MPIRUN_GRACE} s after a rank failed; killing it")
                stop([proc], signals=(signal.SIGKILL,))
                code = WATCHDOG_EXIT if report.watchdog else 1
                return Failure(code, min(report.stopped, default=report.failed_rank), how_it_ended(code))
    ended = _launchers_own(report, [report.signal])
    if ended is not None:
        return ended
    code = exit_code(proc.returncode)
    if code == 0 and report.lost_host:  # mpirun says so, then exits 0
        log("mpirun lost a host and ended the job")
        return Failure(1, None, "was on a host that mpirun lost")
    if code == 0:
        return None
    rank = min(report.stopped, default=report.failed_rank)
    how = how_it_ended(-report.signal if report.signal else code)
    if rank is not None and not report.stopped:
        log(f"rank {rank} {how}; mpirun stopped the other ranks")
    return Failure(code, rank, how)


def exit_code(returncode) -> int:
    """A process's exit code as a shell gives it: 128 + N for signal N (Popen's -N)."""
    return SIGNAL_EXIT - returncode if returncode < 0 else returncode


def _launchers_own(report, signals):
    """None, unless the ranks ended by du-launch's doing: it stops them (wait for ``stop_on_signals`` to
    end du-launch), or they ended on the SIGUSR1 it forwarded (no du.preempted): a Failure of no rank."""
    if report.stopping is not None:
        threading.Event().wait()
    if report.preempted is None or set(signals) != {signal.SIGUSR1}:
        return None
    log("the ranks ended on the forwarded SIGUSR1 (the program does not call du.preempted)")
    return Failure(exit_code(-report.preempted), None, "ended on the preemption signal")


def how_it_ended(code) -> str:
    """``code`` from Popen.returncode: negative for a signal."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == WATCHDOG_EXIT:
        return f"exited with code {code} (the watchdog's: stuck past the timeout)"
    return f"exited with code {code}"


def show_lost_reports(report, report_dir):
    """Show (and scan) the watchdog reports that ranks wrote to ``report_dir`` but whose
    output never reached the launcher (captured in the process, by pytest say)."""
    for path in sorted(Path(report_dir).glob("rank-*.report")):
        m = re.fullmatch(r"rank-(\d+)\.report", path.name)
        if m and int(m[1]) not in report.watchdog:
            for line in path.read_bytes().splitlines(keepends=True):
                if report.scan(line, int(m[1]), True):
                    log(f"[rank {m[1]}] {line.decode(errors='replace').rstrip()}")


def stop(procs, signals=(signal.SIGTERM, signal.SIGKILL)):
    """Signal every process's group at once, then wait up to GRACE_SECONDS for them all, for
    each signal in turn: the job ends within 2 x GRACE_SECONDS whatever its size."""
    for sig in signals:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
                    os.killpg(p.pid, signal.SIGCONT)  # a stopped process acts on signals only once continued
        deadline = time.monotonic() + GRACE_SECONDS
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0, deadline - time.monotonic()))


def stop_on_signals(procs, report, grace=0):
    """Ctrl-C or SIGHUP (a closed terminal or ssh session) stops the whole job. SIGTERM or SIGUSR1 (a
    scheduler's preemption) is forwarded to the ranks as SIGUSR1 (``preemption.py``; mpirun forwards it to
    its ranks): the job gets ``grace`` seconds to end before it is stopped (0: SIGTERM stops it at once).
    Stopped so, it exits 128 + the signal, no rank blamed (SIGKILL: the ranks stop themselves, ``spawn``)."""

    def stop_all(signum, frame=None, why=None):  # (a signal handler, or the grace period's end)
        report.stopping = signum
        try:
            log(f"{why or f'received {signal.Signals(signum).name}'}; stopping all ranks")
        finally:  # (a closed terminal fails the log)
            stop(procs)
            os._exit(exit_code(-signum))  # from any thread's wait: no restart after this

    def preempt(signum, frame):
        if report.preempted is not None:
            return
        report.preempted = signum
        log(
            f"received {signal.Signals(signum).name}: forwarded to the ranks as SIGUSR1; they have {grace:g} s "
            "to save (du.preempted) and exit"
        )
        for p in procs:
            if not getattr(p, "remote", False):  # (remote ranks hear it from du.preempted's collective)
                p.send_signal(signal.SIGUSR1)
        why = f"the job did not end within the grace period ({grace:g} s)"
        report.grace = threading.Timer(grace, stop_all, (signum, None, why))
        report.grace.daemon = True
        report.grace.start()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            preempting = grace and sig in (signal.SIGTERM, signal.SIGUSR1)
            signal.signal(sig, preempt if preempting else stop_all)


def log(message):
    with _print_lock, contextlib.suppress(BrokenPipeError):  # (no reader left: the job goes on)
        print(f"du-launch: {message}", file=sys.stderr, flush=True)
