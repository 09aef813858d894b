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
of the restart >= 5x the live one.

When torchft imports (the optional extra ``trainguard[torchft]``), each cycle also runs torchft on the
same workload, fault-free and with the same kill (``torchft_run.py``, 4 replica groups x 1 rank), and a
second table puts one row per mode side by side: survivors' lost time, samples/s committed from the
kill to the replacement's first step, and the final parameters' largest relative difference from the
same system's fault-free run (ours: 0, bitwise equal; torchft: as measured).
A last table gives, computed from the layout (not measured), the gradient elements a rank receives per
step in the step's reduction: one row per micro-batch all-reduced (the whole replicas' ``ordered_sum``:
a ring all-reduce receives ``2 (W-1) / W`` of its ``micro_batches × P`` payload) against the sharded
groups' two exchanges (``group_reduce.elements_received``), fault-free and with one group lost, for the
drill's model and for a 1e9-parameter model on 8 groups × 8 ranks.
Usage: ``python benchmarks/live_recovery.py [--quick] [--cycles 2]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median, print_result  # noqa: E402
from torchft_run import (INSTALL_HINT, TorchftRun, clean_step_s, final_parameters, launch_torchft,  # noqa: E402
                         max_relative_difference, samples_per_s, torchft_available, torchft_figures)

from trainguard.events.log import read_events  # noqa: E402
from trainguard.live.compare import run_differences, whole_final_state  # noqa: E402
from trainguard.live.files import events_path  # noqa: E402
from trainguard.live.group_reduce import SlotLayout, elements_received  # noqa: E402
from trainguard.live.launcher import LIVE, RESTART, LiveRun, launch  # noqa: E402
from trainguard.live.workload import Workload  # noqa: E402

TARGET = 5.0
SPARE = "live+spare"  # live recovery whose replacement is a warm spare process (torch imported, waiting)
KILL_AT = 25
KILLED = 3
TORCHFT = "torchft"
SAMPLES_PER_STEP = Workload().samples_per_step


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
    degraded_steps = {e["step"] for e in _steps(events) if killed < e["time"] <= joined and e["rank"] != KILLED}
    return {"lost": resumed - killed + paused, "rejoin": joined - killed, "tail": _done(events) - killed,
            "samples_s": len(degraded_steps) * SAMPLES_PER_STEP / (joined - killed)}


def restart_figures(events: list[dict]) -> dict[str, float]:
    killed = _kill_time(events)
    after = [e for e in _steps(events) if e["time"] > killed]
    back = max(e["time"] for e in after if e["step"] == KILL_AT - 1)
    respawned = next(e["time"] for e in events if e["kind"] == "live_quorum" and e["reason"] == "restart")
    started = max(e["time"] for e in events if e["kind"] == "live_start" and e["time"] > killed)
    # every rank is down from the kill until the restarted ranks commit: no sample is committed meanwhile
    # a survivor may commit a step in the moment between the kill and the launcher killing it too: the
    # restarted ranks' first step is the first one after the respawn
    rejoined = min(e["time"] for e in after if e["time"] > respawned)
    return {"lost": back - killed, "lost_warm": back - killed - (started - respawned),
            "rejoin": rejoined - killed, "tail": _done(events) - killed, "samples_s": 0.0}


def clean_samples_s(events: list[dict]) -> float:
    """A fault-free run's committed samples per second, from its first step's end to its last's."""
    times = {}
    for e in _steps(events):
        times[e["step"]] = max(times.get(e["step"], 0.0), e["time"])
    return (len(times) - 1) * SAMPLES_PER_STEP / (max(times.values()) - min(times.values()))


def parameters_of(run: Path) -> dict:
    return whole_final_state(run, LiveRun().group_size)["model"]


