"""Reliability under du-launch: the watchdog, the debug check, dead ranks, checkpoints that
survive a crash mid-write, and launcher inputs that fail with a clear error."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from launching import DU_LAUNCH, ROOT, launch

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


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_collective_a_rank_never_joins_ends_the_job_within_the_timeout(backend):
    run = launch(3, backend, ["--timeout", str(TIMEOUT), "python", "-c", ONE_RANK_NEVER_COMES], timeout=60)
    assert run.returncode == 124, run.stdout  # within launch's 60 s: not the 600 s the missing rank sleeps
    for rank in (0, 2):
        report = re.search(
            rf"\[rank {rank}\] du watchdog: rank {rank}: collective #(\d+) allreduce\(float32\(1024,\), sum\) "
            r"waiting since \d\d:\d\d:\d\d \(([\d.]+) s, timeout 3 s; last finished collective: #(\d+)\)",
            run.stdout,
        )
        assert report and TIMEOUT <= float(report.group(2)), run.stdout  # never before the timeout
        assert int(report.group(3)) == int(report.group(1)) - 1, run.stdout  # numbered in order
    assert "the watchdog ended the job: ranks [0, 2] waited past the timeout" in run.stdout, run.stdout
    assert "ranks [1] did not report waiting" in run.stdout, run.stdout


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_debug_mode_reports_mismatched_collectives_on_every_rank(backend):
    run = launch(3, backend, ["--debug", "python", "-c", MISMATCHED], timeout=60)
    assert run.returncode == 3, run.stdout
    for r in range(3):
        assert re.search(
            rf"\[rank {r}\] rank {r} shape: ranks issued different collectives \(DU_DEBUG\): every rank needs the "
            r"same collective; ranks \[1\] differ from rank 0 \(rank 0: '#(\d+) allreduce\(float32\(3,\), sum\)', "
            r"rank 1: '#\1 allreduce\(float32\(4,\), sum\)', rank 2: '#\1 allreduce\(float32\(3,\), sum\)'\)",
            run.stdout,
        ), run.stdout
        assert re.search(
            rf"\[rank {r}\] rank {r} op: .*ranks \[1\] differ from rank 0 \(rank 0: '#(\d+) allreduce\(float32\(3,\), "
            r"sum\)', rank 1: '#\1 bcast\(float32\(3,\), root=0\)', rank 2: '#\1 allreduce\(float32\(3,\), sum\)'\)",
            run.stdout,
        ), run.stdout


@pytest.mark.parametrize("backend", ["ring", "mpi", "mlx-mpi"])
def test_a_killed_rank_ends_the_job_naming_it(backend):
    # The watchdog's timeout is longer than the test's: the launcher itself must see the kill.
    run = launch(3, backend, ["python", "-c", KILLED], timeout=60, env={"DU_TIMEOUT": "600"})
    assert run.returncode == 137, run.stdout
    assert re.search(r"\[rank 1\] killed at ", run.stdout), run.stdout
    assert re.search(r"du-launch: rank 1 was killed by SIGKILL", run.stdout), run.stdout
    assert "du watchdog" not in run.stdout, run.stdout


ARRAY_ON_ROOT_ONLY = """
import mlx.core as mx, distributed_utils as du
b = du.initialize()
du.bcast(b, mx.arange(5) if du.local_rank(b) == 0 else None)  # rank 1: an object broadcast, not an array's
"""


def test_a_transport_error_names_the_rank_and_the_collective():
    run = launch(2, "mpi", ["python", "-c", ARRAY_ON_ROOT_ONLY], timeout=60)
    assert run.returncode == 1, run.stdout
    assert re.search(
        r"\[rank 1\] RuntimeError: rank 1: collective #\d+ bcast_object\(root=0\) failed in the "
        r"transport: MPI_ERR_TRUNCATE",
        run.stdout,
    ), run.stdout
    assert "du-launch: rank 1 exited with code 1" in run.stdout, run.stdout


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_job_killed_while_writing_a_checkpoint_resumes_bit_identical(backend, tmp_path):
    def train(name, checkpoint, **env):
        return launch(
            2,
            backend,
            ["python", TRAIN, str(tmp_path / name), "--checkpoint", str(tmp_path / checkpoint)],
            timeout=120,
            env={"DU_TIMEOUT": "30", **env},
        )

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
    return subprocess.run(
        [*DU_LAUNCH, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


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
    assert (
        f"du-launch: port {held_port} on 127.0.0.1 (rank 0) is already in use; choose another --port"
        in run.stderr
    )


def test_a_ring_rank_whose_port_is_taken_says_so(held_port, tmp_path):
    """A hand-made MLX hostfile (as mlx.launch users have) naming a port another program holds."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(f'[["127.0.0.1:{held_port}"], ["127.0.0.1:{held_port + 1}"]]')
    run = subprocess.run(
        [sys.executable, "-c", "import distributed_utils as du; du.initialize(du.RingBackend)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile), "DU_TIMEOUT": str(TIMEOUT)},
    )
    assert run.returncode == 1
    want = f"RingBackend: rank 0 cannot listen on 127.0.0.1:{held_port} (from MLX_HOSTFILE): Address already in use"
    assert want in run.stderr, run.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--timeout", "-1", "python", "-c", "pass"],
            "argument --timeout: must be a finite number >= 0, got -1",
        ),
        # (found by an adversarial test: inf passed, and faulthandler's timer overflowed on every rank)
        (
            ["--timeout", "inf", "python", "-c", "pass"],
            "argument --timeout: must be a finite number >= 0, got inf",
        ),
        (
            ["--grace", "inf", "python", "-c", "pass"],
            "argument --grace: must be a finite number >= 0, got inf",
        ),
        (["--port", "70000", "python", "-c", "pass"], "--port must be a port number"),
        (
            ["--backend", "mpi", "--remote-shell", "ssh {host} -x", "python"],
            "--remote-shell must end with {host}",
        ),
    ],
)
def test_bad_reliability_options_are_clear_errors(args, words):
    run = du_launch(*args)
    assert run.returncode != 0 and words in run.stderr, run.stderr


