"""Replica fingerprints on a live step (``guards.fingerprint``, docs/sdc.md): corrupted parameters or
optimizer state found by comparing replicas, and repaired from one, without a restart.

The replicas of a shard (``shards``: the ranks at the same place of each replica group) hold bitwise
the same parameters and optimizer state after every step. Before a step that is due (every
``interval`` steps, every step with ``at_rest: every_step``) each member hashes its whole state
(``guards.fingerprint.fingerprints`` of its parameters and optimizer state, folded into one digest) and
says whether that state changed since its own hash right after the last update (memory that changed at
rest); one all-reduce of one slot per member gives every member every digest, so every member judges
alike (``compare_replicas``, the closure mode's rule: the majority, or the replica that changed at rest
against one that did not). An attributed replica is repaired by one broadcast of an agreeing replica's
state (``transfer.repair_from``), before the step computes anything with it, and struck as the closure
mode strikes it (with ``guards.sdc`` on: ``LiveSdc.strike``, at the time of the quorum's first member,
carried in the same all-reduce, so the book stays every member's alike; a rank that reaches
``guards.sdc.strikes`` leaves as an SDC-struck one does, ``LiveSdc.leave_if_struck_out``). A
disagreement nothing attributes (two replicas, neither changed at rest: the corruption entered an
update) asks for a recompute (``recompute``), as the closure mode's: each member keeps a host copy of
its tensors that hash apart from a replica's (one more all-reduce, of every tensor's hash, only then),
the worker restores the newest healthy durable checkpoint through the quorum whose restored state every
member finds hashing as the state that save held (``restored_agrees``; one that does not is passed over
for an older one, ``guards.fingerprint.restore_agreeing``) and recomputes the steps since. At the check
step the recompute reached again, each member's distance from its copies to the recomputed tensors names
the replica whose first computation went wrong (``guards.fingerprint.attribute_by_recompute``; one more
all-reduce), struck as above; a second mismatch there is left as it is (the closure mode's rule). Before
each durable save the same comparison runs again (``before_save``, the closure mode's
``StateGuard.before_save``), and the save's health says what it left unrepaired.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.guards.fingerprint import (FingerprintConfig, FingerprintVerdict, Mismatch, attribute_by_recompute,
                                          compare_replicas, distance, fingerprints, log_recompute)
from trainguard.guards.step_plugin import Restored
from trainguard.guards.state_health import NamedTensors, local_state, nonfinite_state, state_save_health
from trainguard.live.quorum import Quorum
from trainguard.live.sdc import LiveSdc
from trainguard.live.shards import shard_of
from trainguard.live.state import LiveState
from trainguard.live.transfer import repair_from

STATE = "state"  # the one "tensor" a live check compares: a member's whole state, folded into one digest
# a member's row in a comparison's all-reduce: its digest (2), whether it changed at rest, its count of NaN/Inf
# tensors, the reporter's clock, whether it went back to reach this check step again, whether its restore for
# a recompute failed part-way, its count of tensors
MOVED, NONFINITE, CLOCK, RECOMPUTING, RESTORING, COUNT = range(2, 8)


def digest(named: NamedTensors) -> torch.Tensor:
    """``[2]`` int64: the hashes of every tensor of ``named`` (a rank's parameters and optimizer state,
    ``local_state``), the second weighted by the tensor's place (int64 sums wrap alike everywhere)."""
    hashes = fingerprints(named)
    places = torch.arange(1, hashes.shape[0] + 1, dtype=torch.int64)
    return torch.stack([hashes[:, 0].sum(), (hashes[:, 1] * places).sum()])


