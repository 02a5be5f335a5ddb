"""A fully sharded model's checkpoint loads at another world size: 2 -> 3 -> 1 ranks, the whole
parameters and optimizer state bit for bit as saved (tests/programs/reshard.py)."""

import re

from launching import launch


def test_a_fully_sharded_checkpoint_reshards_from_2_to_3_to_1_ranks_bit_for_bit(tmp_path):
    runs = []
    for n, backend, load, save in [(2, "ring", None, "a"), (3, "mpi", "a", "b"), (1, "ring", "b", "c")]:
        command = ["python", "tests/programs/reshard.py", str(tmp_path / f"{save}.safetensors")]
        command += ["--load", str(tmp_path / f"{load}.safetensors")] if load else []
        run = launch(n, backend, command, timeout=300)
        assert run.returncode == 0, run.stdout
        runs.append(dict(re.findall(r"\[rank 0\] (loaded|saved) (\w+)", run.stdout)))
    assert runs[1]["loaded"] == runs[0]["saved"], runs
    assert runs[2]["loaded"] == runs[1]["saved"], runs
    assert runs[0]["saved"] != runs[1]["saved"]  # (it trained on)
