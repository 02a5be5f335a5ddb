"""Reliability under du-launch: the watchdog, the debug check, dead ranks, checkpoints that
survive a crash mid-write, and launcher inputs that fail with a clear error."""

import os
import re
import socket
import subprocess
import sys
import time

import mlx.core as mx
import pytest

from launching import ROOT, launch

TIMEOUT = 3  # the watchdog timeout in these tests, in seconds
TRAIN = str(ROOT / "tests" / "programs" / "train.py")

ONE_RANK_NEVER_COMES = """
import time, mlx.core as mx, distributed_utils as du
b = du.initialize()
du.barrier(b)
if du.local_rank(b) == 1:
    time.sleep(600)  # the rank that never reaches the collective (what is tested, not a wait)
du.allreduce(b, mx.ones((1024,)), "sum")
"""

MISMATCHED = """
import mlx.core as mx, distributed_utils as du
b = du.initialize()
r = du.local_rank(b)
for name, call in [
    ("shape", lambda: du.allreduce(b, mx.ones((3 + (r == 1),)), "sum")),
    ("op", lambda: du.allreduce(b, mx.ones(3), "sum") if r != 1 else du.bcast(b, mx.ones(3))),
]:
    try:
        call()
    except du.CollectiveMismatchError as e:
        print(f"rank {r} {name}: {e}")
    du.barrier(b)  # every rank raised and they are still in step
raise SystemExit(3)
"""

KILLED = """
import os, signal, time, mlx.core as mx, distributed_utils as du
b = du.initialize()
x = mx.ones((4096,))
for i in range(10**7):
    du.allreduce(b, x, "sum")
    if i == 50 and du.local_rank(b) == 1:
        print(f"killed at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""

EXITS = """
import sys, distributed_utils as du
b = du.initialize()
if du.local_rank(b) == 1:
    sys.exit(7)