def test_a_bad_timeout_in_the_environment_is_a_clear_error():
    run = launch(
        2,
        "ring",
        ["python", "-c", "import distributed_utils as du; du.initialize()"],
        timeout=60,
        env={"DU_TIMEOUT": "soon"},
    )
    assert run.returncode == 1  # each rank raises before connecting; the first to fail ends the job
    assert re.search(r"\[rank \d\] ValueError: DU_TIMEOUT='soon' is not a number of seconds", run.stdout), (
        run.stdout
    )


# --- holes found by an adversarial test (../shared/repro/), each closed ------------------------

README_LOOP_FROZEN = """
import os, signal, numpy as np, mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim, distributed_utils as du
backend = du.initialize()
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = du.DistributedOptimizer(backend, optim.AdamW(3e-4))
du.synchronize(backend, model)
x_train = np.random.default_rng(0).standard_normal((512, 16)).astype(np.float32); y_train = x_train[:, :1] * 2
data = du.DistributedDataContainer(backend, (x_train, y_train))
loss_and_grad = nn.value_and_grad(model, lambda m, x, y: ((m(x) - y) ** 2).mean())
for epoch in range(10**6):
    for i, (x, y) in enumerate(data.batches(batch_size=32, shuffle=True, seed=0, epoch=epoch)):
        if epoch == 1 and i == 3 and du.local_rank(backend) == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen (the others cannot tell from dead)
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
"""


@pytest.mark.parametrize("backend", ["ring", "mlx-mpi", "mpi"])
def test_the_readme_loop_with_a_frozen_rank_ends_within_the_timeout(backend):  # d3, d11
    run = launch(2, backend, ["--timeout", str(TIMEOUT), "python", "-c", README_LOOP_FROZEN], timeout=120)
    assert run.returncode == 124, run.stdout  # within launch's 120 s
    assert re.search(r"\[rank 0\] du watchdog: rank 0: collective #\d+ ", run.stdout), run.stdout
    # the frozen rank is named: it cannot report (stopped outside any collective, then killed)
    assert "ranks [1] did not report waiting" in run.stdout, run.stdout


