"""Run one rank's Python program so that its failure ends the whole MPI job at once.

    python -m distributed_utils.run script.py ARGS...   |   -m module ARGS...   |   -c CODE ARGS...

A rank that exits non-zero or raises would otherwise block forever in MPI_Finalize,
waiting for ranks that wait for it. ``du-launch`` inserts this for the MPI backends;
like ``python -m mpi4py``, but it aborts before MLX's MPI teardown can block.
"""

import fcntl
import os
import runpy
import shutil
import struct
import sys
import termios
import traceback

from distributed_utils.backends.contract import FINISHED, job_id, launched_by_mpirun, say_record


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit(__doc__)
    stdout_like_a_pipe()
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` does
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if not isinstance(e.code, (int, type(None))):  # a message: exit status 1
            print(e.code, file=sys.stderr)
            abort_mpi(1)
        elif e.code:
            abort_mpi(e.code)
        say_finished()
        raise
    except BaseException as e:
        traceback.print_exc()
        abort_mpi(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise
    say_finished()


def stdout_like_a_pipe():
    """Under mpirun a rank's stdout is a pseudo-terminal 0 columns wide: tqdm draws nothing into it, and
    libraries that ask ``isatty()`` write terminal codes into du-launch's output (maybe a log file). Make it
    what it is under the ring: a pipe (``isatty()`` False), as wide as ``COLUMNS`` (du-launch's) or 80."""
    if not (job_id() and os.isatty(1)):
        return
    columns, lines = shutil.get_terminal_size((80, 24))  # COLUMNS and LINES first
    fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    sys.stdout.isatty = lambda: False


def say_finished():
    """Tell du-launch that this rank's program ended well: if the others then wait for it in a
    collective, it left the job early (mpirun's ranks; the ring's exit codes say it)."""
    if launched_by_mpirun():
        say_record(FINISHED)


def abort_mpi(status):
    """MPI_Abort the job if MPI is running in this process; otherwise do nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    import mpi4py

    mpi4py.rc.initialize = False  # never start MPI just to abort it
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(status)


if __name__ == "__main__":
    main(sys.argv[1:])
