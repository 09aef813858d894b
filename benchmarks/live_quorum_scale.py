"""Simulation: what live recovery's quorum protocol costs with 64, 256 and 1,024 replica groups.

    OMP_NUM_THREADS=1 python benchmarks/live_quorum_scale.py [--groups 64 256 1024] [--group-size 8]
        [--step-s 1.0] [--reduce-s 0.2] [--stubs 4] [--quick]

No model and no gloo: the launcher's real ``TCPStore`` (``serve_store``, on loopback), the run's values
sealed with a secret (``SignedStore``) and the real ``Lighthouse``; the ranks are stubs that write and
read the keys a rank of ``live/worker.py`` does. One replica group is one member of the simulated
quorum (``group_size`` 1 here: the lighthouse's cost grows with its members, and a real group of ``R``
ranks is ``R`` members; ``--group-size`` only scales the per-rank figures to GPUs). Measured, per size:

- ``pass``: one launcher-loop pass of the lighthouse (``hung()`` then ``poll()``) with every member's
  heartbeat, reduce mark and entered key in the store: its wall time and its store round trips.
- ``shrink``: a member dies (``died``): the time until the next epoch is published, while stub
  processes (``--stubs``) play the survivors: each watches the epoch's abort key and, once it is set,
  writes the reports of its share of the members (a real rank writes only its own, after its collective
  failed: the stubs' sweep is an optimistic bound on how fast the reports arrive).
- ``rejoin``: the replacement asks to join (``ready``) once every member has entered the new epoch: the
  time until the join epoch is published.
- ``store``: the round trips per second the one store serves to ``--stubs`` client processes.

And computed from the worker's code (``rank_ops``): the store round trips one rank makes per step, most
of them the abort polls of its all-reduce wait (``collective.POLL_S``), for a step of ``--step-s`` whose
all-reduce waits ``--reduce-s``; times every rank of the run, the load on the one store against what it
served here. A benchmark: nothing is asserted; the last lines are ``RESULT {...}`` for ``run_all``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_result  # noqa: E402

import torch.distributed as dist  # noqa: E402

from trainguard.events import EventLog  # noqa: E402
from trainguard.live.collective import POLL_S, abort_key  # noqa: E402
from trainguard.live.lighthouse import Lighthouse  # noqa: E402
from trainguard.live.quorum import (LATEST, STOP, beat_key, entered_key, progress_key,  # noqa: E402
                                    ready_key, report_key)
from trainguard.live.signed_store import SignedStore, serve_store  # noqa: E402
from trainguard.live.stall import OUT, reduce_key  # noqa: E402
from trainguard.live.worker import BEAT_S  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=120)


class CountingStore:
    """The raw store with its round trips counted (``SignedStore`` makes one per raw call)."""

    def __init__(self, raw: dist.TCPStore):
        self.raw, self.trips = raw, 0
        self.host, self.port, self.timeout = raw.host, raw.port, raw.timeout

    def set(self, key, value):
        self.trips += 1
        self.raw.set(key, value)

    def get(self, key):
        self.trips += 1
        return self.raw.get(key)

    def check(self, keys):
        self.trips += 1
        return self.raw.check(keys)


def rank_ops_per_step(step_s: float, reduce_s: float) -> float:
    """A rank's round trips per step, as ``LiveWorker.step`` makes them on a ``SignedStore`` (a read is a
    check, then a get when the key exists): its heartbeat (a set, at most every ``BEAT_S``), the newest
    epoch (check + get), the stop key (check), its reduce marks in and out (2 sets), the all-reduce's
    abort polls while it waits (a check every ``POLL_S``), its progress (a set)."""
    beats = max(1.0, step_s / BEAT_S)
    return beats + 2 + 1 + 2 + reduce_s / POLL_S + 1


def seed_members(store: SignedStore, members: int, epoch: int) -> None:
    """Every member as the lighthouse finds it mid-step: beating, entered, in the all-reduce of step 10."""
    for rank in range(members):
        store.set(beat_key(rank), "1")
        store.set(entered_key(rank), str(epoch))
        store.set(reduce_key(rank), f"{epoch} 10 {OUT}")
        store.set(progress_key(rank), "11")


def stub_survivors(port: int, secret: bytes, members: list[int], epoch: int, ready) -> None:
    """One stub process: once ``abort/<epoch>`` is set, reports its members' last step; then, once the
    next epoch is published, enters it for them (their ``entered`` keys)."""
    raw = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    store = SignedStore(raw, secret, TIMEOUT)
    ready.set()
    while not raw.check([abort_key(epoch)]):
        time.sleep(POLL_S)
    for rank in members:
        store.set(report_key(epoch, rank), "11")
    while store.get_int(LATEST, 0, 2 ** 31) != epoch + 1:
        time.sleep(POLL_S)
    for rank in members:
        store.set(entered_key(rank), str(epoch + 1))


def served_per_second(port: int, clients: int, seconds: float) -> float:
    """Round trips per second the store serves to ``clients`` processes checking a key in a loop."""
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        counts = pool.starmap(_hammer, [(port, seconds)] * clients)
    return sum(counts) / seconds


def _hammer(port: int, seconds: float) -> int:
    raw = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        raw.check([STOP])
        count += 1
    return count


def measure(members: int, stubs: int, passes: int, work: Path) -> dict:
    secret = secrets.token_bytes(32)
    raw = serve_store(HOST, TIMEOUT)
    counting = CountingStore(raw)
    store = SignedStore(counting, secret, TIMEOUT)
    events = EventLog(work / f"events_{members}.jsonl", rank=-1)
    lighthouse = Lighthouse(store, members, 1, events, hang_s=3600.0, stall_s=3600.0, stall_steps=1e9)
    seed_members(store, members, 0)
    times, trips = [], []
    for _ in range(passes):
        before, started = counting.trips, time.perf_counter()
        lighthouse.hung()
        lighthouse.poll()
        times.append(time.perf_counter() - started)
        trips.append(counting.trips - before)

    context = multiprocessing.get_context("spawn")
    survivors = list(range(1, members))
    shares = [survivors[i::stubs] for i in range(stubs)]
    readies = [context.Event() for _ in shares]
    procs = [context.Process(target=stub_survivors, args=(raw.port, secret, share, 0, ready))
             for share, ready in zip(shares, readies)]
    for proc in procs:
        proc.start()
    for ready in readies:
        ready.wait(120)
    started, shrink_passes = time.perf_counter(), 0
    lighthouse.died(0)
    while lighthouse.quorum.epoch == 0:
        lighthouse.hung()
        lighthouse.poll()
        shrink_passes += 1
    shrink_s = time.perf_counter() - started
    for proc in procs:
        proc.join(120)
    store.set(ready_key(0), "1")  # the replacement asks; every survivor has entered epoch 1
    started, join_passes = time.perf_counter(), 0
    while lighthouse.quorum.epoch == 1:
        lighthouse.hung()
        lighthouse.poll()
        join_passes += 1
    rejoin_s = time.perf_counter() - started
    served = served_per_second(raw.port, stubs, 2.0)
    return {"members": members, "pass_s": statistics.median(times), "pass_trips": statistics.median(trips),
            "shrink_s": shrink_s, "shrink_passes": shrink_passes, "rejoin_s": rejoin_s,
            "join_passes": join_passes, "served_per_s": served}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=None, help="quorum sizes (default 64 256 1024)")
    p.add_argument("--group-size", type=int, default=8, help="ranks per replica group, for the per-GPU figures (default 8)")
    p.add_argument("--step-s", type=float, default=1.0, help="a training step's time (default 1.0 s)")
    p.add_argument("--reduce-s", type=float, default=0.2, help="of it, the all-reduce's wait (default 0.2 s)")
    p.add_argument("--stubs", type=int, default=4, help="stub processes playing the survivors (default 4)")
    p.add_argument("--passes", type=int, default=9, help="lighthouse passes timed at steady state (default 9)")
    p.add_argument("--quick", action="store_true", help="16 and 64 groups")
    args = p.parse_args(argv)
    args.groups = args.groups or ([16, 64] if args.quick else [64, 256, 1024])
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    per_rank = rank_ops_per_step(args.step_s, args.reduce_s)
    rows = []
    with tempfile.TemporaryDirectory(prefix="quorum-scale-") as work:
        for members in args.groups:
            row = measure(members, args.stubs, args.passes, Path(work))
            rows.append(row)
            print(f"  {members} members: pass {1e3 * row['pass_s']:.1f} ms, shrink {row['shrink_s']:.2f} s, "
                  f"rejoin {row['rejoin_s']:.2f} s", flush=True)
    print(f"\nlive quorum protocol, simulated: real TCPStore + SignedStore + Lighthouse, stub ranks; "
          f"load average {os.getloadavg()[0]:.2f} (2 CPUs)\n")
    print("| members | lighthouse pass (ms) | round trips per pass | died -> next epoch (s) | passes | "
          "rejoin asked -> join epoch (s) | store served (round trips/s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['members']} | {1e3 * r['pass_s']:.1f} | {r['pass_trips']:.0f} | {r['shrink_s']:.2f} | "
              f"{r['shrink_passes']} | {r['rejoin_s']:.2f} | {r['served_per_s']:.0f} |")
    served = statistics.median(r["served_per_s"] for r in rows)
    print(f"\nper rank and step (a {args.step_s:g} s step whose all-reduce waits {args.reduce_s:g} s): "
          f"{per_rank:.0f} store round trips, {per_rank / args.step_s:.0f}/s; {args.reduce_s / POLL_S:.0f} of "
          f"them abort polls (every {1e3 * POLL_S:g} ms)")
    print("| ranks (groups x group size) | store round trips/s asked | of what one store served here |")
    print("|---:|---:|---:|")
    for ranks in sorted({m * args.group_size for m in args.groups} | {10_000}):
        asked = ranks * per_rank / args.step_s
        print(f"| {ranks} | {asked:.0f} | {asked / served:.1f}x |")
    for r in rows:
        print_result(f"live quorum: lighthouse pass at {r['members']} members (s)", r["pass_s"], args.step_s,
                     "reported (baseline: one training step)", True)
        print_result(f"live quorum: died -> next epoch at {r['members']} members (s)", r["shrink_s"],
                     r["pass_s"], "reported (baseline: one lighthouse pass)", True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
