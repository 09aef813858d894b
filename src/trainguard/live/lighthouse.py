"""The lighthouse: decides each epoch's quorum from the ranks' reports and the launcher's deaths.

It runs in the launcher's process (the one that outlives every rank and hosts the store), like
torchft's lighthouse. A replica group is the unit of membership (HSDP's replicate dimension): when
one of its ranks dies, the whole group leaves the quorum, and it comes back only when every one of its
ranks (the replacement and the group's survivors) has asked to join.

- Hang (a stopped process, a cut link): a member whose heartbeat counter (``beat/<rank>``, raised
  while it computes and while it waits) has not moved for ``hang_s`` is reported by :meth:`hung`; it
  is a death from then on. A member that has never beaten (stuck in its imports, its data or file
  system before it reached the store, stopped at its start) is hung once ``startup_s`` has passed since
  the lighthouse first looked at it: its peers would otherwise wait for its report for ever. A death is fenced by epoch (``fence/<rank>``): a process of that rank whose
  epoch is not newer stops at its next contact with the store instead of coming back (a node behind a
  cut link cannot be signalled; where the launcher can, it also SIGKILLs it).
- Stall (a partial cut: the peers unreachable, the store not): the current step's all-reduce entered
  and not left within the stall bound (``live/stall.py``); the lighthouse ends the epoch (with
  everyone in the all-reduce, it first asks the members to probe each other, ``live/probe.py``) and
  the replica groups it excludes leave the next one, to rejoin like a broken group. Nobody is fenced:
  their processes are alive and rejoin themselves. The next epoch does not wait for the excluded ranks'
  reports (a hung one never sends it), and a rank out of the quorum whose process lives on is still
  judged for a hang, so that a hung one is found, replaced, and its group can come back.
- A death out of the quorum (a rank of a group that is out) ends no epoch; a join request of the dead
  process is void, and its group comes back once the replacement has asked.
- Failure: once every live member of the current epoch has reported its last committed step (each
  does after its collective fails), the next epoch is the members of the intact groups, starting at
  the smallest step they committed.
- A second failure during a join: the joiners whose transfer did not finish report no state; their
  group leaves again with the dead rank's (and asks again), and the others carry on as in a failure.
- Join: once a whole broken group has asked and every member of the current epoch has built its group
  (``entered/<rank>``: a join published earlier, when a member then died, left the others building the
  older epoch's group, which nobody ended), the next epoch is everyone, with the group's ranks as
  joiners and the lowest survivor as the state's source; the survivors fix its first step (the
  boundary after their collective told them all about it).
- Restart (today's recovery, for the benchmark): every rank is started again, and the epoch resumes
  from the newest checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from trainguard.events import EventLog
from trainguard.live.collective import end_epoch
from trainguard.live.quorum import (LATEST, MAX_STEP, NO_STATE, Quorum, beat_key, done_key, entered_key, fence_key, has,
                                    publish, ready_key, report_key)
from trainguard.live.probe import probe_key, reachable_groups, read_reach
from trainguard.live.signed_store import SignedStore
from trainguard.live.stall import LOOKED_AWAY_S, StallWatch, excluded_groups

# how long a member may take to beat for the first time (start its interpreter, import torch, build its model,
# reach the store): restart mode's ``--startup-timeout`` default, the bound before an incarnation's first step
STARTUP_S = 600.0


class Lighthouse:
    def __init__(self, store: SignedStore, world: int, group_size: int, events: EventLog, hang_s: float,
                 stall_s: float, stall_steps: float, clock: Callable[[], float] = time.monotonic,
                 startup_s: float = STARTUP_S):
        """``clock``: seconds, monotonic (a test's own clock: the hang and stall verdicts depend on time alone)."""
        if world % group_size:
            raise ValueError(f"group_size={group_size} does not divide the world of {world} ranks")
        self.store, self.world, self.group_size, self.events = store, world, group_size, events
        self.dead: set[int] = set()  # members of the current epoch seen dead, until the epoch after them
        self.hang_s, self.startup_s, self.clock = hang_s, startup_s, clock
        self.stalls = StallWatch(store, stall_s, stall_steps, clock, silent_s=self._silent_s)
        # (step, excluded groups, or None: to decide from the members' probes) of the epoch ending
        self.stalled: tuple[int, list[int] | None] | None = None
        self.fenced: set[int] = set()  # ranks found hung, killed by the launcher
        # ranks whose replica group left the quorum while their own process lived on (a survivor of the
        # group, one a stall excluded): out of every epoch, yet judged for a hang, or their group never rejoins
        self.out_alive: set[int] = set()
        self.last_check = clock()
        self.beats: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when the lighthouse saw it move)
        self.asked = {rank: 0 for rank in range(world)}  # join requests already answered
        self.broken: set[int] = set()  # replica groups out of the quorum
        self.quorum = Quorum(0, list(range(world)), 0, "start")
        publish(store, self.quorum)
        self._emit(self.quorum)

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def died(self, rank: int) -> None:
        self.store.set(fence_key(rank), str(self.quorum.epoch))
        self.beats.pop(rank, None)  # its replacement is judged from its own first beat
        if rank in self.quorum.members:
            self.dead.add(rank)
            return
        # its group is out already: no epoch to end; a join request of the dead process is void (its
        # replacement asks anew, and the group comes back only once that one has asked)
        self.out_alive.discard(rank)
        self.asked[rank] = int(self.store.add(ready_key(rank), 0))

    def hung(self) -> list[int]:
        """Members of the current epoch, and ranks out of it alive (``out_alive``), that have beaten before
        and not for ``hang_s``, or never, for ``startup_s`` since this lighthouse first looked at them."""
        now, silent = self.clock(), []
        if now - self.last_check > LOOKED_AWAY_S:
            # this process was not scheduled for a while (a loaded machine): it saw nobody's beats in
            # that time, so it judges nobody on it and starts every member's window again
            self.beats = {rank: (count, now) for rank, (count, _) in self.beats.items()}
        self.last_check = now
        for rank in sorted(set(self.quorum.members) | self.out_alive):
            if rank in self.dead or has(self.store, done_key(rank)):
                continue
            count = int(self.store.add(beat_key(rank), 0))
            seen, since = self.beats.setdefault(rank, (0, now))  # first looked at: its start-up window opens
            if count != seen:
                self.beats[rank] = (count, now)
            elif now - since > (self.hang_s if count else self.startup_s):
                silent.append(rank)
        for rank in silent:
            self.fenced.add(rank)
            self.events.emit("live_hung", step=None, target=rank, silent_s=now - self.beats[rank][1])
            self.beats.pop(rank)
        return silent

    def poll(self, watch: bool = True) -> None:
        """Answers the members' reports (a new quorum once every live member has reported); with ``watch``,
        also looks for a stalled all-reduce and for broken groups ready to rejoin: things of seconds, which
        the launcher looks for less often than it answers reports (``launcher.WATCH_EVERY_S``)."""
        quorum = self.quorum
        if self.store.get_int(LATEST, 0, MAX_STEP) != quorum.epoch:
            # overwritten by a client without the secret (garbage, or an older sealed value of ours written
            # again): every rank reads it at every step, and waits on a foreign one; restored at this look
            publish(self.store, quorum)
        # a report that is not a step (foreign, garbage) is ignored: logged once by the store, never a crash
        reports = {r: self.store.get_int(report_key(quorum.epoch, r), NO_STATE, MAX_STEP) for r in quorum.members}
        reported = {r: step for r, step in reports.items() if step is not None}
        failed = self.dead & set(quorum.members)
        if failed:
            end_epoch(self.store, quorum.epoch)  # wakes the members blocked in a collective
        if failed or reported:
            if set(quorum.members) - self.dead - self._excluded_by_stall() <= set(reported):
                self._shrink(failed, reported)
            return
        if not watch or (self.stalled is None and self._stall(quorum)):
            return
        for group in sorted(self.broken):
            ranks = self.ranks_of(group)
            if all(int(self.store.add(ready_key(r), 0)) > self.asked[r] for r in ranks) and self._entered(quorum):
                self._join(group, ranks)
                return

    def _entered(self, quorum: Quorum) -> bool:
        """Whether every member of ``quorum`` that has not finished has built its process group."""
        def entered(rank: int) -> bool:
            entered_epoch = self.store.get_int(entered_key(rank), 0, MAX_STEP)
            return entered_epoch is not None and entered_epoch >= quorum.epoch

        return all(entered(r) or has(self.store, done_key(r)) for r in quorum.members)

    def restart(self, resume_from: int | None) -> Quorum:
        """Every rank starts again; the new epoch resumes from ``resume_from`` (None: from scratch)."""
        self.dead.clear()
        self.quorum = Quorum(self.quorum.epoch + 1, list(range(self.world)), resume_from or 0, "restart",
                             resume_from=resume_from)
        publish(self.store, self.quorum)
        self._emit(self.quorum)
        return self.quorum

    def _silent_s(self, rank: int) -> float:
        """How long ``rank``'s heartbeat has not moved, as ``hung`` last saw it (0 before its first beat)."""
        count, since = self.beats.get(rank, (0, 0.0))
        return self.clock() - since if count else 0.0

    def _excluded_by_stall(self) -> set[int]:
        """The ranks a stall verdict has already sent out of the next epoch: the epoch need not wait for
        their reports (a hung one never sends it; waiting would cost the survivors ``hang_s``)."""
        excluded = self.stalled[1] if self.stalled is not None else None
        return {rank for group in excluded or [] for rank in self.ranks_of(group)}

    def _stall(self, quorum: Quorum) -> bool:
        """Ends the epoch if its all-reduce stalled and some replica groups can be excluded."""
        alive = [r for r in quorum.members if not has(self.store, done_key(r))]
        stall = self.stalls.look(quorum, alive)
        if stall is None:
            return False
        several = len({self.group_of(r) for r in quorum.members}) > 1
        # a member in the all-reduce (or the save) beats while it waits there: one silent for half the stall
        # floor (``stall.silent``, the watch's) is not running (stopped, hung) and counts as absent, so that its
        # group is excluded without the probes, whose verdict would wait for its report (it never sends one)
        # until ``hang_s``
        silent = stall.silent
        absent = sorted([*stall.absent, *silent])
        # absent members: their groups; everyone in: the probes decide (None); one group: nobody
        excluded = excluded_groups(quorum.members, absent, self.group_of) if absent else \
            (None if several else [])
        self.events.emit("live_stall", step=stall.step, epoch=quorum.epoch, waiting=stall.waiting,
                         absent=stall.absent, silent=silent, waited_s=stall.waited_s, bound_s=stall.bound_s,
                         saving=stall.saving,
                         excluded=None if excluded is None else [r for g in excluded for r in self.ranks_of(g)])
        if excluded == []:  # it would be every group: left to gloo's collective timeout
            return False
        if excluded is None:
            self.store.set(probe_key(quorum.epoch), "1")  # before the abort: whoever sees one sees both
        self.stalled = (stall.step, excluded)
        end_epoch(self.store, quorum.epoch)
        return True

    def _shrink(self, failed: set[int], reported: dict[int, int]) -> None:
        stalled_step, excluded = self.stalled or (None, [])
        self.stalled = None
        if excluded is None:
            reach = read_reach(self.store, self.quorum.epoch, self.quorum.members)
            excluded = reachable_groups(self.quorum.members, reach, self.group_of)
            self.events.emit("live_reach", step=stalled_step, epoch=self.quorum.epoch,
                             reach={str(r): sorted(peers) for r, peers in sorted(reach.items())},
                             excluded=[r for g in excluded for r in self.ranks_of(g)])
        # a joiner whose state transfer did not finish (a second failure during the join) holds no state
        # its group could step from: the group leaves again and asks again
        no_state = {self.group_of(r) for r, step in reported.items() if step == NO_STATE}
        broken = {self.group_of(r) for r in failed} | set(excluded) | no_state
        self.broken |= broken
        self.out_alive |= {r for r in self.quorum.members if self.group_of(r) in broken} - failed
        members = [r for r in self.quorum.members if self.group_of(r) not in self.broken]
        if not members:
            raise RuntimeError(f"live recovery: no replica group is left intact after ranks {sorted(failed)} died")
        self.dead -= failed
        hung = sorted(failed & self.fenced)
        if failed:
            reason = f"ranks {sorted(failed)} died" + (f" (hung, fenced: {hung})" if hung else "")
        elif stalled_step is not None:
            reason = f"the all-reduce of step {stalled_step} stalled (replica groups {excluded} excluded)"
        else:
            reason = "a collective failed"
        self.quorum = Quorum(self.quorum.epoch + 1, members, min(reported[r] for r in members), reason)
        publish(self.store, self.quorum)
        self._emit(self.quorum, left=sorted(r for g in broken for r in self.ranks_of(g)))

    def _join(self, group: int, ranks: list[int]) -> None:
        self.broken.discard(group)
        self.out_alive -= set(ranks)
        for rank in ranks:
            self.asked[rank] += 1
            self.beats.pop(rank, None)  # judged from its next beat, not from before it waited to join
        members = sorted(set(self.quorum.members) | set(ranks))
        self.quorum = Quorum(self.quorum.epoch + 1, members, None, f"replica group {group} rejoins",
                             joining=ranks, source=self.quorum.members[0])
        publish(self.store, self.quorum)
        self._emit(self.quorum)

    def _emit(self, quorum: Quorum, left: list[int] | None = None) -> None:
        self.events.emit("live_quorum", step=quorum.start_step, epoch=quorum.epoch, members=quorum.members,
                         joining=quorum.joining, left=left or [], reason=quorum.reason)
