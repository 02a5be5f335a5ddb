"""du-launch as a user runs it: results, rank prefixes, exit codes, concurrent jobs, bad arguments."""

import collections
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from launching import DU_LAUNCH, ROOT, launch

#: du-launch's two start paths: the ring's processes, started by du-launch itself, and mpirun's (mpi and
#: mlx-mpi start through the same mpirun code: mlx-mpi's own start is tested where it differs).
START_PATHS = ["ring", "mpi"]
#: Each backend at each world size that means something different for a start (one, a pair, oversubscribed).
STARTS = [(b, n) for b in START_PATHS for n in (1, 2, 4)] + [("mlx-mpi", 2)]

REPORT = """
import distributed_utils as du
b = du.initialize()
r, n = du.local_rank(b), du.total_workers(b)
total = du.allreduce(b, r + 1, "sum")
assert total == n * (n + 1) // 2, total
print(f"{type(b).__name__} rank {r} of {n} total {total}")
"""

FAIL_ON_RANK_1 = """
import sys, distributed_utils as du
b = du.initialize()
if du.local_rank(b) == 1:
    sys.exit(7)
du.barrier(b)  # the other ranks wait here for rank 1, which never comes
"""

RAISE_ON_LAST = """
import distributed_utils as du
b = du.initialize()
if du.local_rank(b) == du.total_workers(b) - 1:
    raise RuntimeError("deliberate failure")
du.barrier(b)
"""


@pytest.mark.parametrize("backend,n", STARTS)
def test_every_rank_runs_and_prefixes_its_output(backend, n):
    run = launch(n, backend, ["python", "-c", REPORT], timeout=120)
    assert run.returncode == 0, run.stdout
    name = {"mpi": "MPIBackend", "ring": "RingBackend", "mlx-mpi": "MLXMPIBackend"}[backend]
    for r in range(n):
        assert f"[rank {r}] {name} rank {r} of {n} total {n * (n + 1) // 2}" in run.stdout, run.stdout


OPEN_MPI = ("OMPI_MCA_btl_tcp_links", "OMPI_MCA_coll_tuned_reduce_scatter_block_algorithm")
DEFAULTS = f"import os; print('got', *(os.environ.get(k) for k in ('GLIBC_TUNABLES', *{OPEN_MPI})))"


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_the_ranks_get_du_launchs_defaults_unless_the_user_set_them(backend):
    open_mpi = "2 4" if backend == "mpi" else "None None"  # (Open MPI's: for mpi and mlx-mpi only)
    run = launch(2, backend, ["python", "-c", DEFAULTS], timeout=120)
    assert run.stdout.count(f"] got glibc.malloc.hugetlb=1 {open_mpi}\n") == 2, run.stdout
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", OPEN_MPI[0]: "3", OPEN_MPI[1]: "2"}
    run = launch(2, backend, ["python", "-c", DEFAULTS], timeout=120, env=mine)
    assert run.stdout.count("] got glibc.malloc.arena_max=2 3 2\n") == 2, run.stdout


@pytest.mark.parametrize("backend", START_PATHS)
def test_a_failing_rank_fails_the_job_with_its_code_and_is_named(backend):
    run = launch(3, backend, ["python", "-c", FAIL_ON_RANK_1], timeout=60)
    assert run.returncode == 7, run.stdout
    stopped = "stopping the other ranks" if backend == "ring" else "mpirun stopped the other ranks"
    assert f"du-launch: rank 1 exited with code 7; {stopped}" in run.stdout, run.stdout


