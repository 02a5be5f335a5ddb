"""The docs cannot drift from the code.

Every fenced block of README.md and docs/ is either a ```python program that runs here, on 2
processes under du-launch, or follows an ``<!-- not run: WHY -->`` line. Blocks that call
``mx.distributed`` themselves run under ``--backend ring``; blocks whose code names ``du.MPIBackend``
under ``--backend mpi``; the others under both. One job per backend runs its blocks one after the
other, each in a fresh namespace, in a scratch directory. The site builds with ``mkdocs build
--strict`` (a broken link or reference fails), and its pages render navigation, code and pictures.
"""

import html.parser
import re
import subprocess
import sys
import textwrap

import pytest
from launching import ROOT, launch

FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->")

RUNNER = """
import os, sys
os.chdir(sys.argv[1])
for path in sys.argv[2:]:
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__main__"})
    print(f"snippet ok: {os.path.basename(path)}", flush=True)
"""


def pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks():
    """``[(where, language, code, why_not_run)]`` for every fenced block of every page; ``where`` is
    ``page:line``, ``why_not_run`` the reason of the ``<!-- not run: ... -->`` line just before it, or None."""
    found = []
    for page in pages():
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
            why = NOT_RUN.fullmatch(before.strip())
            where = f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
            found.append((where, m.group(2), textwrap.dedent(m.group(3)), why and why.group(1)))
    return found


def programs():
    return [(where, code) for where, lang, code, why in blocks() if why is None]


def backends_for(code):
    code = re.sub(r"#.*", "", code)  # (what the comments name does not count)
    if "mx.distributed" in code:
        return ["ring"]
    if "MPIBackend" in code:
        return ["mpi"]
    return ["mpi", "ring"]


def test_every_block_runs_or_says_why_not():
    assert len(blocks()) > 40
    for where, lang, code, why in blocks():
        assert why is not None or lang == "python", (
            f"{where}: a ```{lang} block without <!-- not run: why -->"
        )
        if lang == "python" and why is None:
            compile(code, where, "exec")
    assert len(programs()) >= 10


def test_the_migration_pages_have_snippets_for_every_origin():
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "guides" / "migrating").glob("*.md")))
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


@pytest.mark.parametrize("backend", ["mpi", "ring"])
def test_the_programs_run_on_two_processes(backend, tmp_path):
    paths = []
    for where, code in programs():
        if backend in backends_for(code):
            path = tmp_path / (re.sub(r"\W", "_", where) + ".py")
            path.write_text(code)
            paths.append(path)
    assert paths
    work = tmp_path / "work"
    work.mkdir()
    run = launch(2, backend, ["python", "-c", RUNNER, str(work), *map(str, paths)], timeout=300)
    assert run.returncode == 0, run.stdout
    for path in paths:
        for rank in (0, 1):
            assert f"[rank {rank}] snippet ok: {path.name}" in run.stdout, run.stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built as ``mkdocs build --strict`` builds it (a warning fails the build)."""
    pytest.importorskip("mkdocs", reason="the docs need the docs extra: pip install '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out


class Page(html.parser.HTMLParser):
    """What a test checks of a built page: its navigation, code blocks and pictures."""

    def __init__(self):
        super().__init__()
        self.navs, self.images, self.pre, self.code_in_pre, self.ids, self.text = 0, [], 0, 0, set(), []
        self.open = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.ids.add(attrs.get("id"))
        self.navs += tag == "nav"
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        self.pre += tag == "pre"
        self.code_in_pre += tag == "code" and "pre" in self.open
        if tag not in ("img", "br", "hr", "meta", "link", "input"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        if tag in self.open:
            del self.open[len(self.open) - 1 - self.open[::-1].index(tag) :]

    def handle_data(self, data):
        self.text.append(data)


def parsed(path):
    page = Page()
    page.feed(path.read_text())
    return page


def test_the_site_builds_strict_and_renders_navigation_code_and_pictures(site):
    built = {p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")}
    for name in built:
        html_path = site / name / "index.html" if name.name != "index" else site / name.parent / "index.html"
        assert html_path.exists(), f"docs/{name}.md was not built"
        page = parsed(html_path)
        assert page.navs >= 2, f"{html_path}: no navigation"
        assert page.code_in_pre >= page.pre, f"{html_path}: a <pre> without <code>"
        for src in page.images:
            assert (html_path.parent / src).resolve().exists(), f"{html_path}: <img src={src!r}> is missing"
        markdown = (ROOT / "docs" / name).with_suffix(".md").read_text()
        assert page.pre >= len(FENCE.findall(markdown)), f"{html_path}: a code block did not render"


def test_the_reference_lists_every_public_name_and_every_launcher_option(site):
    import distributed_utils as du

    sys.path.insert(0, str(ROOT / "docs"))
    import hooks

    ids = (
        parsed(site / "reference" / "api" / "index.html").ids
        | parsed(site / "reference" / "errors" / "index.html").ids
    )
    public = [n for n in dir(du) if not n.startswith("_") and not isinstance(getattr(du, n), type(du))]
    documented = {i.rsplit(".", 1)[-1] for i in ids if i and i.startswith("distributed_utils.")}
    missing = [n for n in public if n not in documented]
    assert not missing, f"the API reference has no entry for {missing}"
    launcher = "".join(parsed(site / "reference" / "launcher" / "index.html").text)
    for action in hooks.launch_parser()._actions:
        for option in action.option_strings:
            assert option in launcher, f"the du-launch page does not list {option}"
    from distributed_utils.backends import contract

    for backend in ("mpi", "ring", "mlx-mpi"):
        env = {
            **contract.job_environment(backend, 2, "/tmp", timeout=1, debug=True),
            **contract.ring_rank_environment(0, "h"),
        }
        for name in env:
            assert f"`{name}`" in (ROOT / "docs" / "reference" / "launcher.md").read_text(), (
                f"{name} is not documented"
            )
