"""``trainguard demo --live``: a rank dies mid-run and the job never restarts.

4 gloo ranks (2 replica groups × 2) train the live drill's workload (``trainguard.live``) twice: once
without a fault, once with rank 3 SIGKILLed after step 10. The drill passes when the survivors kept
their processes, the replacement rejoined, every rank's final parameters and optimizer state equal the
fault-free run's bit for bit, and the events show every sample of every step used exactly once. It
writes the failed run's ``report.html`` (its quorum changes).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainguard.events import read_events
from trainguard.live.compare import replica_differences, run_differences
from trainguard.live.files import events_path
from trainguard.live.launcher import LiveRun, launch, start_live_rank_server
from trainguard.live.samples import sample_problems
from trainguard.live.workload import Workload
from trainguard.report import write_report

# one warm spare (torch imported, waiting): the dead rank's replacement is ready in milliseconds, so it
# rejoins while the survivors are still stepping, not at the last step
FAILING = LiveRun(groups=2, group_size=2, steps=40, micro_batch_s=0.02, kill_ranks=(3,), kill_at_step=10, spares=1)


def pids_by_rank(run_dir: Path) -> dict[int, list[int]]:
    """Each rank's processes, in the order they started (from the ``live_start`` events)."""
    pids: dict[int, list[int]] = defaultdict(list)
    for event in read_events(events_path(run_dir), kind="live_start"):
        pids[event["rank"]].append(event["pid"])
    return dict(pids)


def live_checks(clean: Path, failed: Path, run: LiveRun) -> list[tuple[str, bool, str]]:
    """(what, passed, detail) for each claim of the drill."""
    pids = pids_by_rank(failed)
    survivors = [r for r in range(run.world) if r not in run.kill_ranks]
    kept = all(len(pids.get(r, [])) == 1 for r in survivors)
    replaced = all(len(set(pids.get(r, []))) == 2 for r in run.kill_ranks)
    events = list(read_events(events_path(failed)))
    joined = sorted(e["rank"] for e in events if e["kind"] == "live_joined")
    differences = [f"rank {r}: {d}" for r, where in run_differences(clean, failed, run.world).items() for d in where]
    replicas = [f"rank {r}: {d}" for r, where in replica_differences(failed, run.world, run.group_size).items()
                for d in where]
    samples = sample_problems(events, run.steps, Workload(micro_batches=run.micro_batches).samples_per_step)
    return [
        ("survivors never restarted", kept, f"pids {[pids.get(r) for r in survivors]}"),
        ("the killed ranks were replaced and rejoined", replaced and set(run.kill_ranks) <= set(joined),
         f"pids {[pids.get(r) for r in run.kill_ranks]}, joined: ranks {joined}"),
        ("final parameters and optimizer state bitwise equal to the fault-free run", not differences,
         "; ".join(differences[:3]) or f"{run.world} ranks compared"),
        ("the replicas of each shard hold the same state", not replicas,
         "; ".join(replicas[:3]) or f"{run.groups} replica groups × {run.group_size} shards compared"),
        ("no sample lost or repeated", not samples, "; ".join(samples[:3]) or f"{run.steps} steps checked"),
    ]


def run_live_drill(out: Path, console: Console | None = None) -> int:
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    console.print(f"[bold]trainguard live-recovery drill[/] → {out}")
    console.print(f"{FAILING.groups} replica groups × {FAILING.group_size} ranks (gloo) and {FAILING.spares} warm spare, "
                  f"{FAILING.steps} steps; "
                  f"SIGKILL of rank {FAILING.kill_ranks[0]} after step {FAILING.kill_at_step}, no job restart")
    start_live_rank_server()  # before the spinner's thread: the ranks are forked, not new interpreters
    with console.status("fault-free run"):
        launch(out / "clean", dataclasses.replace(FAILING, kill_ranks=(), spares=0))
    with console.status("run with the SIGKILL"):
        launch(out / "failed", FAILING)
    report, facts = write_report(out / "failed")
    quorums = Table(title="quorum changes")
    for column in ("epoch", "from step", "members", "left", "joining", "survivors lost", "time to rejoin"):
        quorums.add_column(column)
    for q in facts.quorum_changes:
        quorums.add_row(str(q.epoch), str(q.step), str(q.members), str(q.left or ""), str(q.joining or ""),
                        "" if q.survivors_lost_s is None else f"{q.survivors_lost_s:.3f} s",
                        "" if q.rejoin_s is None else f"{q.rejoin_s:.2f} s")
    console.print(quorums)
    checks = live_checks(out / "clean", out / "failed", FAILING)
    table = Table(title="live-recovery drill")
    for column in ("claim", "held", "detail"):
        table.add_column(column)
    for what, held, detail in checks:
        table.add_row(what, "yes" if held else "NO", detail, style=None if held else "red")
    console.print(table)
    console.print(f"report: {report}; total {time.monotonic() - started:.0f} s")
    passed = all(held for _, held, _ in checks)
    console.print("live drill passed" if passed else "[red]live drill failed[/]")
    return 0 if passed else 1