PEER_DIES = """
import os, signal, numpy as np, distributed_utils as du
b = du.initialize(); r = du.local_rank(b); n = du.total_workers(b)
for i in range(100):
    if r == 1 and i == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    s = du.allreduce(b, 1.0, "sum")
    g = du.allgather(b, np.array([10 * r + i]))
    if s != n or g.tolist() != [10 * k + i for k in range(n)]:
        print(f"WRONG at step {i}: {s}, {g.tolist()}", flush=True)
"""


def test_numpy_and_number_collectives_never_return_wrong_values_after_a_peer_dies():  # d1
    run = launch(3, "ring", ["python", "-c", PEER_DIES], timeout=60)
    assert run.returncode == 137 and "rank 1 was killed by SIGKILL" in run.stdout, run.stdout
    assert "WRONG" not in run.stdout, run.stdout


FOREVER = """
import os, sys, mlx.core as mx, distributed_utils as du
b = du.initialize()
open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").close()
while True:
    du.allreduce(b, mx.ones((1024,)), "sum")
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split()[2] != "Z"


@pytest.mark.parametrize(
    "backend, sig", [("ring", "SIGKILL"), ("mpi", "SIGKILL"), ("ring", "SIGHUP"), ("mlx-mpi", "SIGHUP")]
)
def test_ranks_end_when_the_launcher_is_killed(backend, sig, tmp_path):  # d2
    argv = [*DU_LAUNCH, "-n", "2", "--backend", backend, "python", "-c", FOREVER, str(tmp_path)]
    launcher = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the ranks' pid files, with a deadline
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    launcher.send_signal(getattr(signal, sig))
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived du-launch's {sig}"


LEAVES_EARLY = """
import sys, mlx.core as mx, distributed_utils as du
b = du.initialize()
for step in range(10**6):
    if du.local_rank(b) == 1 and step == 30:
        sys.exit(0)
    du.allreduce(b, mx.ones((64,)), "sum")
"""


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_rank_that_leaves_early_with_code_0_is_named(backend):  # d6
    run = launch(3, backend, ["--timeout", str(TIMEOUT), "python", "-c", LEAVES_EARLY], timeout=60)
    assert run.returncode != 0, run.stdout
    if backend == "ring":
        assert (
            "du-launch: rank 1 exited with code 0 while the others still ran: it left the job early"
            in run.stdout
        )
    else:
        assert "ranks [1] had already finished their program: they left the job early" in run.stdout, (
            run.stdout
        )


SLOW_SAVE = """
import time, types, zlib, mlx.core as mx, mlx.nn as nn, distributed_utils as du
b = du.initialize()
def slow(data, crc=0):  # checkpoints on slow storage: 0.6 s a piece of 64 KiB written, read back or loaded
    time.sleep(0.6)
    return zlib.crc32(data, crc)
du.checkpoint.zlib = types.SimpleNamespace(crc32=slow)  # (each write and read: the weight's 4, bias, rng)
du.checkpoint._PIECE_BYTES = 2**16
m = nn.Linear(128, 512)
du.save_checkpoint(b, sys.argv[1], model=m, step=1)
print("saved", du.load_checkpoint(b, sys.argv[1], model=m)["step"], flush=True)
"""


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_checkpoint_that_takes_longer_than_the_timeout_is_not_a_stall(backend, tmp_path):  # d4
    run = launch(
        2,
        backend,
        ["--timeout", "2", "python", "-c", "import sys\n" + SLOW_SAVE, str(tmp_path / "ck")],
        timeout=120,
    )
    assert run.returncode == 0 and "du watchdog" not in run.stdout, run.stdout
    assert "[rank 0] saved 1" in run.stdout and "[rank 1] saved 1" in run.stdout, run.stdout


NEVER_JOINS_TEST = """
import time, mlx.core as mx, distributed_utils as du

def test_one_rank_never_joins():
    b = du.initialize()
    if du.local_rank(b) == 1:
        time.sleep(600)  # the rank that never reaches the collective (what is tested, not a wait)
    du.allreduce(b, mx.ones((7,)), "sum")
