"""Replica fingerprints: corruption of weights or optimizer state found by comparing replicas' hashes.

Ranks that differ only in their ``dp_replicate`` coordinate (``topology.replica_groups``) hold
bit-identical parameter and optimizer shards after every step. Every ``guards.fingerprint.interval``
steps and before every save, each rank hashes its shards where they live (:func:`fingerprints`: two
integer sums per tensor, no copy to the host) and the replica group all-gathers the hashes, one
``[tensors, 3]`` int64 tensor per rank. Replicas that disagree hold corrupted state: no false alarm
is possible, a clean run is bitwise identical across replicas.

Attribution (:func:`compare_replicas`, pure):

- ``majority``: with 3 or more replicas, a value held by more than half of them is the right one;
- ``at_rest``: each rank also hashed its shards right after the previous optimizer step (when a check
  is due next); a rank whose shard changed since then, with no step in between, had its memory
  corrupted at rest. This attributes the 2-replica case when the corruption happened at rest, and is
  the only check there is without replicas (pure FSDP);
- ``recompute``: 2 replicas that disagree with neither changed at rest (the corruption entered an
  update) are ``unattributed`` at first: each rank keeps a host copy of the tensors that disagree, the
  step guard rolls every rank back to the last agreeing state (the newest healthy checkpoint: its
  replicas agreed when it was saved) and the run recomputes the steps since. At the same check step
  again, each rank measures how far its old copy is from the recomputed tensor (max |old - new|;
  :func:`attribute_by_recompute`). A computation is deterministic, so the recomputed state is the
  right one: a rank at distance 0 was right; when neither is, the gradient all-reduce carried the
  corruption to the other replica too, and the rank at least ``RECOMPUTE_RATIO`` times further away
  than the other holds the corruption itself. The recompute has repaired both either way;
- ``unattributed``: replicas that disagree with nothing above to attribute it (and nothing to
  recompute from): the save is refused (marked unhealthy) and nothing is repaired.

Repair (:meth:`ReplicaFingerprints.repair`): the corrupt shard is overwritten in place by a broadcast
from an agreeing replica of the same group, without a restart.

The hash: the tensor's bytes read as int64 words, summed (any single bit flip changes the sum by a
power of two below 2^64: always seen), and a second, position-weighted sum (the running sums of rows
of 1024 words: values moved from one row to another are seen too). Both are plain int64 reductions,
the fast ones on CPU and GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.guards.state_health import NamedTensors

DEFAULT_INTERVAL = 50


AT_REST = ("auto", "every_step", "interval")


@dataclass
class FingerprintConfig:
    """``guards.fingerprint``: compare replicas' state every ``interval`` steps and before every save
    (0 = off). ``at_rest``: when a rank checks that its shards did not change since the last optimizer
    step: ``interval`` at the replica checks only; ``every_step`` before every update (a shard hashed
    after each optimizer step and again after the next backward: two hashes per step); ``auto`` (the
    default) every step on a rank with no replica, where nothing else can find a flip at a random
    moment, at the checks otherwise."""

    interval: int = DEFAULT_INTERVAL
    at_rest: str = "auto"

    def validate(self) -> None:
        interval = self.interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ConfigError(f"config key guards.fingerprint.interval must be a non-negative integer (0 = off), "
                              f"got {interval!r}")
        if self.at_rest not in AT_REST:
            raise ConfigError(f"config key guards.fingerprint.at_rest must be one of {', '.join(AT_REST)}, "
                              f"got {self.at_rest!r}")

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def every_step(self, replicas: int) -> bool:
        """Whether a rank whose replica group has ``replicas`` members checks its shards at rest every step."""
        return self.enabled and (self.at_rest == "every_step" or (self.at_rest == "auto" and replicas == 1))

HOW = ("majority", "at_rest", "recompute", "unattributed")

_ROW = 1024  # int64 words per row of the position-weighted sum
# after a recompute, a replica this many times further from the recomputed state than the other holds the corruption
RECOMPUTE_RATIO = 4.0


def tensor_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's hash as an int64 ``[2]`` tensor on its device (no host synchronisation).

    Its bytes are read as int64 words (the last few bytes one by one); ``total`` is their sum and
    ``weighted`` the sum of the running sums of rows of ``_ROW`` words. int64 sums are the fast
    reductions on every device (integer sums of narrower types are not vectorised on CPU)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = data.numel() - data.numel() % 8
    words = data[:whole].view(torch.int64)
    full = words.numel() - words.numel() % _ROW
    rows = torch.cat([words[:full].view(-1, _ROW).sum(1), words[full:].sum().reshape(1),
                      data[whole:].to(torch.int64).sum().reshape(1)])
    return torch.stack([rows.sum(), rows.cumsum(0).sum()])


def word_sums(named: NamedTensors) -> torch.Tensor:
    """``[len(named)]`` int64: each tensor's bytes read as int64 words, summed (``tensor_fingerprint``'s
    ``total``: any single bit flip changes it), in one reduction per tensor where its bytes allow the
    view: the every-step at-rest check's hash, whose cost on a small model is the number of operations
    per tensor, not the bytes (the position-weighted sum, which also sees values moved between
    positions, is for comparing replicas)."""
    sums = []
    for _, tensor in named:
        flat = tensor.detach().reshape(-1)
        try:
            sums.append(flat.view(torch.int64).sum())
        except RuntimeError:  # a size or an offset not a multiple of 8 bytes: the general path, on a copy
            sums.append(tensor_fingerprint(flat.clone())[0])  # that starts on an aligned address
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def distance(tensor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """max |tensor - other| as a float64 scalar on ``tensor``'s device; inf when either is not finite."""
    difference = (tensor.detach().double() - other.to(tensor.device).double()).abs()
    if not difference.numel():
        return torch.zeros((), dtype=torch.float64, device=tensor.device)
    return torch.nan_to_num(difference.max(), nan=math.inf)


