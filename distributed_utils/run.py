"""Run one rank's Python program so that its failure ends the whole MPI job at once.

    python -m distributed_utils.run script.py ARGS...   |   -m module ARGS...   |   -c CODE ARGS...

A rank that exits non-zero or raises would otherwise block forever in MPI_Finalize,
waiting for ranks that wait for it. ``du-launch`` inserts this for the MPI backends;
like ``python -m mpi4py``, but it aborts before MLX's MPI teardown can block.
"""

import os
import runpy
import sys
import traceback


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit(__doc__)
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if status:
            if not isinstance(code, int):
                print(code, file=sys.stderr)
            abort_mpi(status)
        say_finished()
        raise
    except BaseException:
        traceback.print_exc()
        abort_mpi(130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1)
        raise
    say_finished()


def say_finished():
    """Tell du-launch (which hides the line) that this rank's program ended well: if the
    others then wait for it in a collective, it left the job early."""
    if os.environ.get("DU_JOB_ID") and "OMPI_COMM_WORLD_RANK" in os.environ:
        print(f"du-launch: rank {os.environ['OMPI_COMM_WORLD_RANK']} finished", file=sys.stderr, flush=True)


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