"""


def test_watchdog_reports_reach_the_launcher_under_pytest_capture(tmp_path):  # #8
    (tmp_path / "test_never_joins.py").write_text(NEVER_JOINS_TEST)
    run = launch(
        2,
        "ring",
        [
            "--timeout",
            str(TIMEOUT),
            "python",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_never_joins.py"),
        ],
        timeout=120,
    )
    assert run.returncode == 124, run.stdout
    assert re.search(
        r"\[rank 0\] du watchdog: rank 0: collective #\d+ allreduce\(float32\(7,\), sum\)", run.stdout
    ), run.stdout


def test_a_ring_backend_under_plain_mpirun_is_a_clear_error():  # #10
    from distributed_utils.launch import find_mpirun

    code = "import distributed_utils as du; du.initialize(du.RingBackend)"
    argv = [find_mpirun(), "-n", "2", "--oversubscribe"] + (
        ["--allow-run-as-root"] if os.geteuid() == 0 else []
    )
    run = subprocess.run(argv + [sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "mpirun started 2 processes but this backend sees a world of 1" in run.stdout + run.stderr, (
        run.stdout + run.stderr
    )


def test_mlx_mpi_under_plain_mpirun_finds_the_mpi_library_itself():  # #10
    from distributed_utils.launch import find_mpirun

    code = "import distributed_utils as du; b = du.initialize(du.MLXMPIBackend); print('world', b.size)"
    argv = [find_mpirun(), "-n", "2", "--oversubscribe"] + (
        ["--allow-run-as-root"] if os.geteuid() == 0 else []
    )
    env = {k: v for k, v in os.environ.items() if k != "MLX_MPI_LIBNAME"}
    run = subprocess.run(
        argv + [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 0 and run.stdout.count("world 2") == 2, run.stdout + run.stderr


# --- restarts -----------------------------------------------------------------------------------

FAILS_ON_FIRST_ATTEMPTS = """
import os, sys, distributed_utils as du
b = du.initialize()
attempt = int(os.environ["DU_RESTART"])
print(f"attempt {attempt} job {os.environ['DU_JOB_ID'][:8]}", flush=True)
if du.local_rank(b) == 1 and attempt < int(sys.argv[1]):
    print("rank 1 gives up", flush=True)
    sys.exit(3)
du.barrier(b)
"""


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_max_restarts_restarts_the_whole_job_and_names_the_cause(backend):
    run = launch(
        2, backend, ["--max-restarts", "2", "python", "-c", FAILS_ON_FIRST_ATTEMPTS, "2"], timeout=180
    )
    assert run.returncode == 0, run.stdout
    for attempt in (1, 2):
        assert re.search(
            rf"du-launch: attempt {attempt} failed: rank 1 on 127\.0\.0\.1 exited with code 3; "
            r"its last lines:\n(    .*\n)*    rank 1 gives up\n",
            run.stdout,
        ), run.stdout
        assert f"restarting the job: attempt {attempt + 1} of 3 (DU_RESTART={attempt})" in run.stdout
    jobs = set(re.findall(r"\[rank 0\] attempt \d job (\w+)", run.stdout))
    assert len(jobs) == 3, run.stdout  # a fresh job id (and ports) for every attempt


def test_max_restarts_gives_up_with_the_last_failure():
    run = launch(
        2, "ring", ["--max-restarts", "1", "python", "-c", FAILS_ON_FIRST_ATTEMPTS, "5"], timeout=120
    )
    assert run.returncode == 3, run.stdout
    assert "attempt 2 failed: rank 1 on 127.0.0.1 exited with code 3" in run.stdout, run.stdout
    assert "restarting the job: attempt 3" not in run.stdout, run.stdout


RESUME = str(ROOT / "tests" / "programs" / "resume.py")


# each start path once, each optimizer once: what is saved does not depend on the transport
@pytest.mark.parametrize(
    "backend,optimizer", [("ring", []), ("mpi", ["--diloco", "3"])], ids=["ring-distributed", "mpi-diloco"]
)
def test_a_crashed_job_restarts_resumes_and_ends_bit_identical(backend, optimizer, tmp_path):
    """DiLoCo (syncing every 3 steps) is saved between syncs, at steps 5 and 10."""
    whole = launch(
        2,
        backend,
        ["python", RESUME, str(tmp_path / "whole"), str(tmp_path / "ck-whole"), *optimizer],
        timeout=120,
    )
    assert whole.returncode == 0, whole.stdout
    steps = int(re.search(r"done at step (\d+)", whole.stdout).group(1))
    run = launch(
        2,
        backend,
        [
            "--max-restarts",
            "1",
            "python",
            RESUME,
            str(tmp_path / "restarted"),
            str(tmp_path / "ck"),
            "--die-at",
            "13",
            *optimizer,
        ],
        timeout=180,
    )
    assert run.returncode == 0, run.stdout
    assert "attempt 1 failed: rank 1 on 127.0.0.1 was killed by SIGKILL" in run.stdout, run.stdout
    for r in range(2):
        assert f"[rank {r}] resumed at step 10, epoch 0, saved by 2 ranks" in run.stdout, run.stdout
    kept = [f"step-{s:012d}.safetensors" for s in range(5, steps + 1, 5)][-2:]  # keep=2 of every 5th step
    assert f"[rank 0] done at step {steps}; checkpoints kept: {kept}" in run.stdout, run.stdout
    assert_same_safetensors(tmp_path / "whole.safetensors", tmp_path / "restarted.safetensors")


def test_diloco_saved_by_3_ranks_at_a_sync_resumes_on_2(tmp_path):
    """Syncing every 5 steps, saved at step 10 (a sync) by 3 ranks: 2 ranks go on from the global
    parameters, rank r with saved rank r's inner state, and end with identical replicas."""
    common = [RESUME, str(tmp_path / "out"), str(tmp_path / "ck"), "--diloco", "5"]
    first = launch(3, "ring", ["python", *common, "--die-at", "13"], timeout=120)
    assert first.returncode == 128 + 9, first.stdout
    second = launch(2, "ring", ["python", *common, "--epochs", "5"], timeout=120)
    assert second.returncode == 0, second.stdout
    assert "[rank 1] resumed at step 10, epoch 1, saved by 3 ranks" in second.stdout, second.stdout
    assert "[rank 0] done at step 55;" in second.stdout, (
        second.stdout
    )  # 9 steps for epoch 1's rest, 12 an epoch: a sync
    digests = re.findall(r"\[rank \d\] parameters (\w+)", second.stdout)
    assert len(digests) == 2 and digests[0] == digests[1], second.stdout


