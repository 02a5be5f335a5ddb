"""The code is as `ruff format` writes it (line length 110, pyproject.toml), with no `# fmt: skip`."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_code_is_as_the_formatter_writes_it():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency: pip install '.[test]'"
    run = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    marked = subprocess.run(
        ["git", "grep", "-n", "-e", "fmt: skip", "-e", "fmt: off", "--", "*.py", ":!tests/test_style.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert marked == "", f"no hand-packed lines: {marked}"
