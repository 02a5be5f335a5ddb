"""Two hosts made of Linux network namespaces joined by a veth pair (tests/test_multihost.py,
benchmarks/links.py): a hostfile, and a remote shell (`ip netns exec`, where users have ssh).
Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and util-linux's unshare. Nothing
leaves the two namespaces: the addresses are these hosts' own and neither has a route elsewhere."""

import contextlib
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from launching import DU_LAUNCH

ROOT = Path(__file__).resolve().parent.parent


class Hosts:
    """Namespaces ``du<pid>a`` (10.77.0.1) and ``du<pid>b`` (10.77.0.2); the launcher runs on a."""

    def __init__(self, tmp):
        tag = f"du{os.getpid()}"
        self.names = [tag + "a", tag + "b"]
        self.addresses = ["10.77.0.1", "10.77.0.2"]
        self.hostfile = tmp / "hosts"
        self.hostfile.write_text("".join(f"{a} slots=1\n" for a in self.addresses))
        self.shell = tmp / "netns-shell"  # HOST COMMAND...: run COMMAND on HOST, as ssh would
        self.write_shell(self.addresses)

    def write_shell(self, addresses):
        """The remote shell, knowing ``addresses`` (a's, b's, a's, ...)."""
        cases = "".join(f"  {a}) ns={self.names[i % 2]} ;;\n" for i, a in enumerate(addresses))
        self.shell.write_text(
            "#!/bin/sh\nhost=$1; shift\ncase $host in\n"
            + cases
            + '  *) echo "netns-shell: no host $host" >&2; exit 255 ;;\nesac\n'
            + 'exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && $*"\n'
        )
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
            "ip",
            "netns",
            "exec",
            self.names[0],
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.names[0],
            *DU_LAUNCH,
            "--backend",
            backend,
            "--hostfile",
            str(hostfile or self.hostfile),
            "--remote-shell",
            remote_shell or f"{self.shell} {{host}}",
            *command,
        ]

    def run(self, backend, command, timeout=120, **kw):
        return subprocess.run(
            self.launcher(backend, command, **kw),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "DU_TIMEOUT": "30"},
        )

    @contextlib.contextmanager
    def second_path(self, addresses):
        """A second veth pair between the hosts (``du<pid>ax``, ``du<pid>bx``) with ``addresses``, a's
        then b's, which the remote shell knows too; removed after the ``with`` block."""
        devices = [n + "x" for n in self.names]
        ip("link", "add", devices[0], "type", "veth", "peer", "name", devices[1])
        try:
            for name, device, address in zip(self.names, devices, addresses):
                ip("link", "set", device, "netns", name)
                ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
                ip("-n", name, "link", "set", device, "up")
            self.write_shell(self.addresses + addresses)
            yield
        finally:
            subprocess.run(["ip", "-n", self.names[0], "link", "del", devices[0]], capture_output=True)
            subprocess.run(["ip", "link", "del", devices[0]], capture_output=True)  # (if not moved yet)
            self.write_shell(self.addresses)

    def set_link(self, state):
        ip("-n", self.names[0], "link", "set", self.names[0], state)

    def shape(self, rate):
        """Limit the link to ``rate`` ("100mbit", "1gbit", ...) each way, with tc's token bucket
        filter (a burst of 10 ms at that rate); None: unlimited again."""
        for name in self.names:
            if rate is None:
                subprocess.run(
                    ["ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", name, "root"],
                    capture_output=True,
                )
                continue
            burst = max(
                32_000,
                int(
                    float(rate.removesuffix("mbit").removesuffix("gbit"))
                    * (1e9 if rate.endswith("gbit") else 1e6)
                    / 8
                    / 100
                ),
            )
            run = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    name,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    name,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    str(burst),
                    "latency",
                    "50ms",
                ],
                capture_output=True,
                text=True,
            )
            if run.returncode:
                raise RuntimeError(f"tc on {name}: {run.stderr.strip()}")

    def sent_bytes(self) -> list:
        """Bytes each host has sent over the link so far."""
        return [
            int(ip("-n", n, "-s", "-j", "link", "show", "dev", n).split('"tx":{"bytes":')[1].split(",")[0])
            for n in self.names
        ]

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


@contextlib.contextmanager
def made_hosts():
    """The two hosts, made (namespaces, veth) for the ``with`` block and removed after it."""
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Hosts(Path(tmp))
        try:
            for name in hosts.names:
                ip("netns", "add", name)
            hosts.create()
            yield hosts
        finally:
            hosts.remove()


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
