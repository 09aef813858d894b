"""Where a step's time goes: plain HSDP against live FSDP2, the arms of ``live_steady.py``, one run of each.

Each rank runs its script under this file's ``--wrap`` mode, which times named functions (wall and the
calling thread's CPU, ``time.thread_time``) and the rank process's CPU over all its threads, from the
``WARMUP``-th step on, and writes them at the rank's exit. The table gives per step, averaged over the
4 ranks: the process CPU, the CPU of the run's other processes over the same window (the live launcher,
its store and lighthouse; torchrun's agent; sampled from ``/proc`` every ``SAMPLE_S``: they share the
cores with the ranks), then each section's wall and main-thread CPU. On 4 ranks sharing 2 cores the
CPU a rank spends per step bounds the steps/s more than any wall figure; wall figures include the waits
for the slowest rank. ``--base-src DIR`` adds the live FSDP2 arm run on another tree's ``src`` (for
example ``git archive main src | tar -x -C DIR``), a before/after in one run.
Target (the RESULT lines): live FSDP2's process CPU per step within 5 % of plain HSDP's, a rank's; and the
whole run's (the ranks' and the other processes'), which bounds the steps/s when the cores are shared.
Usage: ``python benchmarks/live_steady_sections.py [--quick] [--steps 40] [--base-src DIR]``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
WARMUP = 5
FSDP2 = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
COMMON = ["torch.autograd:backward", "torch.optim.adamw:AdamW.step", f"{FSDP2}:foreach_all_gather",
          f"{FSDP2}:foreach_reduce"]
SECTIONS = {
    "plain HSDP": (COMMON + ["torch.nn.utils:clip_grad_norm_"], "torch.distributed.tensor._api:DTensor.full_tensor"),
    # the FSDP2 layout's share and waits (``live/layout_fsdp.py``); a --base-src tree from before the layouts
    # has them as LiveWorker.fsdp_shares and LiveWorker.wait_group: each tree times the names it has
    "live FSDP2": (COMMON + [f"trainguard.live.worker:LiveWorker.{name}" for name in
                             ("fsdp_shares", "reduce", "norms", "wait_group")]
                   + [f"trainguard.live.layout_fsdp:FsdpLayout.{name}" for name in ("compute", "wait_group")]
                   + ["trainguard.live.state:LiveState.undo_point", "trainguard.live.fsdp_comms:GroupLink.swap"],
                   "trainguard.live.worker:LiveWorker.step"),
}


def wrap(out_dir: str, timed: list[str], step_mark: str, argv: list[str]) -> None:
    """Runs the script ``argv[0]`` as ``__main__`` with ``timed`` and ``step_mark`` (module:qualname) timed."""
    totals: dict[str, list[float]] = {}
    marks = {"steps": 0, "wall": 0.0, "cpu": 0.0, "began": 0.0}

    def patch(spec: str, is_mark: bool) -> None:
        module, qualname = spec.split(":")
        try:
            owner = importlib.import_module(module)
        except ModuleNotFoundError:  # a section of another tree (``SECTIONS``)
            return
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def timed_call(*args, **kwargs):
            if is_mark:
                marks["steps"] += 1
                if marks["steps"] == WARMUP + 1:
                    totals.clear()
                    marks["wall"], marks["cpu"] = time.perf_counter(), time.process_time()
                    marks["began"] = time.time()
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                short = path and path[0] in ("LiveWorker", "FsdpLayout")
                entry = totals.setdefault(qualname.split(".")[-1] if short else qualname, [0.0, 0.0, 0])
                entry[0] += time.perf_counter() - wall
                entry[1] += time.thread_time() - cpu
                entry[2] += 1

        setattr(owner, name, timed_call)

    for spec in timed:
        patch(spec, False)
    patch(step_mark, True)

    def dump() -> None:
        steps = marks["steps"] - WARMUP
        Path(out_dir, f"{os.getpid()}.json").write_text(json.dumps({
            "steps": steps, "wall": time.perf_counter() - marks["wall"], "cpu": time.process_time() - marks["cpu"],
            "began": marks["began"], "ended": time.time(), "sections": totals}))

    real_exit = os._exit

    def exit_after_dump(code: int) -> None:  # a live rank ends with os._exit (rank.py)
        dump()
        real_exit(code)

    os._exit = exit_after_dump
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        pass
    dump()


def run_arm(arm: str, steps: int, micro_batches: int, tmp: Path, src: Path = ROOT / "src") -> list[dict]:
    out = tmp / f"{arm.replace(' ', '_')}_{len(list(tmp.iterdir()))}"
    out.mkdir()
    timed, mark = SECTIONS[arm]
    wrapper = [__file__, "--wrap", str(out), ",".join(timed), mark, "--"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(EXAMPLES), str(src)]))
    if arm == "plain HSDP":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *wrapper,
                   str(EXAMPLES / "user_loop_plain.py"), "--run-dir", str(out / "run"), "--steps", str(steps),
                   "--micro-batches", str(micro_batches), "--replicate", "2"]
    else:
        config = out / "config.yaml"
        config.write_text(f"parallel: {{dp_replicate: 2, dp_shard: 2}}\ntrain: {{steps: {steps}, micro_batches: "
                          f"{micro_batches}}}\ncheckpoint: {{save_interval: 0}}\nguards: {{fingerprint: {{interval: 0}}}}\n"
                          "fault_tolerance: {live: true, fsdp: true}\n")
        command = [sys.executable, "-m", "trainguard", "run", "--nproc", "4", "--config", str(config), "--run-dir",
                   str(out / "run"), "--", sys.executable, *wrapper, str(EXAMPLES / "user_loop.py"), "--config",
                   str(config)]
    samples = []  # (time, {pid: CPU seconds}) of every process of the run, every SAMPLE_S
    with subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        while proc.poll() is None:
            samples.append((time.time(), {pid: process_cpu(pid) for pid in process_tree(proc.pid)}))
            time.sleep(SAMPLE_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the {arm} arm exited {proc.returncode}")
    ranks = [dict(json.loads(path.read_text()), pid=int(path.stem)) for path in sorted(out.glob("*.json"))]
    for rank in ranks:
        rank["others_cpu"] = others_cpu(samples, {r["pid"] for r in ranks}, rank)
    return ranks


SAMPLE_S = 0.5


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def process_cpu(pid: int) -> float:
    """A process's user + system CPU seconds, all its threads (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def others_cpu(samples: list[tuple[float, dict[int, float]]], rank_pids: set[int], rank: dict) -> float:
    """The CPU the run's processes other than its ranks (the launcher with its store and lighthouse, or
    torchrun's agent) spent over ``rank``'s timed window, from the samples inside it (scaled to the window)."""
    inside = [(at, cpu) for at, cpu in samples if rank["began"] <= at <= rank["ended"]]
    if len(inside) < 2:
        return 0.0
    (first_at, first), (last_at, last) = inside[0], inside[-1]
    spent = sum(cpu - first.get(pid, 0.0) for pid, cpu in last.items() if pid not in rank_pids)
    return spent * (rank["ended"] - rank["began"]) / (last_at - first_at)