def test_a_job_resumes_mid_epoch_at_another_world_size(tmp_path):
    """3 ranks die at step 13 (last checkpoint: step 10, two batches into epoch 1); 2 ranks
    resume: the steps go on from 10, the rest of epoch 1 is visited exactly once, and the
    new global batch is announced. Steps: 3 ranks x 4 items: 8 per epoch; the 66 items left
    of epoch 1 over 2 ranks: 9; epoch 2 at 2 ranks: 12. The same with the optimizer state
    sharded (saved whole by 3 ranks, split anew over 2) ends with the same parameters."""
    for shard in (False, True):
        run = tmp_path / ("sharded" if shard else "replicated")
        items = run / "items"
        (items / "3").mkdir(parents=True), (items / "2").mkdir()
        common = [RESUME, str(run / "out"), str(run / "ck"), *(["--shard"] if shard else []), "--items"]
        first = launch(3, "ring", ["python", *common, str(items / "3"), "--die-at", "13"], timeout=120)
        assert first.returncode == 128 + 9, first.stdout
        second = launch(2, "ring", ["python", *common, str(items / "2")], timeout=120)
        assert second.returncode == 0, second.stdout
        assert "[rank 0] resumed at step 10, epoch 1, saved by 3 ranks" in second.stdout, second.stdout
        assert "global batch 12" in second.stdout and "global batch 8" in second.stdout, second.stdout
        assert "[rank 0] done at step 31;" in second.stdout, second.stdout

        def visited(world, epoch, steps):
            lines = [
                line.split()
                for f in (items / world).glob("rank-*.txt")
                for line in f.read_text().splitlines()
            ]
            return [
                int(i) for step, e, *rest in lines if int(e) == epoch and int(step) in steps for i in rest
            ]

        before = visited("3", 1, range(9, 11))  # checkpointed at step 10; steps 11-13 were lost with the job
        after = visited("2", 1, range(11, 20))
        assert len(before) == 3 * 2 * 4 and not set(before) & set(after)
        assert set(before) | set(after) == set(range(90)) and len(after) == 66
    assert_same_safetensors(
        tmp_path / "replicated" / "out.safetensors", tmp_path / "sharded" / "out.safetensors"
    )


