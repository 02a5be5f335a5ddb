"""Two hosts made of Linux network namespaces joined by a veth pair, as a user with two machines
runs a job: a hostfile, and a remote shell (here `ip netns exec`, where they would use ssh).

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; skipped, with the reason, only
where the machine forbids namespaces. Nothing leaves the two namespaces: the addresses are the
test's own and neither namespace has a route anywhere else.
"""

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from launching import ROOT, launch

TRAIN = str(ROOT / "tests" / "programs" / "train.py")
TIMEOUT = 3  # the watchdog timeout in these tests


class Hosts:
    """Namespaces ``du<pid>a`` (10.77.0.1) and ``du<pid>b`` (10.77.0.2); the launcher runs on a."""

    def __init__(self, tmp):
        tag = f"du{os.getpid()}"
        self.names = [tag + "a", tag + "b"]
        self.addresses = ["10.77.0.1", "10.77.0.2"]
        self.hostfile = tmp / "hosts"
        self.hostfile.write_text("".join(f"{a} slots=1\n" for a in self.addresses))
        self.shell = tmp / "netns-shell"  # HOST COMMAND...: run COMMAND on HOST, as ssh would
        cases = "".join(f"  {a}) ns={n} ;;\n" for a, n in zip(self.addresses, self.names))
        self.shell.write_text(
            "#!/bin/sh\nhost=$1; shift\ncase $host in\n" + cases
            + '  *) echo "netns-shell: no host $host" >&2; exit 255 ;;\nesac\n'
            + 'exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && $*"\n'
        )  # fmt: skip
        self.shell.chmod(0o755)

    def create(self):
        a, b = self.names
        ip("link", "add", a, "type", "veth", "peer", "name", b)
        for name, address in zip(self.names, self.addresses):
            ip("link", "set", name, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", name)
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "link", "set", name, "up")

    def launcher(self, backend, command, hostfile=None, remote_shell=None):
        """argv that runs du-launch on host a."""
        return [
            "ip", "netns", "exec", self.names[0], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
            self.names[0], sys.executable, "-m", "distributed_utils.launch", "--backend", backend,
            "--hostfile", str(hostfile or self.hostfile), "--remote-shell", remote_shell or f"{self.shell} {{host}}",
            *command,
        ]  # fmt: skip

    def run(self, backend, command, timeout=120, **kw):
        return subprocess.run(self.launcher(backend, command, **kw), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "DU_TIMEOUT": "30"})  # fmt: skip

    def set_link(self, state):
        ip("-n", self.names[0], "link", "set", self.names[0], state)

    def pids(self, running=""):
        """The processes in the namespaces (whose command line contains ``running``)."""
        pids = [int(p) for n in self.names for p in ip("netns", "pids", n).split()]
        return [p for p in pids if running in command_line(p)]

    def remove(self):
        for pid in self.pids():  # processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def command_line(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ip(*args) -> str:
    run = subprocess.run(["ip", *args], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")
    return run.stdout


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
    assert f"[rank 0] done at step 12 on {a}" in multi.stdout and f"[rank 1] done at step 12 on {b}" in multi.stdout
    single = launch(2, backend, ["python", TRAIN, str(tmp_path / "single")], timeout=120)
    assert single.returncode == 0, single.stdout
    want, got = final_params(tmp_path / "single"), final_params(tmp_path / "multi")
    assert want.keys() == got.keys()
    for key in want:
        assert mx.array_equal(want[key], got[key]).item(), key


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_cutting_the_link_mid_run_ends_the_job_on_every_host(hosts, backend, tmp_path):
    log = tmp_path / "rank"
    command = ["python", TRAIN, str(tmp_path / "out"), "--steps", str(10**9), "--say-at", "20", "--log", str(log)]
    proc = subprocess.Popen(
        hosts.launcher(backend, command), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "DU_TIMEOUT": str(TIMEOUT)},
    )  # fmt: skip
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)], daemon=True).start()
    output = []
    try:
        while not any("at step 20" in line for line in output):
            line = lines.get(timeout=60)
            assert line is not None, "".join(output)
            output.append(line)
        hosts.set_link("down")
        cut = time.monotonic()
        code = proc.wait(timeout=60)
        ended = time.monotonic() - cut
        while (line := lines.get(timeout=10)) is not None:
            output.append(line)
        output = "".join(output)
        assert code == 124, output
        assert ended < TIMEOUT + 15, output  # the watchdog, its grace, and mpirun's (5 s) at most
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
        "10.77.0.9 true` failed: ssh: connect to host 10.77.0.9 port 22: "
    ) in run.stderr, run.stderr
