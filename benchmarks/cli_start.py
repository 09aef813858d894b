"""How long the commands people run by hand and from cron take, beside ``python -c pass``.

Each command runs through the installed ``trainguard`` entry point, as a user runs it, on a real run
directory (a 1-rank run of 4 steps with checkpoints at steps 2 and 4, trained first, not timed; or
``--run-dir``). The commands take turns repeat by repeat, so load drift hits them alike; the table
gives each one's median wall time and CPU time (user + system of the process), and the same less
``python -c pass`` (the interpreter's own start). ``python -c "import torch, transformers"`` is
timed beside them: what every command paid when the CLI imported both. Target: each command
≤ 0.5 s wall on an idle machine. Nothing here fails on a timing.

Usage: python benchmarks/cli_start.py [--quick] [--repeats N] [--run-dir RUN]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, print_result  # noqa: E402

TARGET_S = 0.5
ENTRY_POINT = Path(sys.executable).with_name("trainguard")
TINY_RUN = ["--nproc", "1", "--steps", "4", "--save-interval", "2", "--set", "model.preset=llama-micro",
            "--set", "data.seq_len=32", "--set", "data.micro_batch_size=2"]


def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``command``, which must exit 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def commands(run_dir: Path, switch: Path) -> dict[str, list[str]]:
    cli = str(ENTRY_POINT)
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch, transformers'": [sys.executable, "-c", "import torch, transformers"],
        "trainguard --help": [cli, "--help"],
        "trainguard train --help": [cli, "train", "--help"],
        "trainguard status RUN": [cli, "status", str(run_dir)],
        "trainguard watch RUN --once": [cli, "watch", str(run_dir), "--once"],
        "trainguard killswitch PATH": [cli, "killswitch", str(switch)],
        "trainguard killswitch PATH --clear": [cli, "killswitch", str(switch), "--clear"],
        "trainguard ckpt list RUN": [cli, "ckpt", "list", str(run_dir)],
    }


def train_tiny_run(where: Path) -> Path:
    run_dir = where / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(ENTRY_POINT), "train", "--run-dir", str(run_dir), *TINY_RUN], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training the run to read failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats instead of 15")
    parser.add_argument("--repeats", type=int, help="runs of each command (default 15, 5 with --quick)")
    parser.add_argument("--run-dir", type=Path, help="an existing run directory to read (default: train a tiny one)")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    if not ENTRY_POINT.is_file():
        raise SystemExit(f"no trainguard entry point beside {sys.executable}: pip install -e .")
    with tempfile.TemporaryDirectory(prefix="cli_start-") as scratch:
        run_dir = args.run_dir or train_tiny_run(Path(scratch))
        todo = commands(run_dir, Path(scratch) / "stop")
        walls: dict[str, list[float]] = {name: [] for name in todo}
        cpus: dict[str, list[float]] = {name: [] for name in todo}
        load_start = os.getloadavg()[0]
        for _ in range(repeats):
            for name, command in todo.items():  # in turn, so that load drift hits every command alike
                wall, cpu = timed(command)
                walls[name].append(wall)
                cpus[name].append(cpu)
        load_end = os.getloadavg()[0]

    base_wall, base_cpu = median(walls["python -c pass"]), median(cpus["python -c pass"])
    print(f"median of {repeats} runs each; load average {load_start:.1f} at start, {load_end:.1f} at end "
          f"({os.cpu_count()} CPUs); target: each trainguard command ≤ {TARGET_S} s wall when idle")
    print(f"{'command':42} {'wall s':>8} {'cpu s':>8} {'wall - pass':>12} {'cpu - pass':>11}")
    for name in todo:
        wall, cpu = median(walls[name]), median(cpus[name])
        print(f"{name:42} {wall:8.3f} {cpu:8.3f} {wall - base_wall:12.3f} {cpu - base_cpu:11.3f}")
    for name in todo:
        if name.startswith("trainguard"):
            wall = median(walls[name])
            print_result(f"{name}: start to exit (s, median wall)", wall, base_wall, f"≤ {TARGET_S} s when idle",
                         wall <= TARGET_S, baseline_is="python -c pass", cpu_s=median(cpus[name]),
                         load_start=load_start, load_end=load_end)


if __name__ == "__main__":
    main()
