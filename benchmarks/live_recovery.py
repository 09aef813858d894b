"""Live recovery vs today's restart-based recovery, one SIGKILL, the same run side by side.

4 gloo ranks (2 replica groups x 2), 60 steps of the live drill's workload (``trainguard.live``), one
rank SIGKILLed after step 25 (checkpoints every 10 steps, so the restart redoes 5 steps). Per cycle,
in alternating order: a fault-free run, the failure recovered live (the replacement alone starts, the
others keep their processes), the same with a warm spare as the replacement (``LiveRun.spares``:
a process started with the others, torch imported, waiting to be told which rank it replaces), and
the failure recovered as today (every rank killed and started again from the newest checkpoint).
Figures, from the runs' event timestamps:

- survivors' lost time: from the kill until the surviving ranks are stepping again past the failure
  point and stay so: live, the stall until their new epoch's first step plus the pause of the join's
  state transfer; restart, until step 24 (the last one committed before the kill) is committed again.
- time to rejoin: from the kill until the killed rank's replacement is stepping in the quorum (live),
  until the restarted ranks commit their first step (restart).
- job delay: the time from the kill to the end of the run, minus the fault-free run's time from the
  same step to its end. Live recovery pays here for the survivors computing the missing group's
  micro-batches (the same global batch) until it is back.

Every run's final state is compared bitwise with the fault-free run's. Target: survivors' lost time
of the restart >= 5x the live one. Usage: ``python benchmarks/live_recovery.py [--quick] [--cycles 2]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median, print_result  # noqa: E402

from trainguard.events.log import read_events  # noqa: E402
from trainguard.live.compare import run_differences  # noqa: E402
from trainguard.live.files import events_path  # noqa: E402
from trainguard.live.launcher import LIVE, RESTART, LiveRun, launch  # noqa: E402

TARGET = 5.0
SPARE = "live+spare"  # live recovery whose replacement is a warm spare process (torch imported, waiting)
KILL_AT = 25
KILLED = 3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one cycle")
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch-s", type=float, default=0.02, help="simulated compute per micro-batch")
    return p.parse_args()


def _steps(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "live_step"]


def _kill_time(events: list[dict]) -> float:
    return next(e["time"] for e in events if e["kind"] == "live_kill")


def _done(events: list[dict]) -> float:
    return max(e["time"] for e in events if e["kind"] == "live_done")


def clean_tail(events: list[dict]) -> float:
    """The fault-free run's time from the end of step KILL_AT - 1 to its end."""
    end_of_step = max(e["time"] for e in _steps(events) if e["step"] == KILL_AT - 1)
    return _done(events) - end_of_step


def live_figures(events: list[dict]) -> dict[str, float]:
    killed = _kill_time(events)
    resumed = max(e["time"] for e in events if e["kind"] == "live_resumed")
    paused = max((e["paused_s"] for e in events if e["kind"] == "live_switch"), default=0.0)
    joined = next(e["time"] for e in events if e["kind"] == "live_joined" and e["rank"] == KILLED)
    return {"lost": resumed - killed + paused, "rejoin": joined - killed, "tail": _done(events) - killed}


def restart_figures(events: list[dict]) -> dict[str, float]:
    killed = _kill_time(events)
    after = [e for e in _steps(events) if e["time"] > killed]
    back = max(e["time"] for e in after if e["step"] == KILL_AT - 1)
    respawned = next(e["time"] for e in events if e["kind"] == "live_quorum" and e["reason"] == "restart")
    started = max(e["time"] for e in events if e["kind"] == "live_start" and e["time"] > killed)
    return {"lost": back - killed, "lost_warm": back - killed - (started - respawned),
            "rejoin": min(e["time"] for e in after) - killed, "tail": _done(events) - killed}


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cycles = 1 if args.quick else args.cycles
    base = LiveRun(steps=args.steps, micro_batch_s=args.micro_batch_s, checkpoint_every=10)
    failing = {**base.__dict__, "kill_ranks": (KILLED,), "kill_at_step": KILL_AT}
    rows: dict[str, list[dict[str, float]]] = {LIVE: [], SPARE: [], RESTART: []}
    equal = {LIVE: True, SPARE: True, RESTART: True}
    with tempfile.TemporaryDirectory(prefix="live_bench_") as tmp:
        for cycle in range(cycles):
            order = ["clean", LIVE, SPARE, RESTART] if cycle % 2 == 0 else [RESTART, SPARE, LIVE, "clean"]
            dirs = {}
            for mode in order:
                dirs[mode] = Path(tmp) / f"{cycle}_{mode}"
                run = base if mode == "clean" else LiveRun(**{**failing, "recovery": RESTART if mode == RESTART else LIVE,
                                                               "spares": int(mode == SPARE)})
                launch(dirs[mode], run)
            tail = clean_tail(list(read_events(events_path(dirs["clean"]))))
            for mode, figures_of in ((LIVE, live_figures), (SPARE, live_figures), (RESTART, restart_figures)):
                figures = figures_of(list(read_events(events_path(dirs[mode]))))
                figures["delay"] = figures.pop("tail") - tail
                rows[mode].append(figures)
                equal[mode] &= run_differences(dirs["clean"], dirs[mode], base.world) == {}
    table = {mode: {key: median([r[key] for r in runs]) for key in runs[0]} for mode, runs in rows.items()}
    print(f"\nlive recovery vs restart, 4 gloo ranks (2 groups x 2), {args.steps} steps, SIGKILL of rank "
          f"{KILLED} after step {KILL_AT}, {cycles} cycle(s), medians; load {os.getloadavg()[0]:.1f}")
    print(f"{'recovery':<12}{'survivors lost s':>18}{'lost, warm start s':>20}{'rejoin s':>10}{'job delay s':>13}"
          f"{'bitwise equal':>15}")
    for mode in (RESTART, LIVE, SPARE):
        t = table[mode]
        warm = t.get("lost_warm", t["lost"])
        print(f"{mode:<12}{t['lost']:>18.3f}{warm:>20.3f}{t['rejoin']:>10.3f}{t['delay']:>13.3f}{str(equal[mode]):>15}")
    ratio = table[RESTART]["lost"] / table[LIVE]["lost"]
    warm_ratio = table[RESTART]["lost_warm"] / table[LIVE]["lost"]
    print(f"restart / live: survivors' lost time {ratio:.1f}x ({warm_ratio:.1f}x with a warm start), job delay "
          f"{table[RESTART]['delay'] / table[LIVE]['delay']:.1f}x, time to rejoin "
          f"{table[RESTART]['rejoin'] / table[LIVE]['rejoin']:.1f}x ({table[RESTART]['rejoin'] / table[SPARE]['rejoin']:.1f}x "
          f"with a warm spare)")
    print_result("live recovery: survivors' lost time per failure (s)", table[LIVE]["lost"], table[RESTART]["lost"],
                 f"restart >= {TARGET:.0f}x live", ratio >= TARGET and equal[LIVE],
                 warm_start_ratio=warm_ratio, job_delay_live=table[LIVE]["delay"], job_delay_restart=table[RESTART]["delay"],
                 rejoin_live=table[LIVE]["rejoin"], rejoin_live_spare=table[SPARE]["rejoin"],
                 rejoin_restart=table[RESTART]["rejoin"])


if __name__ == "__main__":
    main()
