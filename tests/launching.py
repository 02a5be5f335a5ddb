"""Running commands under du-launch from a test, with a hard time limit."""

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


#: du-launch, run by this Python: ``[*DU_LAUNCH, "-n", "2", ...]``.
DU_LAUNCH = [sys.executable, "-m", "distributed_utils.launch"]


def launch(n, backend, command, timeout=300, env=None):
    """Run ``du-launch -n N --backend B COMMAND...``; returns the CompletedProcess (text output).
    A run past ``timeout`` is killed with its whole process group and reported as a failure."""
    argv = [*DU_LAUNCH, "-n", str(n), "--backend", backend, *command]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"du-launch -n {n} --backend {backend} timed out after {timeout}s:\n{out}")
    return subprocess.CompletedProcess(argv, proc.returncode, out)
