"""Jobs across two hosts made of Linux network namespaces (``hosts.py``), as a user with two
machines runs them: a hostfile and a remote shell. Skipped, with the reason, only where the
machine forbids namespaces."""

import os
import queue
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from hosts import Hosts, command_line, ip
from launching import ROOT, launch

TRAIN = str(ROOT / "tests" / "programs" / "train.py")
TIMEOUT = 3  # the watchdog timeout in these tests


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs `ip` (iproute2) and `unshare` (util-linux)")
    h = Hosts(tmp_path_factory.mktemp("hosts"))
    probe = subprocess.run(["ip", "netns", "add", h.names[0]], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"this machine forbids network namespaces: `ip netns add` says {probe.stderr.strip()!r}")
    try:
        ip("netns", "add", h.names[1])
        h.create()
        yield h
    finally:
        h.remove()


def final_params(path):
    return mx.load(str(path) + ".safetensors")


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_training_across_two_hosts_matches_one_host(hosts, backend, tmp_path):
    multi = hosts.run(backend, ["python", TRAIN, str(tmp_path / "multi")])
    assert multi.returncode == 0, multi.stdout + multi.stderr
    a, b = hosts.names
    assert (
        f"[rank 0] done at step 12 on {a}" in multi.stdout
        and f"[rank 1] done at step 12 on {b}" in multi.stdout
    )
    single = launch(2, backend, ["python", TRAIN, str(tmp_path / "single")], timeout=120)
    assert single.returncode == 0, single.stdout
    want, got = final_params(tmp_path / "single"), final_params(tmp_path / "multi")
    assert want.keys() == got.keys()
    for key in want:
        assert mx.array_equal(want[key], got[key]).item(), key


@pytest.mark.parametrize("backend", ["ring"])  # (across hosts, each transport: the test above)
def test_diloco_over_a_100_mbit_link_ends_with_identical_replicas(hosts, backend, tmp_path):
    """The link shaped with tc's token bucket filter; 12 steps syncing every 4: the replicas end
    bit-identical, and as the same job on one host."""
    hosts.shape("100mbit")
    try:
        multi = hosts.run(backend, ["python", TRAIN, str(tmp_path / "multi"), "--diloco", "4"])
    finally:
        hosts.shape(None)
    assert multi.returncode == 0, multi.stdout + multi.stderr
    digests = dict(re.findall(r"\[rank (\d)\] done at step 12 on \S+, parameters (\w+)", multi.stdout))
    assert len(digests) == 2 and digests["0"] == digests["1"], multi.stdout
    single = launch(2, backend, ["python", TRAIN, str(tmp_path / "single"), "--diloco", "4"], timeout=120)
    assert single.returncode == 0, single.stdout
    assert "[rank 0] done at step 12 on" in single.stdout and f"parameters {digests['0']}" in single.stdout, (
        single.stdout
    )


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_cutting_the_link_mid_run_ends_the_job_on_every_host(hosts, backend, tmp_path):
    log = tmp_path / "rank"
    command = [
        "python",
        TRAIN,
        str(tmp_path / "out"),
        "--steps",
        str(10**9),
        "--say-at",
        "20",
        "--log",
        str(log),
    ]
    proc = subprocess.Popen(
        hosts.launcher(backend, command),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DU_TIMEOUT": str(TIMEOUT)},
    )
    lines = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)], daemon=True
    ).start()
    output = []
    try:
        while not any("at step 20" in line for line in output):
            line = lines.get(timeout=60)
            assert line is not None, "".join(output)
            output.append(line)
        hosts.set_link("down")
        code = proc.wait(timeout=60)  # a bound for a hang, not a measurement
        while (line := lines.get(timeout=10)) is not None:
            output.append(line)
        output = "".join(output)
        assert code == 124, output
        for rank in (0, 1):  # from each rank's own log: its output may not cross the cut link
            report = (tmp_path / f"rank-{rank}.log").read_text()
            assert f"du watchdog: rank {rank}: " in report and "waiting since" in report, report
        # Every rank ended on its own host. (mpirun's daemon on the host it lost may stay a while:
        # it cannot hear that the job ended.)
        deadline = time.monotonic() + 10
        while hosts.pids(running=TRAIN) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not hosts.pids(running=TRAIN), [command_line(p) for p in hosts.pids(running=TRAIN)]
    finally:
        if proc.poll() is None:
            proc.kill()
        hosts.set_link("up")


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_hostfile_with_an_unreachable_host_is_a_clear_error(hosts, backend, tmp_path):
    if shutil.which("ssh") is None:
        pytest.skip("needs an ssh client (openssh-client)")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.77.0.1 slots=1\n10.77.0.9 slots=1\n")  # no host has 10.77.0.9
    ssh = "ssh -o ConnectTimeout=2 -o BatchMode=yes {host}"
    run = hosts.run(backend, ["python", "-c", "pass"], timeout=60, hostfile=hostfile, remote_shell=ssh)
    assert run.returncode != 0
    assert (
        "du-launch: host 10.77.0.9 (ranks [1]) is unreachable: `ssh -o ConnectTimeout=2 -o BatchMode=yes "
        "10.77.0.9 python -m distributed_utils.preflight` failed: ssh: connect to host 10.77.0.9 port 22: "
    ) in run.stderr, run.stderr


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_check_shows_every_hosts_environment_and_measures_the_link(hosts, backend):
    run = hosts.run(backend, ["--check", "python", TRAIN, "out"])
    assert run.returncode == 0, run.stdout + run.stderr
    for address in hosts.addresses:
        assert f"du-launch: {address}: Python {sys.version.split()[0]} (" in run.stderr, run.stderr
    assert f"{TRAIN} exists" in run.stderr, run.stderr
    pattern = (
        rf"\[rank 0\] {hosts.names[0]} <-> {hosts.names[1]} \(2 ranks, \w+Backend\): latency \d+ us; "
        r"bus bandwidth 1 MB [\d.]+ GB/s, 16 MB [\d.]+ GB/s, 64 MB [\d.]+ GB/s"
    )
    assert re.search(pattern, run.stdout), run.stdout


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_host_with_another_mlx_is_named_at_check_and_at_every_start(hosts, backend, tmp_path):
    """Host b has MLX 0.0.1 installed (its metadata first on PYTHONPATH): --check, and a plain
    start, stop with the host and what differs, before any rank runs."""
    info = tmp_path / "skew" / "mlx-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx\nVersion: 0.0.1\n")
    shell = tmp_path / "skewed-shell"
    shell.write_text(
        f'#!/bin/sh\nif [ "$1" = 10.77.0.2 ]; then export PYTHONPATH={tmp_path / "skew"}; fi\n'
        f'exec {hosts.shell} "$@"\n'
    )
    shell.chmod(0o755)
    for command in (["--check", "python", TRAIN, "out"], ["python", "-c", "print('a rank ran')"]):
        run = hosts.run(backend, command, remote_shell=f"{shell} {{host}}")
        assert run.returncode == 1, run.stdout + run.stderr
        assert "du-launch: the hosts' environments differ" in run.stderr, run.stderr
        assert (
            f"host 10.77.0.2 differs from host 10.77.0.1: mlx 0.0.1 (not {mx.__version__})" in run.stderr
        ), run.stderr
        assert "a rank ran" not in run.stdout and "[rank" not in run.stdout