def fingerprints(named: NamedTensors) -> torch.Tensor:
    """``[len(named), 2]`` int64 hashes on the tensors' device (all tensors on one device)."""
    if not named:
        return torch.zeros((0, 2), dtype=torch.int64)
    return torch.stack([tensor_fingerprint(tensor) for _, tensor in named])


@dataclass(frozen=True)
class Mismatch:
    """One tensor whose replicas disagree (or that changed at rest on a rank without replicas)."""

    tensor: str
    faulty: tuple[int, ...]  # the ranks attributed; empty when unattributed
    source: int | None  # a rank holding the agreeing value, to repair from; None: nothing to repair from
    how: str  # one of HOW


@dataclass(frozen=True)
class FingerprintVerdict:
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def clean(self) -> bool:
        return not self.mismatches

    @property
    def faulty_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({rank for m in self.mismatches for rank in m.faulty}))

    @property
    def repairable(self) -> bool:
        """Every mismatch has an agreeing replica to copy from."""
        return all(m.source is not None for m in self.mismatches)


def compare_replicas(names: Sequence[str], hashes: Mapping[int, Sequence[tuple[int, int]]],
                     changed_at_rest: Mapping[int, Sequence[bool]] | None = None) -> FingerprintVerdict:
    """Compares one replica group's hashes (``hashes[rank][i]``: rank's hash of ``names[i]``);
    ``changed_at_rest[rank][i]``: whether the rank's tensor changed since its own hash after the last
    optimizer step. Pure; every member computes the same verdict from the same gathered values."""
    changed_at_rest = changed_at_rest or {}
    members = sorted(hashes)
    mismatches = []
    for i, name in enumerate(names):
        values: dict[tuple[int, int], list[int]] = {}
        for rank in members:
            values.setdefault(tuple(hashes[rank][i]), []).append(rank)
        moved = [rank for rank in members if changed_at_rest.get(rank) and changed_at_rest[rank][i]]
        if len(values) == 1:
            if moved:  # no replica disagrees (there is none, or all moved alike): the memory changed at rest
                mismatches.append(Mismatch(name, tuple(moved), None, "at_rest"))
            continue
        holders = max(values.values(), key=len)
        if 2 * len(holders) > len(members):
            faulty = tuple(rank for rank in members if rank not in holders)
            mismatches.append(Mismatch(name, faulty, holders[0], "majority"))
            continue
        rest = [rank for rank in members if rank not in moved]
        if moved and rest and len({tuple(hashes[rank][i]) for rank in rest}) == 1:
            mismatches.append(Mismatch(name, tuple(moved), rest[0], "at_rest"))
        else:
            mismatches.append(Mismatch(name, (), None, "unattributed"))
    return FingerprintVerdict(tuple(mismatches))