class LiveFingerprints:
    def __init__(self, config: FingerprintConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: LiveState, rank: int, group_size: int, log: logging.Logger, events: EventLog,
                 reports: Callable[[], bool], sdc: LiveSdc | None = None):
        config.validate()
        self.interval, self.every_step = config.interval, config.at_rest == "every_step"
        self.model, self.optimizer, self.state = model, optimizer, state
        self.rank, self.group_size = rank, group_size
        self.log, self.events, self.reports = log, events, reports
        self.after_update: tuple[int, torch.Tensor] | None = None  # (the step it is for, this rank's digest)
        # the strike book (guards.sdc on; off, as in the closure mode, an attributed replica is repaired only)
        self.sdc = sdc
        # the ranks a comparison found at their strike limit, every member's alike, until ``take_struck_out``
        self.struck_out: tuple[int, ...] = ()
        # the check step a recompute went back to reach again: a mismatch found there again is not recomputed
        self.recomputing_to: int | None = None
        # host copies of this rank's tensors that hashed apart from a replica's where a recompute was asked, by
        # their place in ``local_state``: measured against the recomputed ones at that check step again
        self.before_recompute: dict[int, torch.Tensor] = {}
        # this rank's digest of the state each durable save held, by the save's step: ``restored_agrees``; only
        # the saves a restore can still load (``keep_saved``)
        self.saved: dict[int, torch.Tensor] = {}
        self.recompute = False  # the last check found what no replica can repair, and a recompute is due
        # from the recompute's ask to its restore's end: set at the next check, that restore failed part-way
        # (a member's load raised, a member died) and this rank's state may be partly the checkpoint's
        self.restoring = False
        # the recompute's restore, as a rollback's (the closure mode's ``StatePlugin``): no step's figures
        self.restored: Restored | None = None

    def due(self, step: int) -> bool:
        """A check before ``step`` (the closure mode's number)."""
        return self.interval > 0 and (self.every_step or step % self.interval == 0)

    def remember(self, step: int) -> None:
        """Right after an update (or a skipped step): the digest the check before ``step`` compares with,
        if one is due; a state loaded meanwhile (an undo, a join) is checked against no such digest."""
        self.after_update = (step, digest(local_state(self.model, self.optimizer))) if self.due(step) else None

    def check(self, group: dist.ProcessGroup, quorum: Quorum, step: int,
              wait: Callable[[dist.Work], None]) -> FingerprintVerdict:
        """Compares every shard's replicas before ``step``, repairs and strikes what is attributed, and says
        in ``recompute`` whether what nothing repaired asks for a recompute (then keeps its copies of the
        tensors that disagree); at the check step a recompute reached again, first attributes by the
        recompute. Every member alike."""
        named = local_state(self.model, self.optimizer)
        mine = digest(named)
        moved = self.after_update is not None and self.after_update[0] == step and \
            not torch.equal(self.after_update[1], mine)
        mismatches, rows = self._compare(group, quorum, step, wait, mine, moved, 0, len(named),
                                         self.recomputing_to == step)
        restoring = sorted(member for member, row in rows.items() if row[RESTORING])
        if restoring:  # no state to compare: every member restores again (the copies kept for the attribution)
            self.log.warning("fingerprint check at step %d: the restore for a recompute failed part-way (rank(s) %s "
                             "mid-restore): restoring again", step, restoring)
            self.recompute = self.restoring = True
            return FingerprintVerdict()
        width = max(row[COUNT] for row in rows.values())
        # any member's (one that joined since went back to nothing): every member asks for a recompute alike
        recomputed = any(row[RECOMPUTING] for row in rows.values())
        if recomputed:
            self._attribute_by_recompute(group, quorum, step, wait, width, agreed_time(rows))
            self.recomputing_to = None
        verdict = FingerprintVerdict(tuple(mismatch for _, mismatch in mismatches))
        self.recompute = not recomputed and not verdict.repairable
        if self.recompute:  # kept through the checks of the steps recomputed, to the attribution
            self.before_recompute = self._disagreeing(group, quorum, wait, width)
            self.restoring = True
        return verdict

    def restored_agrees(self, group: dist.ProcessGroup, quorum: Quorum, step: int,
                        wait: Callable[[dist.Work], None]) -> bool:
        """Whether the state just restored from the durable checkpoint of ``step`` committed steps hashes, on
        every member, as the state that save held did when its check hashed it, right after the step's update
        (a member that hashed no such save, one that joined since, agrees): memory changed before the save's
        copy was made is in the checkpoint, and a recompute from it would keep it. One all-reduce."""
        saved = self.saved.get(step)
        disagrees = saved is not None and not torch.equal(saved, digest(local_state(self.model, self.optimizer)))
        flags = torch.tensor([int(disagrees)], dtype=torch.int64)
        wait(group.allreduce([flags]))
        return not flags.item()

    def keep_saved(self, restorable: Collection[int]) -> None:
        """Forgets the digests of the durable saves no restore can load any more: those whose steps are not in
        ``restorable`` (``LiveCheckpoints.restorable``: retention deleted them, or a roll back did, or the
        save failed). ``restored_agrees`` is only asked about a checkpoint a restore loaded, so it finds
        every digest it can be asked for, and the table stays as long as the durable tier's list."""
        self.saved = {step: saved for step, saved in self.saved.items() if step in restorable}

    def recomputing_from(self, step: int, restored: int | None) -> None:
        """The worker's answer to ``recompute`` at the check before ``step``: the quorum restored the newest
        healthy durable checkpoint, of ``restored`` committed steps (None: there was none, the mismatch
        stays and every durable save that holds it is marked unhealthy); the closure mode's lines and event."""
        self.recompute = self.restoring = False
        log_recompute(self.log, step, restored)
        if restored is None:
            self.before_recompute = {}
            return
        self.recomputing_to = step
        self.restored = Restored(restored, math.nan, math.nan)
        if self.reports():
            self.events.emit("fingerprint_recompute", step=step, to_step=restored)

    def take_struck_out(self) -> tuple[int, ...]:
        """The ranks the comparisons since the last call found at their strike limit (every member's alike)."""
        struck_out, self.struck_out = self.struck_out, ()
        return struck_out

    def before_save(self, group: dist.ProcessGroup, quorum: Quorum, step: int, wait: Callable[[dist.Work], None],
                    health: dict[str, Any] | None) -> dict[str, Any] | None:
        """Before a durable save of ``step`` committed steps, as the closure mode's ``StateGuard.before_save``:
        the replicas compared (no at-rest reference: the majority attributes), an attributed replica repaired,
        and the save's health, ``health`` merged with the state's (a NaN/Inf in any member's state, replicas
        that disagree unrepaired); one all-reduce, every member's verdict alike. Collective."""
        named = local_state(self.model, self.optimizer)
        bad = nonfinite_state(named)
        mine = digest(named)
        mismatches, rows = self._compare(group, quorum, step, wait, mine, False, len(bad), len(named), False)
        repaired = {rank for _, mismatch in mismatches if mismatch.source is not None for rank in mismatch.faulty}
        if repaired:
            self.remember(step + 1)  # the next check's reference is the repaired state, not the corrupt one
        # what this save holds of this rank (its source's state when it was repaired), for ``restored_agrees``
        self.saved[step] = digest(local_state(self.model, self.optimizer)) if self.rank in repaired else mine
        # a repaired member's state is now its source's, whose NaN/Inf its own row counts
        nonfinite = sum(rows[member][3] for member in quorum.members if member not in repaired)
        unrepaired = sum(len(replicas) for replicas, mismatch in mismatches if mismatch.source is None)
        return state_save_health(health, nonfinite, [] if self.rank in repaired else bad, unrepaired, unrepaired,
                                 step, self.log)

    def _compare(self, group: dist.ProcessGroup, quorum: Quorum, step: int, wait: Callable[[dist.Work], None],
                 mine: torch.Tensor, moved: bool, nonfinite: int, count: int,
                 recomputing: bool) -> tuple[list[tuple[list[int], Mismatch]], dict[int, list[int]]]:
        """Every shard's replicas compared (this rank's ``mine`` digest, whether it ``moved`` at rest), what is
        attributed repaired and struck, the mismatches logged and reported; with every member's row (digest,
        moved, its count of ``nonfinite`` tensors, the reporter's clock, whether it is ``recomputing`` to this
        step, whether it is mid-restore, the ``count`` of its tensors). Nothing compared while a member is
        mid-restore (a state partly restored is no step's: it would be struck as changed at rest)."""
        slots = torch.zeros(len(quorum.members), COUNT + 1, dtype=torch.int64)
        clock = int(time.time()) if self.reports() else 0  # the strikes' agreed time: the quorum's first member's
        slots[quorum.index(self.rank)] = torch.cat([mine, torch.tensor([int(moved), nonfinite, clock,
                                                                        int(recomputing), int(self.restoring),
                                                                        count])])
        wait(group.allreduce([slots]))  # one member's slot added to zeros: exact
        rows = dict(zip(quorum.members, slots.tolist()))
        mismatches: list[tuple[list[int], Mismatch]] = []
        if any(row[RESTORING] for row in rows.values()):
            return mismatches, rows
        for shard in range(self.group_size):
            replicas = self._replicas(quorum, shard)
            verdict = compare_replicas([STATE], {r: [(rows[r][0], rows[r][1])] for r in replicas},
                                       {r: [bool(rows[r][MOVED])] for r in replicas})
            mismatches.extend((replicas, mismatch) for mismatch in verdict.mismatches)
        for replicas, mismatch in mismatches:
            if mismatch.source is not None:
                repair_from(group, quorum, self.rank, mismatch.source, mismatch.faulty, self.state, wait)
            self._report(step, replicas, mismatch,
                         f", repaired from rank {mismatch.source}" if mismatch.source is not None else "")
        # after the repairs: a repaired rank's guards' state is its source's
        self._strike(step, [mismatch for _, mismatch in mismatches], agreed_time(rows))
        return mismatches, rows

    def _disagreeing(self, group: dist.ProcessGroup, quorum: Quorum, wait: Callable[[dist.Work], None],
                     width: int) -> dict[int, torch.Tensor]:
        """Where a recompute is asked: host copies of this rank's tensors whose hash differs from a replica's
        (by their place), from every member's hash of each of its tensors (``width``: the most any member
        holds), in one all-reduce."""
        named = local_state(self.model, self.optimizer)  # after the check's repairs
        slots = torch.zeros(len(quorum.members), width, 2, dtype=torch.int64)
        slots[quorum.index(self.rank), :len(named)] = fingerprints(named)
        wait(group.allreduce([slots]))
        hashes = dict(zip(quorum.members, slots))
        replicas = self._replicas(quorum, shard_of(self.rank, self.group_size))
        return {place: tensor.detach().to("cpu", copy=True) for place, (_, tensor) in enumerate(named)
                if any(not torch.equal(hashes[replica][place], hashes[self.rank][place]) for replica in replicas)}

    def _attribute_by_recompute(self, group: dist.ProcessGroup, quorum: Quorum, step: int,
                                wait: Callable[[dist.Work], None], width: int, now: float) -> None:
        """At the check step a recompute reached again, the closure mode's attribution by recompute
        (``ReplicaFingerprints.check_recompute``): each member's distance from its copies to the recomputed
        tensors, in one all-reduce (a member with no copies, one that joined since or whose replicas agreed,
        takes no part), each shard's replicas' compared (``attribute_by_recompute``; a shard left with one
        replica that has copies has nothing to compare it with); a rank attributed is struck (the recompute
        replaced its state: nothing to repair)."""
        named = local_state(self.model, self.optimizer)
        slots = torch.zeros(len(quorum.members), width + 1, dtype=torch.float64)
        if self.before_recompute:
            row = slots[quorum.index(self.rank)]
            row[0] = 1
            for place, before in self.before_recompute.items():
                row[1 + place] = distance(named[place][1], before)
        wait(group.allreduce([slots]))
        self.before_recompute = {}  # measured (an epoch that fails first leaves them for the step tried again)
        rows = dict(zip(quorum.members, slots.tolist()))
        # every rank holds every parameter (whole or its rows): the names of its state are every member's
        names = [name for name, _ in named] + [f"tensor {place}" for place in range(len(named), width)]
        attributed = []
        for shard in range(self.group_size):
            replicas = [member for member in self._replicas(quorum, shard) if rows[member][0]]
            if len(replicas) < 2:
                continue
            verdict = attribute_by_recompute(names, {member: rows[member][1:] for member in replicas})
            for mismatch in verdict.mismatches:
                self._report(step, replicas, mismatch, ", repaired by the recompute" if mismatch.faulty else "")
            attributed.extend(verdict.mismatches)
        self._strike(step, attributed, now)

    def _replicas(self, quorum: Quorum, shard: int) -> list[int]:
        """The members holding ``shard``."""
        return [member for member in quorum.members if shard_of(member, self.group_size) == shard]

    def _report(self, step: int, replicas: list[int], mismatch: Mismatch, repaired: str) -> None:
        """A mismatch's line (``repaired``: how it was, or nothing) and, by the reporter, its event."""
        self.log.error("fingerprint mismatch: step %d, replica group %s, tensor %s: %s%s", step, replicas,
                       mismatch.tensor, f"rank(s) {list(mismatch.faulty)} corrupt ({mismatch.how})" if mismatch.faulty
                       else "unattributed (the replicas disagree, none changed at rest)", repaired)
        if self.reports():
            self.events.emit("fingerprint_mismatch", step=step, group=replicas, tensors=[mismatch.tensor],
                             faulty=list(mismatch.faulty), how=[mismatch.how],
                             repaired=[mismatch.tensor] if repaired else [])

    def _strike(self, step: int, mismatches: list[Mismatch], now: float) -> None:
        """One strike against each rank ``mismatches`` attribute, its tensors the strike's points (``guards.sdc``
        on; the closure mode's one per rank and check), at the agreed time ``now``; the ranks at their limit
        kept for ``take_struck_out``."""
        if self.sdc is None:
            return
        attributed: dict[int, list[Mismatch]] = {}
        for mismatch in mismatches:
            for rank in mismatch.faulty:
                attributed.setdefault(rank, []).append(mismatch)
        for rank, found in attributed.items():
            hows = ", ".join(sorted({mismatch.how for mismatch in found}))
            if self.sdc.strike(rank, step, {"kind": "fingerprint", "points": [mismatch.tensor for mismatch in found]},
                               now, f"fingerprint mismatch ({hows})"):
                self.struck_out = tuple(sorted({*self.struck_out, rank}))


def agreed_time(rows: dict[int, list[int]]) -> float:
    """The reporter's clock, from the comparison's rows: the strikes' time, every member's alike."""
    return float(sum(row[CLOCK] for row in rows.values()))