RESUME = str(ROOT / "tests" / "programs" / "resume.py")


@pytest.mark.parametrize("backend,min_ranks", [("ring", None), ("ring", 2), ("mpi", 2)])
def test_a_host_lost_at_a_restart_ends_the_job_unless_fewer_ranks_may_go_on(
    hosts, backend, min_ranks, tmp_path
):
    """Ranks 0-1 on host a, rank 2 on host b; rank 1 dies at step 13 (last checkpoint: step
    10), and host b answers the first probe only. Without --min-ranks the restart stops with
    the reason; with --min-ranks 2 the job goes on with 2 ranks, resuming mid-epoch."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.77.0.1 slots=2\n10.77.0.2 slots=1\n")
    shell = tmp_path / "b-goes-down"
    shell.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = 10.77.0.2 ] && expr "$2" : ".*distributed_utils.preflight" >/dev/null; then\n'
        f"  if [ -e {tmp_path}/probed ]; then echo 'ssh: connect to host 10.77.0.2 port 22: No route to host' >&2; exit 255; fi\n"
        f"  touch {tmp_path}/probed\n"
        f'fi\nexec {hosts.shell} "$@"\n'
    )
    shell.chmod(0o755)
    allow = [] if min_ranks is None else ["--min-ranks", str(min_ranks)]
    command = [
        "--max-restarts",
        "1",
        *allow,
        "python",
        RESUME,
        str(tmp_path / "out"),
        str(tmp_path / "ck"),
        "--die-at",
        "13",
    ]
    run = hosts.run(backend, command, hostfile=hostfile, remote_shell=f"{shell} {{host}}")
    assert "attempt 1 failed: rank 1 on 10.77.0.1 was killed by SIGKILL" in run.stderr, run.stderr
    lost = (
        f"du-launch: host 10.77.0.2 (ranks [2]) is unreachable: `{shell} 10.77.0.2 python -m "
        "distributed_utils.preflight` failed: ssh: connect to host"
    )
    assert lost in run.stderr, run.stderr
    if min_ranks is None:
        assert run.returncode == 1, run.stdout + run.stderr
        assert "[rank 0] resumed" not in run.stdout
        return
    assert run.returncode == 0, run.stdout + run.stderr
    assert "du-launch: starting 2 ranks instead of 3 (--min-ranks 2)" in run.stderr, run.stderr
    for r in range(2):
        assert f"[rank {r}] resumed at step 10, epoch 1, saved by 3 ranks" in run.stdout, run.stdout
    assert "[rank 0] done at step 31;" in run.stdout, run.stdout


FAULTS = ("kill", "stop", "raise", "exit0", "cut")


# on the ring alone (the backend of Macs): each fault's effect on mpi has its own test in test_reliability.py
@pytest.mark.parametrize("backend", ["ring"])
def test_soak_a_job_survives_a_fault_of_every_kind_and_ends_bit_identical(hosts, backend, tmp_path, capsys):
    """3 ranks (0-1 on host a, 2 on host b), 6 epochs, a checkpoint every 5 steps, and
    ``--max-restarts 5``: each attempt gets one fault, of every kind in a random order, on a
    random rank at a random later step (SOAK_SEED repeats a run). The network comes back
    when du-launch next probes host b. The job must finish with the final parameters of the
    uninterrupted run, bit for bit."""
    seed = int(os.environ.get("SOAK_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    steps = np.cumsum([rng.randint(3, 7) for _ in FAULTS]).tolist()  # of 48 (8 per epoch)
    plan = [
        (attempt, step, rng.randrange(3), kind)
        for attempt, (step, kind) in enumerate(zip(steps, rng.sample(FAULTS, len(FAULTS))))
    ]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.77.0.1 slots=2\n10.77.0.2 slots=1\n")
    link = f"ip -n {hosts.names[0]} link set {hosts.names[0]}"
    shell = tmp_path / "repairing-shell"  # the netns shell; probing host b repairs the link first
    shell.write_text(
        f'#!/bin/sh\nif expr "$2" : ".*distributed_utils.preflight" >/dev/null; then {link} up; fi\n'
        f'exec {hosts.shell} "$@"\n'
    )
    shell.chmod(0o755)

    def train(name, launcher_options=(), options=()):
        command = [
            *launcher_options,
            "--timeout",
            str(TIMEOUT),
            "python",
            RESUME,
            str(tmp_path / name),
            str(tmp_path / f"ck-{name}"),
            "--epochs",
            "6",
            *options,
        ]
        return hosts.run(backend, command, timeout=300, hostfile=hostfile, remote_shell=f"{shell} {{host}}")

    whole = train("whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    faults = [f"--fault={a}:{s}:{r}:{k}" for a, s, r, k in plan]
    run = train("soaked", ["--max-restarts", str(len(plan))], ["--cut", f"{link} down", *faults])
    survived = run.stderr.count("du-launch: restarting the job")
    summary = (
        f"soak on {backend} (SOAK_SEED={seed}): {len(plan)} faults injected "
        f"({', '.join(f'{k} on rank {r} at step {s}' for _, s, r, k in plan)}); {survived} survived"
    )
    with capsys.disabled():
        print(f"\n{summary}")
    assert run.returncode == 0, f"{summary}\n{run.stdout}{run.stderr}"
    assert survived == len(plan), f"{summary}\n{run.stderr}"
    injected = (tmp_path / "soaked.faults").read_text()
    assert injected == "".join(f"[rank {r}] fault: {k} at step {s}\n" for _, s, r, k in plan), (
        f"{summary}\n{injected}"
    )
    want, got = final_params(tmp_path / "whole"), final_params(tmp_path / "soaked")
    assert want.keys() == got.keys()
    for key in want:
        assert mx.array_equal(want[key], got[key]).item(), f"{summary}: {key} differs"


def test_check_finds_a_faster_path_between_the_hosts_than_the_hostfiles(hosts):
    """#29.3: the hosts joined twice, the hostfile's link (10.77.0.x) shaped to 500 Mbit/s and a second
    one (10.78.0.x) not: `du-launch --check` on mpi measures both (ring jobs, whatever the backend: they
    use the addresses they are given) and says which to write in the hostfile."""
    with hosts.second_path(["10.78.0.1", "10.78.0.2"]):
        hosts.shape("500mbit")
        try:
            run = hosts.run("mpi", ["--check", "python"], timeout=240)
        finally:
            hosts.shape(None)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout + run.stderr
    assert "measuring another path between 10.77.0.1 and 10.77.0.2: 10.78.0.1 <-> 10.78.0.2" in out, out
    faster = re.search(
        r"10.78.0.1 <-> 10.78.0.2 is faster than the hostfile's 10.77.0.1 <-> 10.77.0.2: ([\d.]+) GB/s against "
        r"([\d.]+); to use it, write 10.78.0.2 for 10.77.0.2 in the hostfile \(and 10.78.0.1 for 10.77.0.1\)",
        out,
    )
    assert faster and float(faster[1]) > 1.2 * float(faster[2]), out
    assert float(faster[2]) < 0.075 and "steps" not in out, out  # (500 Mbit/s: 0.0625 GB/s; no account)
