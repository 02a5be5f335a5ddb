"""What ``du-launch --timeline`` costs, and what it shows (#29).

    python benchmarks/timeline.py [--backend mpi] [--runs 5] [--steps 300] [--plot docs/images/timeline.png]

1. The cost: a 2-rank data-parallel job (an MLP 64-256-256-10, AdamW, batch 32 a rank: about a
   millisecond a step, so the timeline's work at each collective weighs as much as it can) run
   with and without ``--timeline``, alternating, ``--runs`` times each. Reported: each run's median
   step time (rank 0's, timed in the program) and the ratio of the medians, timeline / none.
2. ``--plot``: a 2-rank job whose rank 1 is slowed (10 ms of sleep a step), its merged trace
   drawn as a picture of its last steps, one row per rank: computing, in collectives, and the part
   of each collective spent waiting for the other rank.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def rank_program(args):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    import distributed_utils as du

    backend = du.initialize()
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    du.synchronize(backend, model)
    opt = du.DistributedOptimizer(backend, optim.AdamW(1e-3))
    loss_and_grad = nn.value_and_grad(model, lambda m, x, y: nn.losses.cross_entropy(m(x), y).mean())
    x, y = mx.random.normal((32, 64)), mx.random.randint(0, 10, (32,))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        if du.local_rank(backend) == args.slow:
            time.sleep(0.010)
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        times.append(time.perf_counter() - start)
    if du.local_rank(backend) == 0:
        print("RESULT", json.dumps({"step": statistics.median(times[10:])}), flush=True)


def job(args, timeline=None, slow=-1, steps=None) -> float:
    """One run under du-launch: rank 0's median step time in seconds."""
    launch = [sys.executable, "-m", "distributed_utils.launch", "-n", "2", "--backend", args.backend]
    command = ["python", __file__, "--rank-program", "--steps", str(steps or args.steps), "--slow", str(slow)]
    run = subprocess.run(
        launch + (["--timeline", timeline] if timeline else []) + command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if "RESULT" in line]
    if run.returncode or not lines:
        raise SystemExit(f"the job failed (exit code {run.returncode}):\n{run.stdout}\n{run.stderr}")
    return json.loads(lines[0].split("RESULT", 1)[1])["step"]


def draw(trace, path, total_steps, steps=4):
    """The last ``steps`` of the ``total_steps`` steps of ``trace``: a row per rank, its computing, collectives
    and waits."""
    from plots import _pyplot

    plt = _pyplot()
    events = json.loads(Path(trace).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    # each step's buckets travel as start_sums, each waited for: the step's last wait ends it
    waits = sorted(e["ts"] + e["dur"] for e in events if e["pid"] == 0 and e["name"] == "wait")
    per_step = len(waits) // total_steps
    t0 = waits[per_step - 1 :: per_step][-steps - 1]  # from the end of the step before the window
    fig, ax = plt.subplots(figsize=(9, 2.4))
    for row, (pid, name) in enumerate(sorted(names.items())):
        mine = [e for e in events if e["pid"] == pid and e["ph"] == "X" and e["ts"] >= t0]
        for e in mine:
            start, length = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            waited = min(e.get("args", {}).get("waited_ms", 0), length)
            colour = "#bbbbbb" if e["name"] == "compute" else "#3b75af"
            ax.broken_barh([(start + waited, length - waited)], (row - 0.35, 0.7), color=colour)
            if waited:
                ax.broken_barh([(start, waited)], (row - 0.35, 0.7), color="#ef8636")
    ax.set_yticks(range(len(names)), [names[p] for p in sorted(names)])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    legend = [
        ("computing", "#bbbbbb"),
        ("in a collective", "#3b75af"),
        ("waiting for the other rank", "#ef8636"),
    ]
    for label, colour in legend:
        ax.bar(0, 0, color=colour, label=label)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=3)
    ax.set_title(f"du-launch --timeline: the last {steps} steps of a 2-rank job, rank 1 slowed", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (with the legend below the axes)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="mpi")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--plot", help="a PNG of a slowed job's timeline")
    p.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--slow", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_program:
        return rank_program(args)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"none": [], "timeline": []}
        for _ in range(args.runs):  # (--runs 0: the picture alone)
            runs["none"].append(job(args))
            runs["timeline"].append(job(args, timeline=f"{tmp}/trace.json"))
        print(f"{args.backend}, 2 ranks, {args.steps} steps: median step time (ms) of each run")
        for name, times in runs.items():
            print(f"  {name:>9}: {' '.join(f'{t * 1e3:.3f}' for t in times)}")
        if args.runs:
            ratio = statistics.median(runs["timeline"]) / statistics.median(runs["none"])
            print(f"  timeline / none: {ratio:.3f}")
        if args.plot:
            job(args, timeline=f"{tmp}/slowed.json", slow=1, steps=20)
            draw(f"{tmp}/slowed.json", args.plot, total_steps=20)
            print(f"  the picture: {args.plot}")


if __name__ == "__main__":
    main()