def attribute_by_recompute(names: Sequence[str], distances: Mapping[int, Sequence[float]]) -> FingerprintVerdict:
    """After a recompute from the last agreeing state: ``distances[rank][i]``: max |old - recomputed|
    of the rank's ``names[i]`` (inf for a non-finite one). A rank at distance 0 computed right; the
    others are faulty. When no rank is at 0 (the all-reduced gradient carried the corruption to every
    replica), the rank ``RECOMPUTE_RATIO`` times further than every other is; otherwise unattributed.
    The repair source is a rank attributed right. Pure."""
    members = sorted(distances)
    mismatches = []
    for i, name in enumerate(names):
        far = {rank: distances[rank][i] for rank in members}
        right = [rank for rank in members if far[rank] == 0]
        if len(right) == len(members):
            continue
        if not right:
            farthest = max(members, key=far.get)
            if all(far[farthest] >= RECOMPUTE_RATIO * far[rank] for rank in members if rank != farthest):
                right = [rank for rank in members if rank != farthest]
        if right:
            mismatches.append(Mismatch(name, tuple(r for r in members if r not in right), right[0], "recompute"))
        else:
            mismatches.append(Mismatch(name, (), None, "unattributed"))
    return FingerprintVerdict(tuple(mismatches))


def replica_partition(groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The distinct groups, each sorted, in a fixed order (every rank creates the same process groups)."""
    return sorted({tuple(sorted(group)) for group in groups})


class ReplicaFingerprints:
    """This rank's side of the fingerprint check: its hashes, the all-gather in its replica group,
    the repair broadcast. Construct it on every rank (it creates one process group per replica group)."""

    def __init__(self, groups: Sequence[Sequence[int]], rank: int, interval: int):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"interval must be a non-negative integer, got {interval!r}")
        self.rank = rank
        self.interval = interval
        self.members: tuple[int, ...] = (rank,)
        self.group: dist.ProcessGroup | None = None
        for members in replica_partition(groups):
            # new_group is collective over the whole world: every rank creates every group
            group = dist.new_group(list(members)) if len(members) > 1 else None
            if rank in members:
                self.members, self.group = members, group
        self._after_update: torch.Tensor | None = None  # for the next at-rest comparison, which uses it up
        self._remembered: tuple[int, torch.Tensor] | None = None  # (step, hashes) of the last ``remember``
        self._sums: torch.Tensor | None = None  # the word sums of the last ``remember_sums``
        self._sums_step: int | None = None  # the step whose update ``_sums`` were taken right after
        self.checks = 0

    @property
    def replicas(self) -> int:
        return len(self.members)

    def due(self, step: int) -> bool:
        """A check is due before ``step``'s forward."""
        return self.interval > 0 and step % self.interval == 0

    def remember(self, named: NamedTensors, step: int) -> None:
        """Hashes the state right after ``step``'s optimizer step, for the at-rest comparison of the next
        check (and ``agrees_with_update`` after a rollback to that step)."""
        self._after_update = fingerprints(named)
        self._remembered = (step, self._after_update)

    def agrees_with_update(self, named: NamedTensors, step: int) -> bool:
        """Whether ``named`` hashes as the state did right after ``step``'s optimizer step: by its
        fingerprints (``remember``) or, at rest every step, its word sums (``remember_sums``); True when
        this rank hashed no such state."""
        if self._remembered is not None and self._remembered[0] == step:
            current, remembered = fingerprints(named), self._remembered[1]
        elif self._sums is not None and self._sums_step == step:
            current, remembered = word_sums(named), self._sums
        else:
            return True
        return current.shape == remembered.shape and torch.equal(current, remembered)

    def remember_sums(self, named: NamedTensors, step: int | None = None) -> None:
        """The word sums of the state as it is now, right after it changed (an optimizer step, a load, a
        repair), for ``changed_since_update``: a step that changes nothing (a skipped one) keeps them.
        ``step``: the step whose update (or load) made this state, for ``agrees_with_update``; None
        after a repair or a change found at rest, which no checkpoint of a step holds."""
        self._sums = word_sums(named)
        self._sums_step = step

    def changed_since_update(self, named: NamedTensors) -> torch.Tensor:
        """``[len(named)]`` bool on the tensors' device, without a host synchronisation: which tensors'
        word sums differ from ``remember_sums``'s (none when it took none, or of other tensors): with
        no update since, memory that changed at rest."""
        if self._sums is None or len(self._sums) != len(named):
            return torch.zeros(len(named), dtype=torch.bool, device=named[0][1].device if named else "cpu")
        return word_sums(named) != self._sums

    def check(self, named: NamedTensors, at_rest: bool = True) -> FingerprintVerdict:
        """Hashes ``named`` (the same names in the same order on every replica), gathers the group's
        hashes and compares them. ``at_rest``: no optimizer step since ``remember`` (then a tensor that
        changed is flagged); False for the check before a save, right after the update."""
        self.checks += 1
        current = fingerprints(named)
        changed = torch.zeros(len(named), dtype=torch.int64, device=current.device)
        if at_rest and self._after_update is not None and self._after_update.shape == current.shape:
            changed = (current != self._after_update).any(dim=1).to(torch.int64)
        if at_rest:
            self._after_update = None
        rows = self.gather(torch.cat([current, changed[:, None]], dim=1))
        names = [name for name, _ in named]
        hashes = {rank: [(row[0], row[1]) for row in rows[rank]] for rank in self.members}
        moved = {rank: [bool(row[2]) for row in rows[rank]] for rank in self.members}
        return compare_replicas(names, hashes, moved)

    def check_recompute(self, named: NamedTensors, before: Mapping[str, torch.Tensor]) -> FingerprintVerdict:
        """After the recompute from the last agreeing state, at the check step where the replicas
        disagreed: each rank's distance from ``before`` (its copies of the tensors that disagreed
        then) to the recomputed tensors, compared across the group."""
        tensors = dict(named)
        names = sorted(before)
        device = named[0][1].device if named else torch.device("cpu")  # the group's collectives run there
        distances = (torch.stack([distance(tensors[name], before[name]) for name in names]) if names
                     else torch.zeros(0, dtype=torch.float64, device=device))
        rows = self.gather(distances[:, None])
        return attribute_by_recompute(names, {rank: [row[0] for row in rows[rank]] for rank in self.members})

    def gather(self, mine: torch.Tensor) -> dict[int, list[list[int]]]:
        """Every group member's ``mine`` (the same shape and dtype on each), by rank: one host synchronisation."""
        if self.group is None:
            gathered = [mine]
        else:
            gathered = [torch.empty_like(mine) for _ in self.members]
            dist.all_gather(gathered, mine, group=self.group)
        rows = torch.stack(gathered).tolist()
        return {rank: rows[k] for k, rank in enumerate(self.members)}

    def repair(self, named: NamedTensors, verdict: FingerprintVerdict) -> list[str]:
        """Overwrites every attributed corrupt tensor from its agreeing replica (a broadcast in the
        replica group, in place); returns the names repaired. Every member calls it with the same verdict."""
        tensors = dict(named)
        repaired = []
        for mismatch in verdict.mismatches:
            if mismatch.source is None or self.group is None:
                continue
            dist.broadcast(tensors[mismatch.tensor], src=mismatch.source, group=self.group)
            repaired.append(mismatch.tensor)
        return repaired


def restore_agreeing(before_step: int, roll_back: Callable[[int], int | None], agrees: Callable[[int], bool],
                     log: logging.Logger) -> int | None:
    """Both modes' restore for a recompute: the newest healthy checkpoint before ``before_step``
    (``roll_back(before)``: its step, restored by every rank, the newer ones deleted; None when there is none)
    whose restored state hashes as every rank's did right after its update (``agrees(step)``, the same answer
    on every rank); one that does not (memory changed before its copy was made) is passed over for an older
    one, with its line. The step restored, None when none is left."""
    restored = roll_back(before_step)
    while restored is not None and not agrees(restored):
        log.error("global_step_%d does not hold the state hashed right after its update (memory changed before its "
                  "copy was made): not recomputed from", restored)
        restored = roll_back(restored)
    return restored


def log_recompute(log: logging.Logger, step: int, restored: int | None) -> None:
    """Both modes' line when the check before ``step`` found what no replica can repair: recomputed from
    the checkpoint of ``restored`` steps, or (None) from none."""
    if restored is None:
        log.error("fingerprint mismatch at step %d: no healthy checkpoint to recompute from; the mismatch stays "
                  "unattributed and the next save is marked unhealthy", step)
    else:
        log.warning("fingerprint mismatch at step %d that no replica can repair: recomputing from global_step_%d, "
                    "the last agreeing state", step, restored)
