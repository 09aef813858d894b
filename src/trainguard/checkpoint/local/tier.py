"""``LocalTier``: the local tier of one rank inside a training run (save, prune, online recovery).

Every method is collective over the tier's own gloo group (created by the caller on every rank).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.fs.fsio import atomic_write_json
from trainguard.fs.layout import HF_DIR, step_dir_name
from trainguard.run_secret import owner_only_dir
from trainguard.checkpoint.local.in_place import StagedFile
from trainguard.checkpoint.local.exchange import read_for_sending, recv_bytes, send_bytes, swap_in_ring
from trainguard.checkpoint.local.paths import FSDP_CONFIG_NAME, TORCH_VERSION_KEY, node_of, rank_file_names, resolve_local_dir
from trainguard.checkpoint.local.plan import StepPlan, buddy_of, plan_step
from trainguard.checkpoint.local.reader import StepHoldings, rank_holdings
from trainguard.checkpoint.discovery import read_latest, write_latest
from trainguard.checkpoint.local.state import dtensor_layouts, load_local_state, local_state, param_layout
from trainguard.checkpoint.local.writer import (
    BytesMismatch,
    SavedStep,
    clean_rank_leftovers,
    commit_rank_manifest,
    prune,
    rank_steps,
    remove_rank_step,
    save_rank_step,
    uncommit,
    write_file_durably,
)
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.writer_process import IN_PROCESS, Writer
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.errors import CheckpointError, IncompatibleCheckpointError
from trainguard.events import EventLog
from trainguard.topology.group_info import GROUP_INFO_NAME, GroupInfo
from trainguard.topology.replica_groups import ReplicaGroups
from trainguard.checkpoint.staging import serialised

LOCAL_DIR_WHAT = "a local tier's node directory"  # checked owner-only (0700) at every start and save

log = logging.getLogger("trainguard")


class LocalTier:
    def __init__(
        self, run_dir: Path, *, rank: int, world_size: int, groups: ReplicaGroups, layout: dict[str, Any],
        local_dir: str | None, ranks_per_node: int, interval: int, keep_last: int, model: torch.nn.Module,
        events: EventLog, process_group: dist.ProcessGroup | None,
        static_files: Callable[[Path], None] | None = None, tier: str = "local", recycle: bool = False,
        tracker: bool = True,
    ):
        """``tier`` names the tier in events: ``"local"``, or ``"memory"`` for the memory tier's copy.
        ``recycle``: pruned steps leave their files as spares that the next save writes over (the
        memory tier: new pages in node memory cost more than the write). ``tracker``: keep verl's
        ``latest_checkpointed_iteration.txt`` (a barrier per save); the memory tier, saved every step and
        read by no outside tool, does without."""
        self.tier = tier
        self.tracker = tracker
        self.recycle = recycle
        self.rank, self.world_size, self.groups = rank, world_size, groups
        self.interval, self.keep_last, self.events, self.group = interval, keep_last, events, process_group
        self.ranks_per_node = ranks_per_node
        self.static_files = static_files
        self._pruner: threading.Thread | None = None
        self.rank_dirs = {r: resolve_local_dir(local_dir, run_dir, node=node_of(r, ranks_per_node), rank=r)
                          for r in range(world_size)}
        self.dir = self.rank_dirs[rank]
        self.buddy = buddy_of(groups, rank)
        self.keeps_copy_of = next((q for q in range(world_size) if buddy_of(groups, q) == rank), None)
        mesh_shape, mesh_dim_names = layout["mesh_shape"], layout["mesh_dim_names"]
        params: dict[str, Any] = {}
        for part in self._all_gather(param_layout(model, mesh_dim_names)):  # pipeline stages hold different params
            params.update(part)
        self.fsdp_config = {"FSDP_version": 2, "world_size": world_size, "mesh_shape": list(mesh_shape),
                            "mesh_dim_names": list(mesh_dim_names), "params": dict(sorted(params.items())),
                            TORCH_VERSION_KEY: torch.__version__}
        self.dtensor_layouts = dtensor_layouts(model, min(groups.model_replicas(rank)))
        owner_only_dir(self.dir, LOCAL_DIR_WHAT)  # 0700: another user of the node reads none of its files
        self.group_info = GroupInfo(groups, layout, tuple(r for r, d in self.rank_dirs.items() if d == self.dir),
                                    {r: str(d) for r, d in self.rank_dirs.items()})
        self._write_group_info()
        clean_rank_leftovers(self.dir, world_size, rank)

    @property
    def writes_directory_files(self) -> bool:
        """One rank per local directory (its lowest) writes the files its ranks share: ``group_info.json``,
        each step's ``huggingface/`` and ``latest_checkpointed_iteration.txt``."""
        return self.rank == self.group_info.ranks[0]

    def _write_group_info(self) -> None:
        if self.writes_directory_files:
            atomic_write_json(self.dir / GROUP_INFO_NAME, self.group_info.to_dict())

    def _write_static_files(self, step_dir: Path) -> None:
        """``huggingface/`` (config, tokenizer) inside the step, so the step directory alone is what
        verl's merger and ours need (``--local_dir global_step_N``)."""
        if self.writes_directory_files and self.static_files is not None:
            step_dir.mkdir(parents=True, exist_ok=True)
            self.static_files(step_dir)

    def _mark_latest(self, step: int) -> None:
        """Once every rank's files of ``step`` are committed (a barrier), the directory's tracker names it,
        as verl's trainer keeps ``latest_checkpointed_iteration.txt`` beside its ``global_step_N``."""
        if not self.tracker:
            return
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier(group=self.group)
        if self.writes_directory_files:
            write_latest(self.dir, step)

    def _all_gather(self, value: Any) -> list[Any]:
        if not dist.is_initialized() or self.world_size == 1:
            return [value]
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, value, group=self.group)
        return parts

    # ------------------------------------------------------------------------------------- save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra_state: dict[str, Any]) -> SavedStep:
        """Writes this rank's state of ``step``; the only communication is the small extra state
        going to the buddy, before anything is written, and a barrier after (for the tracker)."""
        self.wait()
        model_state, optim_state = local_state(model, optimizer)
        return self.write(step, model_state, optim_state, serialised(extra_state))

    def write(self, step: int, model_state: dict[str, Any] | StagedFile, optim_state: dict[str, Any] | StagedFile,
              extra_bytes: bytes, files: Writer = IN_PROCESS, skipped: int | None = None) -> SavedStep:
        """``save`` of a state already taken: this rank's local tensors (or its files staged in place)
        and its serialized extra state (the memory tier writes a snapshot this way, from a background
        thread); ``files`` writes the rank's files (here, or in a writer process); ``skipped``: the
        memory tier's saves skipped since its previous one, for the event."""
        self.wait()
        copy = swap_in_ring(extra_bytes, self.buddy, self.keeps_copy_of, self.group)
        owner_only_dir(self.dir, LOCAL_DIR_WHAT)  # a wiped node's directory comes back
        self._write_group_info()
        self._write_static_files(self.dir / step_dir_name(step))
        saved = files.run(
            save_rank_step, self.dir, step, rank=self.rank, world_size=self.world_size, model_state=model_state,
            optim_state=optim_state, extra_state=extra_bytes,
            replica_extras={self.keeps_copy_of: copy} if copy is not None else {}, fsdp_config=self.fsdp_config,
            recycle=self.recycle, dtensor_layouts=self.dtensor_layouts,
        )
        self._mark_latest(step)
        self.events.emit("local_saved", step=step, bytes=saved.bytes, seconds=saved.seconds, path=str(self.dir),
                         tier=self.tier, **({} if skipped is None else {"skipped": skipped}))
        # deleting old files costs about as much as writing them (freeing pages): off the training path
        self._pruner = threading.Thread(target=self._prune, daemon=True)
        self._pruner.start()
        return saved

    def _prune(self) -> None:
        for old in prune(self.dir, self.world_size, self.rank, self.keep_last, recycle=self.recycle):
            self.events.emit("checkpoint_deleted", step=old, reason="retention", tier=self.tier)

    def wait(self) -> None:
        """Waits for the retention of the last save (the files it deletes are never read)."""
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def discard_newer(self, step: int) -> None:
        """Drops this rank's local steps after ``step``: they belong to a timeline the run left."""
        self.wait()
        kept = []
        for newer in rank_steps(self.dir, self.world_size, self.rank):
            if newer > step:
                remove_rank_step(self.dir, newer, self.world_size, self.rank)
            else:
                kept.append(newer)
        if self.tracker and self.writes_directory_files and kept:
            try:
                stale = (read_latest(self.dir) or 0) > kept[-1]
            except CheckpointError:
                stale = True
            if stale:
                write_latest(self.dir, kept[-1])

    # ---------------------------------------------------------------------------------- recover
    def recover(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                newer_than: int | None) -> tuple[int, dict[str, Any]] | None:
        """Agrees with every rank on the newest local step recoverable across all replica groups (newer
        than ``newer_than``), restores what this rank lacks from group members and loads it.

        Returns ``(step, extra state)``, or None when no local step qualifies.
        """
        self.wait()
        started = time.perf_counter()
        owner_only_dir(self.dir, LOCAL_DIR_WHAT)  # a replaced node starts without one
        self._write_group_info()
        # newest step first, each hashed only when reached: the common case reads one step's files once
        candidates = sorted({s for steps in self._all_gather(rank_steps(self.dir, self.world_size, self.rank))
                             for s in steps if newer_than is None or s > newer_than}, reverse=True)
        plan, held = None, StepHoldings()
        for step in candidates:
            mine = {s: asdict(h) for s, h in rank_holdings(self.dir, self.world_size, self.rank, [step]).items()}
            holdings = {rank: {s: _holdings_from(h) for s, h in part.items()}
                        for rank, part in enumerate(self._all_gather(mine))}
            candidate = plan_step(step, self.groups, holdings)
            if candidate.recoverable:
                plan, held = candidate, holdings[self.rank].get(step, StepHoldings())
                break
        if plan is None:
            if self.rank == 0 and candidates:
                self.events.emit("local_recovery", step=None, reason="no local step is complete across the "
                                 "replica groups and at least as new as the durable tier's", bytes=0, seconds=0.0, tier=self.tier)
            return None
        received = self._execute(plan, held)
        step_dir = self.dir / step_dir_name(plan.step)
        if not (step_dir / HF_DIR).is_dir():
            self._write_static_files(step_dir)  # a replaced node: its steps' huggingface/ comes back too
        self._mark_latest(plan.step)
        names = rank_file_names(self.world_size, self.rank)
        failure = None
        try:  # read all three before anything is loaded: a step one rank refuses is passed over by all
            model_sd = safe_torch_load(step_dir / names["model"])
            optim_sd = safe_torch_load(step_dir / names["optim"])
            extra = safe_torch_load(step_dir / names["extra"])
        except IncompatibleCheckpointError as exc:  # written under a torch whose classes this one lacks
            failure = f"{exc}; written under torch {written_under(step_dir)}"
        except CheckpointError as exc:  # e.g. a planted pickle, refused on this rank alone
            failure = str(exc)
        refused = [f"{message} (rank {rank})" for rank, message in enumerate(self._all_gather(failure)) if message]
        if refused:
            if self.rank == 0:
                log.warning("local step %d passed over: %s", plan.step, refused[0])
                self.events.emit("local_recovery", step=None, reason=f"local step {plan.step} refused: {refused[0]}",
                                 bytes=0, seconds=0.0, tier=self.tier)
            return None
        try:
            load_local_state(model, optimizer, model_sd, optim_sd)
        except ValueError as exc:
            raise CheckpointError(f"{step_dir}: local checkpoint does not fit this run's model: {exc}") from None
        seconds = time.perf_counter() - started
        if received:
            self.events.emit("local_recovered", step=plan.step, bytes=received, seconds=seconds,
                             sources=sorted({t.src for t in plan.transfers if t.dst == self.rank}), tier=self.tier)
        if self.rank == 0:
            self.events.emit("local_recovery", step=plan.step, bytes=plan.bytes, seconds=seconds,
                             transfers=len(plan.transfers), ranks=sorted({t.dst for t in plan.transfers}),
                             tier=self.tier)
        return plan.step, extra

    def _execute(self, plan: StepPlan, held: StepHoldings) -> int:
        """Runs the plan's transfers in order (each rank plays its part) and commits what this rank
        received; returns the bytes this rank received."""
        step_dir = self.dir / step_dir_name(plan.step)
        incoming = [t for t in plan.transfers if t.dst == self.rank]
        if incoming:
            step_dir.mkdir(parents=True, exist_ok=True)
            uncommit(step_dir, self.world_size, self.rank)
        entries = {e.path: e for e in list(held.own.values()) + list(held.replica_extras.values())}
        received = 0
        for transfer in plan.transfers:
            if transfer.src == self.rank:
                send_bytes(read_for_sending(step_dir / transfer.src_path), transfer.dst, self.group)
            if transfer.dst == self.rank:
                data = recv_bytes(transfer.src, self.group)
                target = step_dir / transfer.dst_path
                target.parent.mkdir(parents=True, exist_ok=True)
                try:  # hashed as it is written; bytes that do not match never take the file's name
                    entry = write_file_durably(target, lambda stream, data=data: stream.write(data), transfer.entry)
                except BytesMismatch:
                    raise CheckpointError(f"{transfer.dst_path} of step {plan.step} from rank {transfer.src}: "
                                          "received bytes do not match the sender's manifest") from None
                entries[transfer.dst_path] = FileEntry(transfer.dst_path, entry.size, entry.checksum)
                received += len(data)
        if incoming:
            atomic_write_json(step_dir / FSDP_CONFIG_NAME, self.fsdp_config)
            commit_rank_manifest(step_dir, plan.step, rank=self.rank, world_size=self.world_size,
                                 entries=sorted(entries.values(), key=lambda e: e.path))
            log.info("local step %d: received %d bytes from ranks %s", plan.step, received,
                     sorted({t.src for t in incoming}))
        return received


def written_under(step_dir: Path) -> str:
    """The torch version a local step was written under (its ``fsdp_config.json`` says), "unknown"
    for steps of trainguard versions that did not record it."""
    try:
        return str(json.loads((step_dir / FSDP_CONFIG_NAME).read_text()).get(TORCH_VERSION_KEY, "unknown"))
    except (OSError, ValueError, AttributeError):
        return "unknown"


def _holdings_from(data: dict[str, Any]) -> StepHoldings:
    return StepHoldings(own={k: FileEntry(**v) for k, v in data["own"].items()},
                        replica_extras={int(k): FileEntry(**v) for k, v in data["replica_extras"].items()})
