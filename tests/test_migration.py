"""Every ```python block of MIGRATION.md runs, on 2 processes under du-launch.

Blocks that call ``mx.distributed`` themselves run under ``--backend ring``; blocks that name
``du.MPIBackend`` under ``--backend mpi``; the others under both. One job per backend runs its
blocks one after the other, each in a fresh namespace, in a scratch directory.
"""

import re

import pytest
from launching import ROOT, launch

BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

RUNNER = """
import os, sys
os.chdir(sys.argv[1])
for path in sys.argv[2:]:
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__main__"})
    print(f"snippet ok: {os.path.basename(path)}", flush=True)
"""


def blocks():
    """``[(language, first line in MIGRATION.md, code)]`` for every fenced block."""
    text = (ROOT / "MIGRATION.md").read_text()
    return [(m.group(1), text[: m.start()].count("\n") + 2, m.group(2)) for m in BLOCK.finditer(text)]


def python_snippets():
    return [(line, code) for lang, line, code in blocks() if lang == "python"]


def backends_for(code):
    if "mx.distributed" in code:
        return ["ring"]
    if "MPIBackend" in code:
        return ["mpi"]
    return ["mpi", "ring"]


def test_the_page_has_snippets_for_every_origin():
    text = (ROOT / "MIGRATION.md").read_text()
    assert len(python_snippets()) >= 8
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for origin in ["`mx.distributed` loop", "`mlx.nn.average_gradients`", "Lux.jl", "FluxMPI.jl", "Horovod"]:
        assert any(origin in h for h in headings), (origin, headings)
    for name in [
        "initialize",
        "initialized",
        "get_distributed_backend",
        "local_rank",
        "total_workers",
        "bcast!",
        "allreduce!",
        "reduce!",
        "allgather!",
        "synchronize!!",
        "DistributedDataContainer",
        "DistributedOptimizer",
        "MPIBackend",
        "NCCLBackend",
        "avg",
    ]:
        assert re.search(r"\| `[^`\n]*" + re.escape(name), text), f"no row of a table names Lux's {name}"
    for name in [
        "hvd.init",
        "hvd.rank",
        "hvd.size",
        "hvd.DistributedOptimizer",
        "broadcast_parameters",
        "broadcast_optimizer_state",
        "hvd.allreduce",
    ]:
        assert name in text, name
    assert "MEASUREMENTS" not in text


def test_every_block_is_python_that_compiles_or_marked_as_another_language():
    for lang, line, code in blocks():
        assert lang in ("python", "julia", "text", "bash"), f"MIGRATION.md:{line}: a ```{lang} block"
        if lang == "python":
            compile(code, f"MIGRATION.md:{line}", "exec")
        if lang == "text":  # code that cannot run here (PyTorch + Horovod), kept out of ```python
            assert "import" in code or "horovodrun" in code, f"MIGRATION.md:{line}"


@pytest.mark.parametrize("backend", ["mpi", "ring"])
def test_snippets_run_on_two_processes(backend, tmp_path):
    paths = []
    for line, code in python_snippets():
        if backend in backends_for(code):
            path = tmp_path / f"MIGRATION_md_line_{line}.py"
            path.write_text(code)
            paths.append(path)
    assert paths
    work = tmp_path / "work"
    work.mkdir()
    run = launch(2, backend, ["python", "-c", RUNNER, str(work), *map(str, paths)], timeout=240)
    assert run.returncode == 0, run.stdout
    for path in paths:
        for rank in (0, 1):
            assert f"[rank {rank}] snippet ok: {path.name}" in run.stdout, run.stdout
