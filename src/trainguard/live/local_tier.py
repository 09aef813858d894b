"""The local and memory tiers in live mode: each rank's own copy of its state, for a whole-job restart.

In a live run a rank that dies is replaced and gets its state from a live peer, so these tiers serve
whole-job failures only (every group lost, the launcher's death, a SIGKILL of the job): a job started
again with ``checkpoint.resume: auto`` resumes from the newest step every rank holds in one of them when
it is newer than the newest durable checkpoint (``choose_live_resume``), else from the durable one.

Each rank writes, every ``checkpoint.local_interval`` (``memory_interval``) steps, its own state (its rows
of the parameters and their optimizer state, the guards' counters, the scheduler, the loop's objects: ``LiveState.state_dict``) with no
communication, so a quorum of any size saves: the local tier's per-rank files and rank manifest
(``local.writer.save_rank_step``: each file hashed as written, fsynced, the manifest last), under
``checkpoint.local_dir`` (``memory_dir``, in node memory) with the node of ``parallel.ranks_per_node``.
``fsdp_config.json`` records the live layout (world size, ranks per replica group): a step of another
layout is not resumed from.

The replica groups are replicas: a rank's files hold its shard (``shards.shard_of``) and the run state,
which every member holds alike, so any replica's files of a step serve the ranks of its shard. A job
resumes from the newest step every shard holds in one replica at least (``choose_live_resume``); a rank
that lacks it (its node's directory lost, the drill's ``wipe``, a damaged file) first receives a
replica's files of that step (``LiveLocalTier.exchange``, point to point over the checkpoint group),
each checked against the replica's rank manifest as it is written. The closure mode's buddy copies of
the extra state and the memory tier's lazy copy by a writer process are not done here.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint.local.exchange import read_for_sending, recv_bytes, send_bytes
from trainguard.checkpoint.local.paths import FSDP_CONFIG_NAME, TORCH_VERSION_KEY, node_of, rank_file_names, resolve_local_dir
from trainguard.checkpoint.local.reader import KINDS, rank_holdings
from trainguard.checkpoint.local.writer import (BytesMismatch, clean_rank_leftovers, commit_rank_manifest, prune,
                                                 rank_steps, remove_rank_step, save_rank_step, uncommit,
                                                 write_file_durably)
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.checkpoint.staging import serialised
from trainguard.errors import CheckpointError
from trainguard.events import EventLog
from trainguard.fs.fsio import atomic_write_json, fsync_dir
from trainguard.fs.layout import step_dir_name
from trainguard.live.shards import shard_of
from trainguard.run_secret import owner_only_dir

log = logging.getLogger("trainguard")

LIVE_LAYOUT_KEY = "live"  # fsdp_config.json's record of the live layout a step was saved in


@dataclass(frozen=True)
class ResumePoint:
    """Where a whole job resumes: ``tier`` ``"durable"`` (``step`` None: a fresh start), ``"memory"`` or
    ``"local"``; ``sources``: ``(rank, replica)`` for each rank that lacks the step, which receives it from
    that replica of its shard first."""
    tier: str
    step: int | None
    sources: tuple[tuple[int, int], ...] = ()


def choose_live_resume(durable_step: int | None, held: dict[str, Mapping[int, Sequence[int]]],
                       group_size: int) -> ResumePoint:
    """The newest step that every shard (``shard_of`` a rank, in replica groups of ``group_size``) holds in
    one per-rank tier on one of its replicas at least (``held``: tier -> each member rank's verified steps,
    the tiers in order of preference at an equal step), when it is newer than the durable checkpoint's
    ``durable_step`` (None: there is none); else the durable checkpoint. A member that lacks the step gets
    the lowest replica of its shard that holds it as its source."""
    best = ResumePoint("durable", durable_step)
    for tier, ranks in held.items():
        by_shard: dict[int, set[int]] = {}
        for rank, steps in ranks.items():
            by_shard.setdefault(shard_of(rank, group_size), set()).update(steps)
        newest = max(set.intersection(*by_shard.values()) if by_shard else set(), default=None)
        if newest is not None and (best.step is None or newest > best.step):
            holders: dict[int, int] = {}
            for rank in sorted(ranks):
                if newest in ranks[rank]:
                    holders.setdefault(shard_of(rank, group_size), rank)
            sources = tuple((rank, holders[shard_of(rank, group_size)]) for rank in sorted(ranks)
                            if newest not in ranks[rank])
            best = ResumePoint(tier, newest, sources)
    return best


def run_state(state: dict[str, Any]) -> dict[str, Any]:
    """What a rank's extra-state file holds besides the step: the guards' counters, the scheduler, the last
    committed step's report and the loop's objects (``LiveState.load`` refuses a state without the scheduler
    or an object the rank has: a whole job resumed from this tier must continue them too)."""
    return {key: state.get(key) for key in ("guards", "scheduler", "committed")} | {"stateful": state.get("stateful", {})}


class LiveLocalTier:
    """One rank's local (or memory) tier in a live run."""

    def __init__(self, run_dir: Path, *, tier: str, template: str, interval: int, keep_last: int, rank: int,
                 world: int, group_size: int, ranks_per_node: int, events: EventLog):
        self.tier, self.interval, self.keep_last = tier, interval, keep_last
        self.rank, self.world, self.group_size, self.events = rank, world, group_size, events
        self.template, self.run_dir, self.ranks_per_node = template, run_dir, ranks_per_node
        self.node = node_of(rank, ranks_per_node)
        self.dir = resolve_local_dir(template, run_dir, node=self.node, rank=rank)
        self.layout = {"world_size": world, "group_size": group_size}
        self.fsdp_config = {LIVE_LAYOUT_KEY: self.layout, TORCH_VERSION_KEY: torch.__version__}
        self.last_saved: int | None = None  # the step this rank last saved here (or resumed from)
        self._pruner: threading.Thread | None = None
        owner_only_dir(self.dir, f"the live {tier} tier's directory")
        clean_rank_leftovers(self.dir, world, rank)

    def save(self, step: int, state: dict[str, Any], prune: bool = True) -> None:
        """Writes this rank's ``state`` (``LiveState.state_dict``) of ``step``, committed by its rank manifest;
        then, with ``prune``, deletes this rank's steps past ``keep_last`` in the background."""
        self.wait()
        owner_only_dir(self.dir, f"the live {self.tier} tier's directory")  # a wiped node's directory comes back
        saved = save_rank_step(self.dir, step, rank=self.rank, world_size=self.world, model_state=state["model"],
                               optim_state=state["optimizer"],
                               extra_state=serialised({"step": step, **run_state(state)}), replica_extras={},
                               fsdp_config=self.fsdp_config)
        self.last_saved = step
        self.events.emit("local_saved", step=step, bytes=saved.bytes, seconds=saved.seconds, path=str(self.dir),
                         tier=self.tier)
        if prune:  # deleting old files costs about as much as writing them: off the training path
            self._pruner = threading.Thread(target=self._prune, daemon=True)
            self._pruner.start()

    def _prune(self) -> None:
        for old in prune(self.dir, self.world, self.rank, self.keep_last):
            self.events.emit("checkpoint_deleted", step=old, reason="retention", tier=self.tier)

    def wait(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def held(self) -> list[int]:
        """The steps of which this rank's files are all present and verify (hashed) and were saved in this
        run's layout, ascending."""
        self.wait()
        steps = []
        for step, holdings in rank_holdings(self.dir, self.world, self.rank).items():
            if set(holdings.own) == set(KINDS) and self._layout_of(step) == self.layout:
                steps.append(step)
        return sorted(steps)

    def _layout_of(self, step: int) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / step_dir_name(step) / FSDP_CONFIG_NAME).read_text()).get(LIVE_LAYOUT_KEY)
        except (OSError, ValueError, AttributeError):
            return None

    def load(self, step: int) -> dict[str, Any]:
        """This rank's state of ``step`` (``LiveState.load``'s), loaded ``weights_only``."""
        step_dir = self.dir / step_dir_name(step)
        names = rank_file_names(self.world, self.rank)
        extra = safe_torch_load(step_dir / names["extra"])
        if extra.get("step") != step:
            raise CheckpointError(f"{step_dir / names['extra']}: holds step {extra.get('step')}, not {step}")
        self.last_saved = step
        return {"model": safe_torch_load(step_dir / names["model"]),
                "optimizer": safe_torch_load(step_dir / names["optim"]), **run_state(extra)}

    def node_dirs(self) -> list[Path]:
        """The directories of this rank's node (every rank of it: ``{rank}`` in the template makes one each):
        what the drill's ``wipe`` of the node deletes."""
        return sorted({resolve_local_dir(self.template, self.run_dir, node=self.node, rank=rank)
                       for rank in range(self.world) if node_of(rank, self.ranks_per_node) == self.node})

    def exchange(self, step: int, sources: Sequence[tuple[int, int]], index_of: Callable[[int], int]) -> int:
        """Collective over the default group (every member of the quorum; ``index_of``: a rank's place in
        it): for each ``(rank, replica)`` of ``sources``, the replica sends its files of ``step`` and the rank
        writes them as its own, each checked against the replica's rank manifest while it is written (bytes
        that do not match never take the file's name) and fsynced, then commits them with its own rank
        manifest. Returns the bytes this rank received."""
        received = 0
        for rank, replica in sources:
            if self.rank == replica:
                self._send(step, index_of(rank))
            elif self.rank == rank:
                received += self._receive(step, replica, index_of(replica))
        return received

    def _send(self, step: int, to: int) -> None:
        step_dir = self.dir / step_dir_name(step)
        own = rank_holdings(self.dir, self.world, self.rank, [step], hashed=False)[step].own  # hashed by ``held``
        header = {kind: [own[kind].size, own[kind].checksum] for kind in KINDS}
        send_bytes(bytearray(json.dumps(header).encode()), to, None)
        for kind in KINDS:
            send_bytes(read_for_sending(step_dir / own[kind].path), to, None)

    def _receive(self, step: int, replica: int, source: int) -> int:
        header = json.loads(bytes(recv_bytes(source, None)))
        owner_only_dir(self.dir, f"the live {self.tier} tier's directory")  # a wiped node's directory comes back
        step_dir = self.dir / step_dir_name(step)
        step_dir.mkdir(exist_ok=True)
        uncommit(step_dir, self.world, self.rank)
        names, entries, received, mismatched = rank_file_names(self.world, self.rank), [], 0, []
        for kind in KINDS:  # in the sender's order
            name, data = names[kind], recv_bytes(source, None)  # every file received, a bad one too: the sender is not left waiting
            size, checksum = header[kind]
            try:
                entries.append(write_file_durably(step_dir / name, lambda stream, data=data: stream.write(data),
                                                  FileEntry(name, size, checksum)))
            except BytesMismatch:
                mismatched.append(name)
            received += len(data)
        if mismatched:  # the step stays uncommitted for this rank: its files are removed at its next start
            raise CheckpointError(f"{step_dir / mismatched[0]}: the bytes received from rank {replica} for step "
                                  f"{step} do not match its rank manifest's checksum")
        atomic_write_json(step_dir / FSDP_CONFIG_NAME, self.fsdp_config)
        commit_rank_manifest(step_dir, step, rank=self.rank, world_size=self.world, entries=entries)
        fsync_dir(self.dir)
        return received

    def discard_newer(self, step: int) -> None:
        """Drops this rank's steps after ``step``: a timeline the job did not continue."""
        self.wait()
        for newer in rank_steps(self.dir, self.world, self.rank):
            if newer > step:
                remove_rank_step(self.dir, newer, self.world, self.rank)
