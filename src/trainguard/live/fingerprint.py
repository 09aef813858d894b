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
update) asks for a recompute (``recompute``): the worker restores the newest healthy durable checkpoint
through the quorum and recomputes the steps since; a second one at the check step the recompute reached
again is left as it is (the closure mode's rule). Before each durable save the same comparison runs
again (``before_save``, the closure mode's ``StateGuard.before_save``), and the save's health says what
it left unrepaired.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.guards.fingerprint import (FingerprintConfig, FingerprintVerdict, Mismatch, compare_replicas, fingerprints,
                                          log_recompute)
from trainguard.guards.step_plugin import Restored
from trainguard.guards.state_health import NamedTensors, local_state, nonfinite_state, state_save_health
from trainguard.live.quorum import Quorum
from trainguard.live.sdc import LiveSdc
from trainguard.live.shards import shard_of
from trainguard.live.state import LiveState
from trainguard.live.transfer import repair_from

STATE = "state"  # the one "tensor" a live check compares: a member's whole state, folded into one digest


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
        self.recompute = False  # the last check found what no replica can repair, and a recompute is due
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
        in ``recompute`` whether what nothing repaired asks for a recompute; every member alike."""
        mine = digest(local_state(self.model, self.optimizer))
        moved = self.after_update is not None and self.after_update[0] == step and \
            not torch.equal(self.after_update[1], mine)
        mismatches, _ = self._compare(group, quorum, step, wait, mine, moved, 0)
        verdict = FingerprintVerdict(tuple(mismatch for _, mismatch in mismatches))
        recomputed = self.recomputing_to == step
        if recomputed:
            self.recomputing_to = None
        self.recompute = not recomputed and not verdict.repairable
        return verdict

    def recomputing_from(self, step: int, restored: int | None) -> None:
        """The worker's answer to ``recompute`` at the check before ``step``: the quorum restored the newest
        healthy durable checkpoint, of ``restored`` committed steps (None: there was none, the mismatch
        stays and every durable save that holds it is marked unhealthy); the closure mode's lines and event."""
        self.recompute = False
        log_recompute(self.log, step, restored)
        if restored is None:
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
        mismatches, rows = self._compare(group, quorum, step, wait, digest(named), False,
                                         len(bad))
        repaired = {rank for _, mismatch in mismatches if mismatch.source is not None for rank in mismatch.faulty}
        if repaired:
            self.remember(step + 1)  # the next check's reference is the repaired state, not the corrupt one
        # a repaired member's state is now its source's, whose NaN/Inf its own row counts
        nonfinite = sum(rows[member][3] for member in quorum.members if member not in repaired)
        unrepaired = sum(len(replicas) for replicas, mismatch in mismatches if mismatch.source is None)
        return state_save_health(health, nonfinite, [] if self.rank in repaired else bad, unrepaired, unrepaired,
                                 step, self.log)

    def _compare(self, group: dist.ProcessGroup, quorum: Quorum, step: int, wait: Callable[[dist.Work], None],
                 mine: torch.Tensor, moved: bool,
                 nonfinite: int) -> tuple[list[tuple[list[int], Mismatch]], dict[int, list[int]]]:
        """Every shard's replicas compared (this rank's ``mine`` digest, whether it ``moved`` at rest), what is
        attributed repaired and struck, the mismatches logged and reported; with every member's row (digest,
        moved, its count of ``nonfinite`` tensors, the reporter's clock)."""
        slots = torch.zeros(len(quorum.members), 5, dtype=torch.int64)
        clock = int(time.time()) if self.reports() else 0  # the strikes' agreed time: the quorum's first member's
        slots[quorum.index(self.rank)] = torch.cat([mine, torch.tensor([int(moved), nonfinite, clock])])
        wait(group.allreduce([slots]))  # one member's slot added to zeros: exact
        rows = dict(zip(quorum.members, slots.tolist()))
        now = float(sum(row[4] for row in rows.values()))
        mismatches = []
        for shard in range(self.group_size):
            replicas = [member for member in quorum.members if shard_of(member, self.group_size) == shard]
            verdict = compare_replicas([STATE], {r: [(rows[r][0], rows[r][1])] for r in replicas},
                                       {r: [bool(rows[r][2])] for r in replicas})
            mismatches.extend((replicas, mismatch) for mismatch in verdict.mismatches)
        for replicas, mismatch in mismatches:
            if mismatch.source is not None:
                repair_from(group, quorum, self.rank, mismatch.source, mismatch.faulty, self.state, wait)
            self.log.error("fingerprint mismatch: step %d, replica group %s, tensor %s: %s%s", step, replicas, STATE,
                           f"rank(s) {list(mismatch.faulty)} corrupt ({mismatch.how})" if mismatch.faulty
                           else "unattributed (the replicas disagree, none changed at rest)",
                           f", repaired from rank {mismatch.source}" if mismatch.source is not None else "")
            if self.reports():
                self.events.emit("fingerprint_mismatch", step=step, group=replicas, tensors=[STATE],
                                 faulty=list(mismatch.faulty), how=[mismatch.how],
                                 repaired=[STATE] if mismatch.source is not None else [])
        if self.sdc is not None:  # after the repairs: a repaired rank's guards' state is its source's
            for _, mismatch in mismatches:
                for rank in mismatch.faulty:
                    if self.sdc.strike(rank, step, {"kind": "fingerprint", "points": [STATE]}, now,
                                       f"fingerprint mismatch ({mismatch.how})"):
                        self.struck_out = tuple(sorted({*self.struck_out, rank}))
        return mismatches, rows