def torchft_cycle(tmp: Path, cycle: int, args: argparse.Namespace) -> dict[str, float]:
    """One fault-free and one faulted torchft run (the order alternating per cycle), 4 groups x 1 rank."""
    clean = TorchftRun(steps=args.steps, micro_batch_s=args.micro_batch_s)
    failing = TorchftRun(steps=args.steps, micro_batch_s=args.micro_batch_s, kill_group=KILLED, kill_at=KILL_AT)
    dirs = {"clean": tmp / f"{cycle}_torchft_clean", "kill": tmp / f"{cycle}_torchft_kill"}
    killed_at = None
    for mode in (["clean", "kill"] if cycle % 2 == 0 else ["kill", "clean"]):
        killed = launch_torchft(dirs[mode], failing if mode == "kill" else clean)
        killed_at = killed if mode == "kill" else killed_at
    figures = torchft_figures(dirs["kill"], failing, killed_at, clean_step_s(dirs["clean"], clean.groups))
    figures["clean_samples_s"] = samples_per_s(dirs["clean"], clean.groups)
    figures["difference"] = max_relative_difference(final_parameters(dirs["clean"]), final_parameters(dirs["kill"]))
    return figures


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum at info
    cycles = 1 if args.quick else args.cycles
    with_torchft = torchft_available()
    base = LiveRun(steps=args.steps, micro_batch_s=args.micro_batch_s, checkpoint_every=10)
    failing = {**base.__dict__, "kill_ranks": (KILLED,), "kill_at_step": KILL_AT}
    rows: dict[str, list[dict[str, float]]] = {LIVE: [], SPARE: [], RESTART: [], TORCHFT: []}
    clean_rates: list[float] = []
    equal = {LIVE: True, SPARE: True, RESTART: True}
    difference = {LIVE: 0.0, SPARE: 0.0, RESTART: 0.0}
    with tempfile.TemporaryDirectory(prefix="live_bench_") as tmp:
        for cycle in range(cycles):
            order = ["clean", LIVE, SPARE, RESTART] if cycle % 2 == 0 else [RESTART, SPARE, LIVE, "clean"]
            dirs = {}
            for mode in order:
                dirs[mode] = Path(tmp) / f"{cycle}_{mode}"
                run = base if mode == "clean" else LiveRun(**{**failing, "recovery": RESTART if mode == RESTART else LIVE,
                                                               "spares": int(mode == SPARE)})
                launch(dirs[mode], run)
            clean_events = list(read_events(events_path(dirs["clean"])))
            tail = clean_tail(clean_events)
            clean_rates.append(clean_samples_s(clean_events))
            for mode, figures_of in ((LIVE, live_figures), (SPARE, live_figures), (RESTART, restart_figures)):
                figures = figures_of(list(read_events(events_path(dirs[mode]))))
                figures["delay"] = figures.pop("tail") - tail
                rows[mode].append(figures)
                equal[mode] &= run_differences(dirs["clean"], dirs[mode], base.world) == {}
                difference[mode] = max(difference[mode],
                                       max_relative_difference(parameters_of(dirs["clean"]), parameters_of(dirs[mode])))
            if with_torchft:
                rows[TORCHFT].append(torchft_cycle(Path(tmp), cycle, args))
    table = {mode: {key: median([r[key] for r in runs]) for key in runs[0]} for mode, runs in rows.items() if runs}
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
    print_torchft_table(table, median(clean_rates), difference)
    print_reduction_payload(sum(p.numel() for p in Workload().build()[0].parameters()), base)
    print_result("live recovery: survivors' lost time per failure (s)", table[LIVE]["lost"], table[RESTART]["lost"],
                 f"restart >= {TARGET:.0f}x live", ratio >= TARGET and equal[LIVE],
                 warm_start_ratio=warm_ratio, job_delay_live=table[LIVE]["delay"], job_delay_restart=table[RESTART]["delay"],
                 rejoin_live=table[LIVE]["rejoin"], rejoin_live_spare=table[SPARE]["rejoin"],
                 rejoin_restart=table[RESTART]["rejoin"])
    if TORCHFT in table:
        tf = table[TORCHFT]
        print_result("torchft: survivors' lost time per failure (s)", table[LIVE]["lost"], tf["lost"],
                     "trainguard live < torchft", table[LIVE]["lost"] < tf["lost"],
                     samples_s_degraded_live=table[LIVE]["samples_s"], samples_s_degraded_torchft=tf["samples_s"],
                     rejoin_live=table[LIVE]["rejoin"], rejoin_torchft=tf["rejoin"], torchft_layout="4 groups x 1")
        print_result("final parameters' max relative difference from the fault-free run, torchft vs trainguard live",
                     difference[LIVE], tf["difference"], "trainguard live 0 (bitwise)",
                     difference[LIVE] == 0.0 and equal[LIVE])


def print_reduction_payload(drill_parameters: int, drill: LiveRun) -> None:
    """Elements received per rank and step by the reduction, rows vs sharded (computed, see above)."""
    print("\nreduction: gradient elements a rank receives per step (computed from the layout, not measured)")
    print(f"{'model, layout':<34}{'rows (ring all-reduce)':>24}{'sharded, all groups':>21}{'sharded, 1 lost':>17}")
    cases = [(f"drill ({drill_parameters} params), {drill.groups} x {drill.group_size}, {drill.micro_batches} mb",
              drill_parameters, SlotLayout(drill.groups, drill.group_size, drill.micro_batches)),
             ("1e9 params, 8 x 8, 64 mb", 10 ** 9, SlotLayout(8, 8, 64))]
    for name, parameters, layout in cases:
        world, shard = layout.groups * layout.group_size, -(-parameters // layout.group_size)
        rows = 2 * (world - 1) * layout.micro_batches * (parameters + 1) // world
        every = list(range(layout.groups))
        print(f"{name:<34}{rows:>24,}{elements_received(layout, shard, every, 0):>21,}"
              f"{elements_received(layout, shard, every[:-1], 0):>17,}")


def print_torchft_table(table: dict[str, dict[str, float]], clean_rate: float, difference: dict[str, float]) -> None:
    """One row per mode: ours (2 groups x 2) and torchft (4 groups x 1, its DDP), the same workload and kill."""
    print(f"\nside by side with torchft: the same model, data, AdamW, {KILL_AT}-step kill; samples/s while "
          f"degraded: committed from the kill to the replacement's first step; difference: max over parameter "
          f"tensors of |a - b| / |b| against the same system's fault-free run")
    print(f"{'mode':<22}{'layout':<15}{'survivors lost s':>18}{'samples/s degraded':>20}{'max rel difference':>20}")
    print(f"{'fault-free (ours)':<22}{'2 groups x 2':<15}{'-':>18}{clean_rate:>20.1f}{'reference':>20}")
    if TORCHFT in table:
        print(f"{'fault-free (torchft)':<22}{'4 groups x 1':<15}{'-':>18}{table[TORCHFT]['clean_samples_s']:>20.1f}"
              f"{'reference':>20}")
    for mode, name in ((LIVE, "trainguard live"), (RESTART, "trainguard restart")):
        t = table[mode]
        print(f"{name:<22}{'2 groups x 2':<15}{t['lost']:>18.3f}{t['samples_s']:>20.1f}{difference[mode]:>20.3g}")
    if TORCHFT in table:
        t = table[TORCHFT]
        print(f"{'torchft':<22}{'4 groups x 1':<15}{t['lost']:>18.3f}{t['samples_s']:>20.1f}{t['difference']:>20.3g}")
    else:
        print(f"{'torchft':<22}{INSTALL_HINT}")


if __name__ == "__main__":
    main()
