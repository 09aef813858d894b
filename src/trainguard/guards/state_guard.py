"""The state guard: what the step calls so that corrupt weights or optimizer state are found, repaired
where a replica allows, and never committed.

Three calls per step, every rank:

- ``before_step(step)``: on a fingerprint step (``guards.fingerprint.interval``), hashes this rank's
  shards, compares them across its replica group (``guards.fingerprint``), strikes the ranks
  attributed and repairs their shards from an agreeing replica, in place. Then every rank learns, with
  one all-gather of two numbers over the world, the ranks whose device reached its strike limit
  (``struck_out``: the step saves and ends the run with exit 17) and whether some rank holds a corrupt
  shard that no replica can repair (``recompute``): 2 replicas that disagree with no attribution, or a
  shard that changed at rest with no replica (pure FSDP). The step then rolls every rank back to the
  last agreeing state, the newest healthy checkpoint, and the run recomputes the steps since; at this
  check step again, :meth:`ReplicaFingerprints.check_recompute` names the rank whose first computation
  went wrong, from host copies of the tensors that disagreed;
- ``after_update(step)``: right after the optimizer step, hashes the shards when the next step is a
  fingerprint step (the at-rest comparison's reference), or at every step with ``every_step``;
- ``changed_at_rest()`` (``every_step``: ``guards.fingerprint.at_rest``, by default on a rank with
  no replica): after the backward, whether this rank's shards still hash as they did after the last
  change of the state (an update, a load; a skipped step changes nothing), a flag left on the device
  for the step's all-reduce to carry; when any rank raised it every rank calls
  ``after_change_at_rest``: the rank is struck, the state is recomputed from the newest healthy
  checkpoint (or, with none, every later save is marked unhealthy);
- ``before_save(step)``: the save's health verdict (``None`` when healthy and nothing is monitored):
  unhealthy when any rank's state holds a NaN/Inf (``state_health``) or replicas disagree with no
  repair. One all-reduce of two numbers over the world, so every rank gets the same verdict.

And after a rollback to ``step``'s checkpoint for a recompute, ``restored_agrees(step)``: whether the
restored shards hash as they did right after ``step``'s update, on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainguard.guards.fingerprint import FingerprintConfig, FingerprintVerdict, Mismatch, ReplicaFingerprints
from trainguard.guards.state_health import NamedTensors, local_state, nonfinite_state, state_save_health

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
        # check the shards at rest before every update, not only at the replica checks (the sizes of the
        # replica groups are the same on every rank, so every rank decides alike)
        self.every_step = self.fingerprints is not None and config.every_step(self.fingerprints.replicas)
        self._moved: torch.Tensor | None = None  # per tensor of the state: changed at rest (``changed_at_rest``)
        self.faulty = False  # this rank's device reached its strike limit through a fingerprint mismatch
        # a mismatch nothing could repair: every later save holds it (and is marked unhealthy) until a
        # recompute from an agreeing checkpoint replaces the state
        self.unrepaired: FingerprintVerdict | None = None
        self.struck_out: list[int] = []  # every rank whose device is faulty, as of the last check (world)
        self.recompute = False  # the last check asks for a recompute from the last agreeing state (world)
        # (check step, host copies of this rank's tensors that disagreed there), until the recompute reaches it
        self._recomputing: tuple[int, dict[str, torch.Tensor]] | None = None

    def _state(self):
        return local_state(self.model, self.optimizer)

    def before_step(self, step: int) -> FingerprintVerdict | None:
        if self.fingerprints is None or not self.fingerprints.due(step):
            return None
        named = self._state()
        recomputed = self._recomputing is not None and self._recomputing[0] == step
        if recomputed:
            self._handle(step, named, self.fingerprints.check_recompute(named, self._recomputing[1]))
            self._recomputing = None
        verdict = self.fingerprints.check(named, at_rest=True)
        self._handle(step, named, verdict)
        # what no replica can repair is recomputed (a second mismatch right after a recompute is not: it
        # stays, and the next save is marked unhealthy)
        self._exchange(not recomputed and not verdict.repairable, named[0][1].device if named else torch.device("cpu"))
        if self.recompute:
            disagreeing = {m.tensor for m in verdict.mismatches if m.how == "unattributed"}
            self._recomputing = (step, {name: tensor.detach().to("cpu", copy=True)
                                        for name, tensor in named if name in disagreeing})
        if self.every_step and not verdict.clean:
            # what this check found (and repaired, or recorded unrepaired) is not to be found again by
            # this step's every-step comparison: a second strike for one flip
            self.fingerprints.remember_sums(named)
        return verdict

    def _exchange(self, recompute: bool, device: torch.device) -> None:
        """Every rank's (faulty, recompute) flags, gathered over the world."""
        mine = torch.tensor([int(self.faulty), int(recompute)], dtype=torch.int64, device=device)
        flags = [mine]
        if dist.is_initialized():
            flags = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(flags, mine)
        rows = torch.stack(flags).tolist()
        self.struck_out = [rank for rank, (faulty, _) in enumerate(rows) if faulty]
        self.recompute = any(wanted for _, wanted in rows)

    def recomputing_from(self, step: int | None) -> None:
        """The step rolled back to ``step`` for the recompute (None: there was no healthy checkpoint
        before; the mismatch stays unattributed and the next save is marked unhealthy)."""
        self.recompute = False
        if step is None:
            self._recomputing = None
        else:
            self.unrepaired = None  # the disagreeing state is gone

    def checks_at_rest(self, step: int) -> bool:
        """Whether ``before_step(step)`` compares the shards with their hashes after the last update."""
        return self.fingerprints is not None and self.fingerprints.due(step)

    def after_update(self, step: int) -> None:
        """Right after ``step``'s optimizer step, or once the state of ``step`` is loaded (a resume, a
        rollback, a recompute): hashes the shards when a check will compare with them."""
        if self.fingerprints is None:
            return
        if self.fingerprints.due(step + 1):
            self.fingerprints.remember(self._state(), step)
        if self.every_step:
            self.fingerprints.remember_sums(self._state(), step)

    def changed_at_rest(self) -> torch.Tensor | bool:
        """``every_step``: whether this rank's shards changed since they were last hashed by
        :meth:`after_update` (the state changes only in ``optimizer.step`` and in loads), as a flag on
        the state's device: the step's all-reduce carries it without a host synchronisation of its own,
        and only when some rank raised it does every rank call :meth:`after_change_at_rest`."""
        if not self.every_step:
            return False
        self._moved = self.fingerprints.changed_since_update(self._state())
        return self._moved.any()

    def after_change_at_rest(self, step: int) -> None:
        """Some rank's shards changed at rest (``changed_at_rest``): the rank that holds them is struck
        (its memory changed with no update: no other rank can have caused it), the change is logged and
        kept unrepaired until a recompute replaces it, and every rank learns ``struck_out`` and
        ``recompute``. Collective: every rank calls it at the same step."""
        named = self._state()
        verdict = self._changed_verdict(named, self._moved)
        self._handle(step, named, verdict)
        self._exchange(not verdict.clean, named[0][1].device if named else torch.device("cpu"))

    def _changed_verdict(self, named: NamedTensors, moved: torch.Tensor | None) -> FingerprintVerdict:
        """This rank's tensors flagged in ``moved`` (``changed_since_update``), each a change at rest."""
        flags = moved.tolist() if moved is not None and len(moved) == len(named) else []
        return FingerprintVerdict(tuple(Mismatch(name, (self.rank,), None, "at_rest")
                                        for (name, _), changed in zip(named, flags) if changed))

    def restored_agrees(self, step: int) -> bool:
        """Whether the state just restored from ``step``'s checkpoint hashes as every rank's did right after
        ``step``'s update (True where no rank hashed that step). A lazy save copies the state after the
        update: memory corrupted before its copy was made is in the checkpoint, and a recompute from it
        would keep the corruption. Collective: one all-reduce of one number over the world."""
        named = self._state()
        agrees = self.fingerprints is None or self.fingerprints.agrees_with_update(named, step)
        flag = torch.tensor([int(agrees)], dtype=torch.int64, device=named[0][1].device if named else "cpu")
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def before_save(self, step: int, health: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """``health``: the save's other verdict (the embedding norm's), merged in. Collective."""
        named = self._state()
        found = False
        if self.fingerprints is not None:
            verdict = self.fingerprints.check(named, at_rest=False)
            self._handle(step, named, verdict)
            found = not verdict.clean
        if self.every_step:  # the sums taken right after the last update: memory that changed since
            changed = self._changed_verdict(named, self.fingerprints.changed_since_update(named))
            self._handle(step, named, changed)
            if found or not changed.clean:
                # what the save's checks found (or repaired from a replica) is not to be found again by the
                # next step's comparison with the same sums: a second strike for one flip
                self.fingerprints.remember_sums(named)
        bad = nonfinite_state(named)
        device = named[0][1].device if named else torch.device("cpu")
        unrepaired_here = self.unrepaired is not None
        at_rest_only = unrepaired_here and all(m.how == "at_rest" for m in self.unrepaired.mismatches)
        counts = torch.tensor([len(bad), int(unrepaired_here), int(unrepaired_here and not at_rest_only)],
                              dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        nonfinite, unrepaired, disagreeing = counts.tolist()
        return state_save_health(health, nonfinite, bad, unrepaired, disagreeing, step, self.log)

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