def assert_same_safetensors(a, b):
    a, b = mx.load(str(a)), mx.load(str(b))
    assert a.keys() == b.keys()
    for key in a:
        assert (np.array(a[key]).view(np.uint8) == np.array(b[key]).view(np.uint8)).all(), key


def preempted_run(backend, tmp_path, signal_the_launcher):
    """The resume program with --preempt: either du-launch gets SIGTERM while every rank holds at
    step 7, or rank 1 sends SIGTERM to itself at step 9. Returns (exit code, output)."""
    program = ["python", RESUME, str(tmp_path / "preempted"), str(tmp_path / "ck"), "--preempt"]
    program += ["--hold-at", "7"] if signal_the_launcher else ["--fault", "0:9:1:sigterm"]
    argv = [*DU_LAUNCH, "-n", "2", "--backend", backend, "--grace", "60", *program]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    killer = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))  # a bound, not a synchronization
    killer.start()
    lines = []
    for line in proc.stdout:  # the job's own output says when it holds
        lines.append(line)
        if "[rank 0] holding at step 7" in line:
            proc.send_signal(signal.SIGTERM)
    killer.cancel()
    return proc.wait(), "".join(lines)


# each start path once, each signal's target once (the launcher forwards it the same way to every backend)
@pytest.mark.parametrize(
    "backend,signal_the_launcher", [("mpi", True), ("ring", False)], ids=["mpi-launcher", "ring-one-rank"]
)
def test_a_preempted_job_saves_once_at_one_step_and_resumes_bit_identical(
    backend, tmp_path, signal_the_launcher
):
    whole = launch(
        2, backend, ["python", RESUME, str(tmp_path / "whole"), str(tmp_path / "ck-whole")], timeout=120
    )
    assert whole.returncode == 0, whole.stdout
    code, out = preempted_run(backend, tmp_path, signal_the_launcher)
    step = 7 if signal_the_launcher else 9
    assert code == 75, out  # #26.8: a signal that reached one rank alone preempts the job too (it exited 0)
    assert sorted(re.findall(r"\[rank (\d)\] preempted at step (\d+): saved", out)) == [
        ("0", str(step)),
        ("1", str(step)),
    ], out
    if signal_the_launcher:
        assert "du-launch: received SIGTERM: forwarded to the ranks as SIGUSR1" in out, out
        assert "du-launch: the job was preempted (SIGTERM) and ended within the grace period" in out, out
    else:
        said = "du-launch: the job was preempted (SIGTERM to rank 1) and ended within the grace period"
        assert said in out, out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        f"step-{s:012d}.safetensors" for s in (5, step)
    ]
    resumed = launch(
        2, backend, ["python", RESUME, str(tmp_path / "resumed"), str(tmp_path / "ck")], timeout=120
    )
    assert resumed.returncode == 0, resumed.stdout
    for r in range(2):
        assert f"[rank {r}] resumed at step {step}, epoch 0, saved by 2 ranks" in resumed.stdout, (
            resumed.stdout
        )
    assert_same_safetensors(tmp_path / "whole.safetensors", tmp_path / "resumed.safetensors")


