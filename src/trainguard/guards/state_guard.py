"""The state guard: what the step calls so that corrupt weights or optimizer state are found, repaired
where a replica allows, and never committed.

Three calls per step, every rank:

- ``before_step(step)``: on a fingerprint step (``guards.fingerprint.interval``), hashes this rank's
  shards, compares them across its replica group (``guards.fingerprint``), strikes the ranks
  attributed and repairs their shards from an agreeing replica, in place;
- ``after_update(step)``: right after the optimizer step, hashes the shards when the next step is a
  fingerprint step (the at-rest comparison's reference);
- ``before_save(step)``: the save's health verdict (``None`` when healthy and nothing is monitored):
  unhealthy when any rank's state holds a NaN/Inf (``state_health``) or replicas disagree with no
  repair. One all-reduce of two numbers over the world, so every rank gets the same verdict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainguard.guards.health import Health, marked_unhealthy
from trainguard.guards.fingerprint import FingerprintConfig, FingerprintVerdict, ReplicaFingerprints
from trainguard.guards.state_health import local_state, merge_health, nonfinite_state, poisoned_health

# strike(step, evidence) -> whether this rank's device is now faulty
Strike = Callable[[int, dict[str, Any]], bool]


class StateGuard:
    def __init__(self, config: FingerprintConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 replica_groups: Sequence[Sequence[int]], rank: int, log: logging.Logger,
                 emit: Callable[..., Any], strike: Strike | None = None):
        config.validate()
        self.model, self.optimizer = model, optimizer
        self.rank, self.log, self.emit, self.strike = rank, log, emit, strike
        self.fingerprints = (ReplicaFingerprints(replica_groups, rank, config.interval)
                             if config.enabled else None)
        self.faulty = False  # this rank's device reached its strike limit through a fingerprint mismatch
        self.unrepaired: FingerprintVerdict | None = None  # a mismatch nothing could repair, until a save

    def _state(self):
        return local_state(self.model, self.optimizer)

    def before_step(self, step: int) -> FingerprintVerdict | None:
        if self.fingerprints is None or not self.fingerprints.due(step):
            return None
        named = self._state()
        verdict = self.fingerprints.check(named, at_rest=True)
        self._handle(step, named, verdict)
        return verdict

    def after_update(self, step: int) -> None:
        if self.fingerprints is not None and self.fingerprints.due(step + 1):
            self.fingerprints.remember(self._state())

    def before_save(self, step: int, health: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """``health``: the save's other verdict (the embedding norm's), merged in. Collective."""
        named = self._state()
        if self.fingerprints is not None:
            self._handle(step, named, self.fingerprints.check(named, at_rest=False))
        bad = nonfinite_state(named)
        device = named[0][1].device if named else torch.device("cpu")
        counts = torch.tensor([len(bad), int(self.unrepaired is not None)], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        nonfinite, unrepaired = counts.tolist()
        verdicts = [health, poisoned_health(nonfinite, bad)]
        if unrepaired:
            verdicts.append({"is_health": int(Health.UNHEALTHY), "reason": "replicas disagree",
                             "fingerprint_groups": unrepaired})
        merged = merge_health(*verdicts)
        if marked_unhealthy(merged):
            self.log.error("checkpoint of step %d is unhealthy and will not be resumed from: %s", step,
                           {k: v for k, v in merged.items() if k != "is_health"})
        self.unrepaired = None
        return merged

    def _handle(self, step: int, named, verdict: FingerprintVerdict) -> None:
        if verdict.clean:
            return
        fingerprints = self.fingerprints
        repaired = fingerprints.repair(named, verdict)
        for mismatch in verdict.mismatches:
            self.log.error("fingerprint mismatch: step %d, replica group %s, tensor %s: %s%s", step,
                           list(fingerprints.members), mismatch.tensor,
                           f"rank(s) {list(mismatch.faulty)} corrupt ({mismatch.how})" if mismatch.faulty
                           else "unattributed (the replicas disagree, none changed at rest)",
                           f", repaired from rank {mismatch.source}" if mismatch.tensor in repaired else "")
        if self.rank == fingerprints.members[0]:
            self.emit("fingerprint_mismatch", step=step, group=list(fingerprints.members),
                      tensors=[m.tensor for m in verdict.mismatches], faulty=list(verdict.faulty_ranks),
                      how=sorted({m.how for m in verdict.mismatches}), repaired=repaired)
        if not verdict.repairable:
            self.unrepaired = verdict
        if self.rank in verdict.faulty_ranks and self.strike is not None:
            tensors = [m.tensor for m in verdict.mismatches if self.rank in m.faulty]
            self.faulty = self.strike(step, {"kind": "fingerprint", "points": tensors}) or self.faulty