TARGET = 1.05  # live FSDP2's process CPU per step over plain HSDP's


def per_step(value: float, rank: dict) -> float:
    return 1000 * value / max(rank["steps"], 1)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(arm: str, ranks: list[dict]) -> None:
    print(f"\n{arm}: {len(ranks)} ranks, {ranks[0]['steps']} steps timed; per step, mean over the ranks\n")
    print(f"| {'section':<28} | {'wall ms':>8} | {'main-thread CPU ms':>18} | {'calls':>5} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 20}|{'-' * 7}|")
    print(f"| {'step (wall; process CPU)':<28} | {mean([per_step(r['wall'], r) for r in ranks]):>8.1f} | "
          f"{mean([per_step(r['cpu'], r) for r in ranks]):>18.1f} | {'':>5} |")
    print(f"| {'launcher/agent process CPU':<28} | {'':>8} | {mean([per_step(r['others_cpu'], r) for r in ranks]):>18.1f} "
          f"| {'':>5} |")
    for name in sorted({name for rank in ranks for name in rank["sections"]}):
        values = [rank["sections"].get(name, [0.0, 0.0, 0]) for rank in ranks]
        print(f"| {name.split(':')[-1]:<28} | {mean([per_step(v[0], r) for v, r in zip(values, ranks)]):>8.1f} | "
              f"{mean([per_step(v[1], r) for v, r in zip(values, ranks)]):>18.1f} | "
              f"{mean([v[2] / max(r['steps'], 1) for v, r in zip(values, ranks)]):>5.1f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--wrap":
        out_dir, timed, mark, _dashes, *argv = sys.argv[2:]
        wrap(out_dir, timed.split(","), mark, argv)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="runs of 12 steps")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--base-src", type=Path, help="also run the live FSDP2 arm on this trainguard source tree")
    args = parser.parse_args()
    steps = 12 if args.quick else args.steps
    cpu, run_cpu = {}, {}
    with tempfile.TemporaryDirectory(prefix="live_sections_") as tmp:
        for arm in SECTIONS:
            ranks = run_arm(arm, steps, args.micro_batches, Path(tmp))
            table(arm, ranks)
            cpu[arm] = mean([per_step(rank["cpu"], rank) for rank in ranks])
            # the whole run's: every rank's, and the other processes' once (each rank's window sees them all)
            run_cpu[arm] = len(ranks) * cpu[arm] + mean([per_step(rank["others_cpu"], rank) for rank in ranks])
        if args.base_src is not None:
            table(f"live FSDP2 on {args.base_src}",
                  run_arm("live FSDP2", steps, args.micro_batches, Path(tmp), args.base_src.resolve()))
    live, plain = cpu["live FSDP2"], cpu["plain HSDP"]
    print_result("live_fsdp2_process_cpu_ms_per_step", live, plain, f"<= {TARGET}x plain HSDP", live <= TARGET * plain,
                 steps=steps, micro_batches=args.micro_batches)
    live, plain = run_cpu["live FSDP2"], run_cpu["plain HSDP"]
    print_result("live_fsdp2_run_cpu_ms_per_step", live, plain, f"<= {TARGET}x plain HSDP", live <= TARGET * plain,
                 steps=steps, micro_batches=args.micro_batches)


if __name__ == "__main__":
    main()