STUBBORN = """
import signal, time
for sig in (signal.SIGTERM, signal.SIGUSR1):  # a rank that ignores both: only SIGKILL ends it
    signal.signal(sig, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""
WAITS = "import time, distributed_utils as du; du.initialize(); print('ready', flush=True); time.sleep(600)"


def sigterm_when_ready(backend, n, grace, program):
    """Start ``python -c program`` on n ranks under du-launch, send du-launch SIGTERM once every
    rank printed "ready": (exit code, output, seconds from the signal to the end)."""
    argv = [*DU_LAUNCH, "-n", str(n), "--backend", backend]
    proc = subprocess.Popen(
        [*argv, "--grace", str(grace), "python", "-c", program],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killer = threading.Timer(120, proc.kill)  # a bound, not a synchronization
    killer.start()
    lines, ready = [], 0
    for line in proc.stdout:  # the ranks say when they run
        lines.append(line)
        ready += line.endswith("] ready\n")
        if ready == n:
            signaled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    code, took = proc.wait(), time.monotonic() - signaled
    killer.cancel()
    return code, "".join(lines), took


@pytest.mark.parametrize("backend,n", [("ring", 6), ("mpi", 2)])
def test_ranks_that_outlive_the_grace_period_are_stopped_at_once_and_no_rank_is_blamed(backend, n):
    """#26.7: after --grace, the ring launcher stopped ranks one at a time (3 s each: 19 s for 6
    ranks with --grace 1), exited 137 or 143 by chance, and blamed rank 0 for its own SIGKILL.
    Now every rank is signalled at once (SIGTERM, 3 s, SIGKILL), du-launch exits 128 + the
    signal it received, and names no rank."""
    code, out, took = sigterm_when_ready(backend, n, 1, STUBBORN)
    assert code == 128 + signal.SIGTERM, out
    assert "the job did not end within the grace period (1 s); stopping all ranks" in out, out
    assert not re.search(r"rank \d+ (was killed|exited)", out), out
    assert took < 1 + 2 * 3 + 4, (took, out)  # grace + SIGTERM's 3 s + SIGKILL, whatever n (19 s before)


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_preempted_program_that_never_calls_preempted_ends_with_128_plus_the_signal(backend):
    """The ranks end on the forwarded SIGUSR1: du-launch's own stop, no rank blamed (before: rank N
    'was killed by SIGUSR1', exit 138)."""
    code, out, _ = sigterm_when_ready(backend, 2, 30, WAITS)
    assert code == 128 + signal.SIGTERM, out
    assert "the ranks ended on the forwarded SIGUSR1 (the program does not call du.preempted)" in out, out
    assert not re.search(r"rank \d+ (was killed|exited)", out), out


# --- groups (du.split): watched, and numbered per group (#38) ---------------------------------------

SKIPS_SPLIT = """
import time, distributed_utils as du
b = du.initialize()
r = du.local_rank(b)
if r == du.total_workers(b) - 1:
    time.sleep(60)  # takes another branch: never calls du.split
else:
    du.split(b, r % 2)
"""


@pytest.mark.parametrize("backend,n", [("mpi", 4), ("mlx-mpi", 3)])
def test_a_rank_that_never_calls_split_ends_the_job_within_the_timeout(backend, n):
    """#38: the others waited in Comm.Split until something outside killed the job (DU_TIMEOUT=20 did not
    end it in 100 s): du.split went past the door that watches every collective."""
    run = launch(n, backend, ["--timeout", "5", "python", "-c", SKIPS_SPLIT], timeout=50)
    assert run.returncode in (1, 124), run.stdout  # (124: the watchdog; 1: faulthandler, MLX holds the GIL)
    assert re.search(r"collective #\d+ split\(\) waiting since|in split_group", run.stdout), run.stdout


GROUPS_OF_THEIR_OWN = """
import time, numpy as np, distributed_utils as du
b = du.initialize()
r = du.local_rank(b)
g = du.split(b, r % 2)
for _ in range(3 if r % 2 == 0 else 1):  # each group its own number of collectives
    du.allreduce(g, np.ones(2), "sum")
for _ in range(3):
    if r == 3:
        time.sleep(0.2)  # (a wait to measure, not a synchronization)
    du.allreduce(b, np.ones(2), "sum")
"""


def test_groups_making_their_own_numbers_of_collectives_pass_debug_mode_and_pair_in_the_timeline(tmp_path):
    """#38: debug mode raised CollectiveMismatchError on every rank for this correct program, and the merged
    timeline paired unrelated collectives (the others' wait said 0 ms "for rank 2", not 200 for rank 3)."""
    trace = tmp_path / "trace.json"
    run = launch(
        4, "mpi", ["--debug", "--timeline", str(trace), "python", "-c", GROUPS_OF_THEIR_OWN], timeout=90
    )
    assert run.returncode == 0, run.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    whole = [e for e in events if e["name"] == "allreduce" and e["args"].get("group") == "" and e["pid"] != 3]
    waits = [(e["args"]["for_rank"], e["args"]["waited_ms"]) for e in whole]  # (ranks 0-2: 3 each)
    assert len(waits) == 9 and all(rank == 3 and ms > 100 for rank, ms in waits), waits
    groups = {e["args"]["group"] for e in events if e["name"] == "allreduce" and e["args"].get("group")}
    assert groups == {"in group [0, 2]", "in group [1, 3]"}, groups