du.barrier(b)
"""


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_collective_a_rank_never_joins_ends_the_job_within_the_timeout(backend):
    start = time.monotonic()
    run = launch(3, backend, ["--timeout", str(TIMEOUT), "python", "-c", ONE_RANK_NEVER_COMES], timeout=60)
    assert run.returncode == 124, run.stdout
    assert time.monotonic() - start < 30, run.stdout  # not the 600 s the missing rank sleeps
    for rank in (0, 2):
        report = re.search(
            rf"\[rank {rank}\] du watchdog: rank {rank}: collective #\d+ allreduce\(sum\) float32\(1024,\) "
            r"waiting since \d\d:\d\d:\d\d \(([\d.]+) s, timeout 3 s",
            run.stdout,
        )  # fmt: skip
        assert report and TIMEOUT <= float(report.group(1)) < TIMEOUT + 2, run.stdout
    assert "the watchdog ended the job: ranks [0, 2] waited past the timeout" in run.stdout, run.stdout
    assert "ranks [1] did not report waiting" in run.stdout, run.stdout


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_debug_mode_reports_mismatched_collectives_on_every_rank(backend):
    run = launch(3, backend, ["--debug", "python", "-c", MISMATCHED], timeout=60)
    assert run.returncode == 3, run.stdout
    for r in range(3):
        assert re.search(
            rf"\[rank {r}\] rank {r} shape: ranks issued different collectives \(DU_DEBUG\): "
            r"ranks \[0, 2\] call #(\d+) allreduce\(float32\(3,\), sum\); "
            r"ranks \[1\] call #\1 allreduce\(float32\(4,\), sum\)",
            run.stdout,
        ), run.stdout  # fmt: skip
        assert re.search(
            rf"\[rank {r}\] rank {r} op: .*ranks \[0, 2\] call #(\d+) allreduce\(float32\(3,\), sum\); "
            r"ranks \[1\] call #\1 bcast\(float32\(3,\), root=0\)",
            run.stdout,
        ), run.stdout  # fmt: skip


@pytest.mark.parametrize("backend", ["ring", "mpi", "mlx-mpi"])
def test_a_killed_rank_ends_the_job_naming_it(backend):
    run = launch(3, backend, ["python", "-c", KILLED], timeout=60, env={"DU_TIMEOUT": str(TIMEOUT)})
    ended = time.time()
    assert run.returncode == 137, run.stdout
    assert re.search(r"du-launch: rank 1 was killed by SIGKILL", run.stdout), run.stdout
    killed = float(re.search(r"\[rank 1\] killed at ([\d.]+)", run.stdout).group(1))
    assert ended - killed < 10, run.stdout


@pytest.mark.parametrize("backend", ["mpi", "mlx-mpi"])
def test_mpirun_jobs_name_the_failed_rank(backend):
    run = launch(3, backend, ["python", "-c", EXITS], timeout=60)
    assert run.returncode == 7, run.stdout
    assert "du-launch: rank 1 exited with code 7; mpirun stopped the other ranks" in run.stdout, run.stdout


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_job_killed_while_writing_a_checkpoint_resumes_bit_identical(backend, tmp_path):
    def train(name, checkpoint, **env):
        return launch(2, backend, ["python", TRAIN, str(tmp_path / name), "--checkpoint", str(tmp_path / checkpoint)],
                      timeout=120, env={"DU_TIMEOUT": "30", **env})  # fmt: skip

    whole = train("whole", "ckpt-whole")
    assert whole.returncode == 0, whole.stdout
    crashed = train("resumed", "ckpt", DU_TEST_CRASH_IN_CHECKPOINT="2")  # dies halfway through step 8's save
    assert crashed.returncode == 99 and "saved step 4" in crashed.stdout, crashed.stdout
    assert "saved step 8" not in crashed.stdout, crashed.stdout
    assert any(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir())  # the half-written file
    resumed = train("resumed", "ckpt")
    assert resumed.returncode == 0, resumed.stdout
    assert "[rank 0] resumed at step 4" in resumed.stdout and "[rank 1] resumed at step 4" in resumed.stdout
    a, b = mx.load(str(tmp_path / "whole.safetensors")), mx.load(str(tmp_path / "resumed.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert mx.array_equal(a[key], b[key]).item(), key
    assert not any(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir())  # cleaned up by the next save


# --- bad launcher inputs: a clear error, never a hang ----------------------------------------


def du_launch(*args, env=None):
    return subprocess.run([sys.executable, "-m", "distributed_utils.launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})  # fmt: skip


@pytest.fixture
def held_port():
    """A port some other program is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_already_in_use_is_a_clear_error(held_port):
    run = du_launch("-n", "2", "--backend", "ring", "--port", str(held_port), "python", "-c", "pass")
    assert run.returncode != 0
    assert f"du-launch: port {held_port} on 127.0.0.1 (rank 0) is already in use; choose another --port" in run.stderr


def test_a_ring_rank_whose_port_is_taken_says_so(held_port, tmp_path):
    """A hand-made MLX hostfile (as mlx.launch users have) naming a port another program holds."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(f'[["127.0.0.1:{held_port}"], ["127.0.0.1:{held_port + 1}"]]')
    run = subprocess.run(
        [sys.executable, "-c", "import distributed_utils as du; du.initialize(du.RingBackend)"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile), "DU_TIMEOUT": str(TIMEOUT)},
    )  # fmt: skip
    assert run.returncode == 1
    want = f"RingBackend: rank 0 cannot listen on 127.0.0.1:{held_port} (from MLX_HOSTFILE): Address already in use"
    assert want in run.stderr, run.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--timeout", "-1", "python", "-c", "pass"], "--timeout must be >= 0"),
        (["--port", "70000", "python", "-c", "pass"], "--port must be a port number"),
        (["--backend", "mpi", "--remote-shell", "ssh {host} -x", "python"], "--remote-shell must end with {host}"),
    ],
)
def test_bad_reliability_options_are_clear_errors(args, words):
    run = du_launch(*args)
    assert run.returncode != 0 and words in run.stderr, run.stderr


def test_a_bad_timeout_in_the_environment_is_a_clear_error():
    run = launch(2, "ring", ["python", "-c", "import distributed_utils as du; du.initialize()"], timeout=60,
                 env={"DU_TIMEOUT": "soon"})  # fmt: skip
    assert run.returncode == 1  # each rank raises before connecting; the first to fail ends the job
    assert re.search(r"\[rank \d\] ValueError: DU_TIMEOUT='soon' is not a number of seconds", run.stdout), run.stdout