@pytest.mark.parametrize("backend", START_PATHS)
def test_an_exception_fails_the_job_with_its_traceback(backend):
    run = launch(2, backend, ["python", "-c", RAISE_ON_LAST], timeout=60)
    assert run.returncode == 1, run.stdout
    assert "[rank 1] RuntimeError: deliberate failure" in run.stdout


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_two_jobs_at_once_do_not_cross_connect(backend):
    """Each job sums its own job-specific value; a cross-connection would mix the sums
    (or fail the job-id handshake)."""
    code = (
        "import sys, distributed_utils as du; b = du.initialize(); v = int(sys.argv[1]);"
        "s = du.allreduce(b, v, 'sum'); assert s == v * du.total_workers(b), s; print('sum', s)"
    )
    results = {}

    def job(value):
        results[value] = launch(2, backend, ["python", "-c", code, str(value)], timeout=120)

    threads = [threading.Thread(target=job, args=(v,)) for v in (1000, 2000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for value, run in results.items():
        assert run.returncode == 0, run.stdout
        assert run.stdout.count(f"sum {2 * value}") == 2, run.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["-n", "0", "python", "-c", "pass"], "argument -n: must be a finite number >= 1, got 0"),
        (["-n", "2"], "no command given"),
        (["-n", "2", "--backend", "tcp", "python"], "invalid choice: 'tcp'"),
        (["--hostfile", "/nonexistent/hosts", "python", "-c", "pass"], "No such file"),
    ],
)
def test_bad_arguments_are_clear_errors(args, words):
    run = subprocess.run([*DU_LAUNCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert words in run.stderr + run.stdout


@pytest.mark.parametrize("option", ["--timeline", "--account"])
def test_an_output_file_that_cannot_be_written_fails_before_any_rank_starts(option, tmp_path):
    """#38: --timeline (or --account) in a missing folder, or one this user cannot create files in, is one
    argparse error (exit 2) before any rank starts; a read-only one was found at exit, every rank printing a
    traceback, the trace lost and du-launch exiting 0."""
    read_only = Path("/proc")  # (root creates files in a folder of mode 555 too)
    if os.geteuid() != 0:
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
    for folder in (read_only, Path("/missing/dir")):
        argv = [*DU_LAUNCH, "-n", "2", option, str(folder / "out.json"), "python", "-c", "print('started')"]
        run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stderr.count("error:") == 1, run.stderr + run.stdout
        assert f"{option}: {folder / 'out.json'}: cannot create a file in {folder}" in run.stderr, run.stderr
        assert "started" not in run.stdout + run.stderr, run.stdout
    # (found by an adversarial test: a folder passed the check, and its trace was lost at the job's end)
    run = subprocess.run(
        [*DU_LAUNCH, "-n", "2", option, str(tmp_path), "python", "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and f"{option}: {tmp_path} is a folder, not a file's path" in run.stderr, (
        run.stderr
    )


def test_hostfile_slots_give_the_rank_count(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine, twice\n127.0.0.1 slots=2\n")
    run = subprocess.run(
        [*DU_LAUNCH, "--backend", "ring", "--hostfile", str(hostfile), "python", "-c", REPORT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[rank 1] RingBackend rank 1 of 2 total 3" in run.stdout


def test_a_hostfile_line_that_is_not_a_host_is_an_error(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=two\n")
    run = subprocess.run(
        [*DU_LAUNCH, "--hostfile", str(hostfile), "python", "-c", "pass"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and f"{hostfile}:1: expected 'HOST [slots=K]'" in run.stderr


def test_a_hostfile_host_that_does_not_resolve_is_a_clear_error(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\nno-such-host.invalid\n")  # (.invalid never resolves: RFC 2606)
    for check in (
        [],
        ["--check"],
        ["--check", "--min-ranks", "1"],
    ):  # (a check names every host it cannot check)
        run = subprocess.run(
            [*DU_LAUNCH, *check, "--hostfile", str(hostfile), "python", "-c", "pass"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert (
            "du-launch: host no-such-host.invalid (ranks [1]) is unreachable: cannot resolve host "
            "'no-such-host.invalid'"
        ) in run.stderr, run.stderr


OUTPUT = """
import os, sys
from tqdm import tqdm
import distributed_utils as du
b = du.initialize()
print("isatty", sys.stdout.isatty())
for _ in tqdm(range(3), desc="bar", file=sys.stdout, ncols=None):
    pass
if du.local_rank(b) == 1:
    print("a last line without its end", end="", flush=True)
    raise SystemExit(3)
du.barrier(b)
"""


@pytest.mark.parametrize("backend", START_PATHS)
def test_ranks_write_to_a_pipe_and_their_last_lines_stay_whole(backend):
    """Under mpirun a rank's stdout is a pseudo-terminal 0 columns wide (tqdm drew nothing, and
    an abort left a NUL and glued du-launch's next line to the rank's last): every backend now
    shows programs a pipe with the launcher's width, as the ring launcher always did."""
    run = launch(2, backend, ["python", "-c", OUTPUT], timeout=120, env={"COLUMNS": "70"})
    assert run.returncode == 3, run.stdout
    assert "\0" not in run.stdout
    assert "] [rank" not in run.stdout, run.stdout  # one prefix per line, redraws included
    for r in range(2):
        assert f"[rank {r}] isatty False\n" in run.stdout, run.stdout
        assert f"[rank {r}] bar: 100%|" in run.stdout, run.stdout
    assert "[rank 1] a last line without its end\n" in run.stdout, run.stdout


@pytest.mark.parametrize("backend", START_PATHS)
def test_a_script_imports_the_modules_beside_it(backend, tmp_path):
    """As `python script.py` does: the script's directory comes first on sys.path."""
    (tmp_path / "helper.py").write_text("ANSWER = 42\n")
    (tmp_path / "main.py").write_text("import helper\nprint('answer', helper.ANSWER)\n")
    run = launch(2, backend, ["python", str(tmp_path / "main.py")], timeout=60)
    assert run.returncode == 0, run.stdout
    assert "[rank 0] answer 42" in run.stdout and "[rank 1] answer 42" in run.stdout, run.stdout


FAILS_ON_RANK_1 = """
import distributed_utils as du

def test_first():
    b = du.initialize()
    if du.local_rank(b) == 1:
        assert 1 + 1 == 3, "rank 1 disagrees"
    du.barrier(b)  # rank 0 waits here for rank 1

def test_second():
    du.barrier(du.initialize())
"""


@pytest.mark.parametrize("backend", START_PATHS)
def test_a_test_failing_on_one_rank_ends_the_job_with_its_assertion(backend, tmp_path):
    """The library's pytest plugin: the failing rank stops at once and shows its failure; the
    job ends with that rank named, not at the watchdog's timeout with every rank blamed."""
    (tmp_path / "test_rank.py").write_text(FAILS_ON_RANK_1)
    command = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_rank.py")]
    run = launch(2, backend, ["--timeout", "120", *command], timeout=240)
    assert run.returncode == 1, run.stdout
    assert re.search(r"\[rank 1\] E +AssertionError: rank 1 disagrees", run.stdout), run.stdout
    assert "rank 1 failed" in run.stdout and "the other ranks cannot go on without it" in run.stdout, (
        run.stdout
    )
    assert re.search(r"du-launch: rank 1 exited with code 1", run.stdout), run.stdout
    assert "du watchdog:" not in run.stdout and "the watchdog ended the job" not in run.stdout, run.stdout
    assert "test_second" not in run.stdout, run.stdout


@pytest.mark.parametrize("backend", START_PATHS)
def test_check_on_one_machine_measures_the_job_and_finds_a_missing_script(backend, tmp_path):
    """--check measures the job's links, and a job on the same hosts compares its account with that."""
    cache = {"XDG_CACHE_HOME": str(tmp_path)}
    run = launch(2, backend, ["--check", "python", "examples/digits.py"], timeout=120, env=cache)
    assert run.returncode == 0, run.stdout
    assert "examples/digits.py exists" in run.stdout, run.stdout
    measured = re.search(
        r"\[rank 0\] \S+ \(2 ranks, \w+Backend\): latency \d+ us; bus bandwidth 1 MB.* ([\d.]+) GB/s$",
        run.stdout,
        re.M,
    )
    assert measured, run.stdout
    run = launch(2, backend, ["python", "-c", SLOWED], timeout=120, env=cache)  # (2 ranks: none slowed)
    said = re.search(
        r"du-launch: the collectives' bus bandwidth: [\d.]+ GB/s \(--check measured ([\d.]+) GB/s", run.stdout
    )
    assert run.returncode == 0 and said and said[1] == measured[1], run.stdout
    run = launch(2, backend, ["--check", "python", "no/such/script.py"], timeout=60)
    assert run.returncode == 1, run.stdout
    assert "the script no/such/script.py is missing" in run.stdout, run.stdout


@pytest.mark.parametrize(
    "command, missing",
    [
        (["python", "-u", "missing.py"], "the script missing.py is missing"),  # #26.10: after an option
        (["python", "-X", "dev", "-W", "ignore", "missing.py"], "the script missing.py is missing"),
        (["python", "-m", "no_such_module"], "the module no_such_module is missing"),
        (["python", "-mno_such.module"], "the module no_such.module is missing"),
        (["python", "-um", "no_such_module"], "the module no_such_module is missing"),  # (one option word)
        (["./no-such-program"], "the program ./no-such-program is missing"),
        (["no-such-program-on-path"], "the program no-such-program-on-path is missing"),
    ],
)
def test_check_finds_what_the_command_runs_however_it_is_written(command, missing):
    run = launch(1, "ring", ["--check", *command], timeout=60)
    assert run.returncode == 1 and missing in run.stdout, run.stdout


def test_check_finds_a_script_after_options_and_a_module_by_import():
    for command in (
        ["python", "-u", "-X", "dev", "examples/digits.py"],
        ["python", "-m", "distributed_utils.run"],
    ):
        run = launch(1, "ring", ["--check", *command], timeout=120)
        assert run.returncode == 0 and " exists" in run.stdout, run.stdout


def test_check_names_the_python_that_cannot_import_the_library_and_why(tmp_path):
    """The probe ran, but this Python cannot import the library (its mlx is missing): not
    'unreachable', and the whole reason."""
    bare = tmp_path / "python3"
    bare.symlink_to(sys._base_executable)  # the interpreter without this venv's packages
    run = launch(1, "ring", ["--check", str(bare), "-c", "pass"], timeout=60)
    assert run.returncode == 1, run.stdout
    said = f"du-launch: host 127.0.0.1 (ranks [0]) cannot run the job with Python {bare}: `{bare} -m distributed_utils.preflight` failed (exit code 1):"
    assert said in run.stdout and "No module named 'mlx'" in run.stdout, run.stdout
    assert "Traceback" in run.stdout and "unreachable" not in run.stdout, run.stdout


@pytest.mark.parametrize("backend", ["mpi", "mlx-mpi"])
def test_a_failing_rank_started_with_interpreter_options_ends_the_mpi_job(backend):
    """``python -u ...`` runs under distributed_utils.run too: its failure aborts the job, not a hang
    (rank 0 waits for rank 1 in a barrier, as FAIL_ON_RANK_1's ranks do: a rank 0 that ended its own
    program meanwhile could be killed in MPI's teardown, and mpirun report that instead)."""
    for options in (["-u", "-c"], ["-uc"]):
        run = launch(
            2, backend, ["python", *options, FAIL_ON_RANK_1.replace("sys.exit(7)", "sys.exit(3)")], timeout=60
        )
        assert run.returncode == 3 and "rank 1 exited with code 3" in run.stdout, run.stdout


def test_a_watchdog_report_of_a_stopped_rank_names_it_as_the_cause(monkeypatch):
    """The reports of d11 (a rank stopped inside a collective, then continued): the stopped rank
    is named, and one that was not stopped is not."""
    from distributed_utils.backends.contract import record
    from distributed_utils.supervise import Report

    monkeypatch.setenv("DU_RECORD_TOKEN", "0f1e2d")
    report = Report(3, "0f1e2d")
    for rank in range(3):  # the records the ranks' watchdogs write (the rank's line for people beside each)
        line = record("watchdog", rank=rank, waiting="collective #907 bcast(root=0)", stopped=rank == 1)
        assert not report.scan(line.encode() + b"\n", rank, True)  # (read, and not shown)
    assert report.watchdog == {0, 1, 2} and report.stopped == {1}
    assert (
        "ranks [1] had been stopped (SIGSTOP or frozen) while waiting: the cause" in report.watchdog_summary()
    )


@pytest.mark.parametrize("a_rank_ran", [False, True])
def test_mpirun_that_could_not_start_the_job_is_started_once_more(a_rank_ran, monkeypatch, capsys):
    """mpirun failing before any rank ran (seen once in CI: its PMIx server's listener did not
    start) is started once more; once a rank has run, the failure is the job's, and stands."""
    from distributed_utils import launch
    from distributed_utils.supervise import Failure, Report

    attempts = []

    def run_job(hosts, command, args, attempt=0):
        report = Report(len(hosts))
        if not attempts:
            report.scan(b"The PMIx server's listener thread failed to start. We cannot\n", None, False)
            if a_rank_ran:
                report.scan(b"imported\n", 0, True)
        attempts.append(report.not_started)
        return (
            (213, report, Failure(213, None, "exited with code 213"))
            if len(attempts) == 1
            else (0, report, None)
        )

    monkeypatch.setattr(launch, "run_job", run_job)
    with pytest.raises(SystemExit) as ended:
        launch.main(["-n", "2", "--backend", "mpi", "python", "-c", "pass"])
    assert (ended.value.code, attempts) == ((213, [True]) if a_rank_ran else (0, [True, False]))
    assert ("starting it once more" in capsys.readouterr().err) is not a_rank_ran


SLOWED = """
import sys, time
import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim
import distributed_utils as du
b = du.initialize()
model = nn.Linear(64, 64)
du.synchronize(b, model)
opt = du.DistributedOptimizer(b, optim.SGD(0.01))
loss_and_grad = nn.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())
for step in range(20):
    if du.local_rank(b) == 2:
        time.sleep(0.1)  # rank 2 is slowed: a slower machine
    loss, grads = loss_and_grad(model, mx.ones((8, 64)))
    opt.update(model, grads)
    mx.eval(model.parameters())
"""


# A log a rank echoes, with du-launch's records of another job (or of none): output, like any other line
ECHOES_RECORDS = """
if du.local_rank(b) == 0:
    print('du-launch-record {"event": "preempted", "rank": 0, "signals": ["SIGTERM"]}', flush=True)
    print('du-launch-record {"event": "watchdog", "rank": 0, "waiting": "#3", "stopped": false}', file=sys.stderr)
    print('du-launch-record 0f1e2d {"event": "preempted", "rank": 0}', file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("backend", START_PATHS)
def test_the_account_and_the_timeline_name_the_slowed_rank(backend, tmp_path):
    """#29: a 3-rank job with rank 2 slowed by 100 ms a step (2 s in all): du-launch's closing account names it the
    straggler, the others waiting for it; the merged trace has one row per rank, rank 2's named so, the
    compute between collectives, and the others' waits in the collectives for rank 2. #38: the account's
    JSON goes to --account's file, not to the terminal; rank 0 echoes record lines with no (or another
    job's) token: they are shown as its output, and neither preempt the job (exit 75) nor end it (124)."""
    trace, account_file = tmp_path / "trace.json", tmp_path / "account.json"
    command = [
        "--timeline",
        str(trace),
        "--account",
        str(account_file),
        "python",
        "-c",
        SLOWED + ECHOES_RECORDS,
    ]
    run = launch(3, backend, command, timeout=120)
    assert run.returncode == 0, run.stdout
    for echoed in ('{"event": "preempted", "rank": 0, "signals"', '{"event": "watchdog"', '0f1e2d {"event"'):
        assert f"[rank 0] du-launch-record {echoed}" in run.stdout, run.stdout
    assert "preempted (" not in run.stdout and "the watchdog ended" not in run.stdout, run.stdout
    account = dict(re.findall(r"du-launch: rank (\d): 20 steps, ([\d.]+) s computing", run.stdout))
    waiting = dict(re.findall(r"du-launch: rank (\d): .* \(([\d.]+) s waiting for the others\)", run.stdout))
    assert set(account) == set(waiting) == {"0", "1", "2"}, run.stdout
    assert float(account["2"]) >= 2.0 > max(float(account["0"]), float(account["1"])), run.stdout
    assert float(waiting["2"]) == 0 and min(float(waiting["0"]), float(waiting["1"])) > 1.0, run.stdout
    assert re.search(r"du-launch: rank 2 is the straggler, computing [\d.]+x as long", run.stdout), run.stdout
    assert "du-launch: account" not in run.stdout, run.stdout
    record = json.loads(account_file.read_text())  # (for programs)
    assert record["straggler"] == 2 and [a["steps"] for a in record["ranks"].values()] == [20, 20, 20], record
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert rows == {0: "rank 0", 1: "rank 1", 2: "rank 2 (the straggler)"}, rows
    reductions = [e for e in events if e["name"] == "start_sum" and e["args"]["bytes"] == 64 * 65 * 4]
    assert {e["pid"] for e in reductions} == {0, 1, 2} and len(reductions) == 3 * 20
    waited = collections.Counter()  # (rank, for whom) -> ms
    for e in events:
        if "waited_ms" in e.get("args", {}):
            waited[e["pid"], e["args"]["for_rank"]] += e["args"]["waited_ms"]
    # (rank 2 waits for the others too, when they are not scheduled: 3 ranks share 2 cores)
    assert min(waited[0, 2], waited[1, 2]) > 1000 > waited[2, 0] + waited[2, 1], waited
    computed = [e for e in events if e["name"] == "compute"]
    assert {e["pid"] for e in computed} == {0, 1, 2} and all(e["dur"] >= 0 for e in computed)


def test_a_timeline_has_no_rows_from_an_earlier_job(tmp_path):
    """A rank that writes no timeline (it ended without Python's exit) leaves no row; an earlier job's
    file for its rank (here unreadable) is not merged: du-launch removes the files of earlier jobs."""
    (tmp_path / "trace.rank-1.json").write_text("not a trace")
    program = (
        "import os, distributed_utils as du\nb = du.initialize()\ndu.barrier(b)\n"
        "if du.local_rank(b) == 1:\n    os._exit(0)"
    )
    run = launch(2, "ring", ["--timeline", str(tmp_path / "trace.json"), "python", "-c", program], timeout=60)
    assert run.returncode == 0 and "with rows for ranks [0]" in run.stdout, run.stdout
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0} and any(e["name"] == "barrier" for e in events), events


def test_the_timeline_names_diloco_syncs_and_checkpoints(tmp_path):
    """#29: DiLoCo's syncs and the checkpoints' saves and loads are regions of the timeline, around
    the collectives they make: 12 steps syncing every 4 and saving every 4, on both ranks."""
    train = ["python", "tests/programs/train.py", str(tmp_path / "out"), "--diloco", "4"]
    command = ["--timeline", str(tmp_path / "t.json"), *train, "--checkpoint", str(tmp_path / "ck")]
    run = launch(2, "ring", command, timeout=120)
    assert run.returncode == 0, run.stdout
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        names = collections.Counter(e["name"] for e in mine)
        assert names["DiLoCo sync: start"] == names["DiLoCo sync: outer step"] == 3, names
        assert names["save_checkpoint"] == 3 and names["load_checkpoint"] == 1, names
        for region in [e for e in mine if e["name"] in ("save_checkpoint", "DiLoCo sync: start")]:
            inside = [
                e
                for e in mine
                if e["args"].get("seq") and region["ts"] <= e["ts"] <= region["ts"] + region["dur"]
            ]
            assert inside, (region, names)


def test_the_timeline_of_a_job_the_watchdog_ended_shows_where_it_waited(tmp_path):
    """#29: rank 1 never comes to the barrier (it hangs elsewhere); rank 0's watchdog ends the job, its
    timeline written first: its last collective is the barrier, as long as the timeout."""
    program = (
        "import time, distributed_utils as du\nb = du.initialize()\ndu.barrier(b)\n"
        "if du.local_rank(b) == 1:\n    time.sleep(600)  # a rank stuck outside any collective\ndu.barrier(b)"
    )
    command = ["--timeout", "2", "--timeline", str(tmp_path / "t.json"), "python", "-c", program]
    run = launch(2, "ring", command, timeout=120)
    assert run.returncode == 124 and "with rows for ranks [0]" in run.stdout, run.stdout
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    collectives = [e for e in events if e["pid"] == 0 and e.get("args", {}).get("seq")]
    assert [e["name"] for e in collectives[-2:]] == ["barrier", "barrier"], collectives
    assert collectives[-1]["dur"] >= 2e6, collectives[-1]


def test_the_account_advises_on_transfers_only_in_a_job_long_enough_to_tell(capsys):
    """#38: more time in collectives than computing is advice worth giving after seconds of it, not in a
    30-step job of 0.03 s (start-up and noise)."""
    from distributed_utils.supervise import Report, show_account

    for seconds, advised in ((0.03, False), (30, True)):
        report = Report(2)
        for rank in range(2):
            account = dict(steps=30, seconds=seconds, collectives=0.8 * seconds, bytes=1 << 20)
            report.records["account"][rank] = account
        show_account(report)
        assert ("a faster link" in capsys.readouterr().err) is advised, seconds


def test_checks_that_finish_at_once_keep_each_others_measurements(tmp_path, monkeypatch):
    """#38: two processes remembering --check's measurements at once (nodes sharing a home folder) keep
    every entry: without a lock each read the file, updated it and replaced the other's update."""
    from distributed_utils.launch import checked_gbps

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fork = multiprocessing.get_context("fork")
    together = fork.Barrier(2)

    def remember(writer):
        together.wait()
        for i in range(100):
            checked_gbps([f"host-{writer}-{i}"], "ring", 1.0 + i)

    writers = [fork.Process(target=remember, args=(w,)) for w in range(2)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=60)
    assert [p.exitcode for p in writers] == [0, 0]
    kept = {
        (w, i) for w in range(2) for i in range(100) if checked_gbps([f"host-{w}-{i}"], "ring") == 1.0 + i
    }
    assert len(kept) == 200, f"{200 - len(kept)} of 200 entries lost"


@pytest.mark.parametrize(
    "value, on",
    [("1", True), ("yes", True), ("0", False), ("off", False), ("False", False), ("No", False), ("", False)],
)
def test_du_debug_is_off_for_the_words_that_say_off(monkeypatch, value, on):
    """Found by an adversarial test: DU_DEBUG=off (False, No) turned debug mode on."""
    from distributed_utils.backends.contract import watchdog_environment

    monkeypatch.setenv("DU_DEBUG", value)
    assert watchdog_environment()["debug"] is on


def test_records_are_written_only_under_du_launch(monkeypatch, capfd):
    """#38: a rank that du-launch did not start (plain mpirun) writes no record lines: the watchdog's went
    to its stderr as raw ``du-launch-record {...}`` lines."""
    from distributed_utils import watchdog
    from distributed_utils.backends.contract import record, say_record

    monkeypatch.delenv("DU_RECORD_TOKEN", raising=False)
    monkeypatch.delenv("DU_REPORT_DIR", raising=False)
    watchdog._say(record("watchdog", rank=0, waiting="#3", stopped=False))
    say_record("preempted", signals=["SIGTERM"])
    written = capfd.readouterr()
    assert "du-launch-record" not in written.out + written.err, written


BARE_REDUCTIONS = """
import mlx.core as mx, distributed_utils as du
b = du.initialize()
for step in range(7):  # MIGRATION.md's place for nn.average_gradients: a step each
    mx.eval(du.reduce_gradients(b, {"w": mx.ones((4,)) * step}))
"""


def test_a_loop_of_bare_reduce_gradients_gets_an_account_of_its_steps():
    """#38: the account counted optimizer steps alone; a loop of du.reduce_gradients got none."""
    run = launch(2, "ring", ["python", "-c", BARE_REDUCTIONS], timeout=60)
    assert run.returncode == 0, run.stdout
    assert re.search(r"du-launch: rank 0: 7 steps, [\d.]+ s computing", run.stdout), run.stdout


A_BAR_THEN_A_RECORD = """
import sys, mlx.core as mx, distributed_utils as du
b = du.initialize()
du.reduce_gradients(b, {"w": mx.ones((4,))})
print("a bar drawn without its end", end="", file=sys.stderr, flush=True)  # (the account's record follows)
"""


@pytest.mark.parametrize("backend", START_PATHS)
def test_a_record_after_a_line_without_its_end_is_read_and_the_line_shown(backend):
    """Found by an adversarial test: a record written after a line that had no end yet (a progress bar's)
    was shown as output, and the account (or a preemption: exit 0, not 75) was lost."""
    run = launch(2, backend, ["python", "-c", A_BAR_THEN_A_RECORD], timeout=60)
    assert run.returncode == 0, run.stdout
    assert "du-launch-record" not in run.stdout, run.stdout
    assert re.search(r"du-launch: rank 1: 1 steps", run.stdout), run.stdout
    for r in range(2):
        assert f"[rank {r}] a bar drawn without its end\n" in run.stdout, run.stdout


def test_a_record_of_another_shape_is_shown_as_a_line_and_the_job_goes_on():
    """Found by an adversarial test: a line with the job's token and a JSON list (or an event that is no
    name) killed du-launch's reader of that rank: its pipe filled, and the job hung."""
    forged = (
        "import os\ntoken = os.environ['DU_RECORD_TOKEN']\n"
        "print(f'du-launch-record {token} [1, 2]')\nprint(f'du-launch-record {token} {{\"event\": [1]}}')\n"
        "for i in range(20000): print('line', i, 'x' * 100)\nprint('done')"
    )
    run = launch(2, "ring", ["python", "-c", forged], timeout=60)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "[rank 1] done" in run.stdout and "[1, 2]" in run.stdout, run.stdout[-2000:]


def test_a_reader_that_stops_reading_does_not_stop_the_job():
    """Found by an adversarial test: `du-launch ... | head -1` hung: du-launch stopped forwarding at the
    broken pipe, and the ranks blocked writing to theirs."""
    chatty = "import distributed_utils as du\nb = du.initialize()\nfor i in range(100000): print('line', i)"
    argv = [*DU_LAUNCH, "-n", "2", "--backend", "ring", "python", "-c", chatty]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.stdout.readline()
    proc.stdout.close()  # (as `2>&1 | head -1` does: du-launch's own lines too)
    try:
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
