"""Several models in one checkpoint step (RLHF: an actor, a critic, a frozen reference), as reference 004 lays
them out: ``global_step_N/<role>/``.

```
checkpoints/
├── latest_checkpointed_iteration.txt
├── global_step_N/
│   ├── actor/            a complete durable checkpoint of the role: DCP files, extra state, huggingface/
│   │                     (when the role has ``static_files``), trainguard.json
│   ├── critic/
│   └── trainguard.json   the step's manifest: every file of every role, extra.roles = ["actor", "critic"]
└── ref/                  a frozen role: saved once (model only), never re-saved, never pruned
```

Each trainable role has its own model, optimizer and stateful objects, and is written with the durable
tier's own writer (checksummed as written, fsynced) into ``global_step_N.tmp-<token>/<role>/``, which gets
the role's own manifest once every rank's files of that role are on disk. The step is committed only
when every role is: rank 0 then writes the step's manifest, renames the directory to ``global_step_N``
and updates ``latest_checkpointed_iteration.txt``. A crash during any role's save leaves a ``.tmp-``
directory, which is not a checkpoint: resume restores every role from the previous step.

Per role, ``global_step_N/<role>`` is an ordinary checkpoint directory (``verify_checkpoint``,
``read_full_state_dict``, a merge with ``--local_dir .../global_step_N/actor``); for the step as a whole,
the step's manifest covers every role's files, so discovery, verification, resume and retention treat
the step as one checkpoint. Saves are synchronous; every method is collective.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard.checkpoint.commit import commit_checkpoint, seal
from trainguard.checkpoint.dcp_writer import SaveJob, gather_entries, write_rank_files
from trainguard.checkpoint.durable import DurableCheckpointer
from trainguard.checkpoint.manifest import FileEntry, build_manifest, read_manifest, verify_checkpoint
from trainguard.checkpoint.state_dict import training_state
from trainguard.fs.fsio import clean_stale, commit_directory, remove_directory_crash_safe
from trainguard.fs.layout import extra_state_name, parse_step_dir, step_dir_name, temp_dir_name
from trainguard.checkpoint.resume import choose_resume_checkpoint
from trainguard.checkpoint.retention import retention_after_commit
from trainguard.checkpoint.rng_state import capture_rng_state, restore_rng_state
from trainguard.errors import CheckpointError
from trainguard.events import EventLog
from trainguard.checkpoint.staging import serialised

log = logging.getLogger("trainguard")


@dataclass
class Role:
    """One model of a multi-model run. ``optimizer=None`` makes it frozen: saved once, never re-saved.

    ``static_files(directory)``, when given, writes the role's ``huggingface/`` (config, tokenizer) into its
    folder (rank 0, before the manifest, which covers them), so that a merge of the role folder finds it.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    stateful: dict[str, Any] = field(default_factory=dict)
    static_files: Callable[[Path], None] | None = None

    @property
    def frozen(self) -> bool:
        return self.optimizer is None


def _broadcast(value: Any) -> Any:
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


class RoleCheckpointManager:
    """Saves every role of ``roles`` under ``RUN_DIR/checkpoints/global_step_N/<role>`` and resumes them.

    ``after_role_written(role, step)``, when given, is called on every rank once a role's files are on
    disk and its manifest written (before the next role starts), for progress reports and fault drills.
    """

    def __init__(
        self,
        run_dir: str | Path,
        roles: dict[str, Role],
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        resume: str = "auto",
        events: EventLog | None = None,
        after_role_written: Callable[[str, int], None] | None = None,
    ):
        if not roles or all(role.frozen for role in roles.values()):
            raise ValueError("RoleCheckpointManager needs at least one role with an optimizer")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.roles = dict(roles)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.resume_mode = resume
        self.after_role_written = after_role_written
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.events = events or EventLog(self.run_dir / "events.jsonl", rank=self.rank, host=socket.gethostname())
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in clean_stale(self.root):
                log.warning("removed an unfinished checkpoint left by an earlier run: %s", stale)
        self.token = _broadcast(uuid.uuid4().hex[:12] if self.rank == 0 else None)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # the durable tier's loader, one per role (roles are written with its writer, committed per step)
        self._writers = {
            name: DurableCheckpointer(
                self.root, rank=self.rank, world_size=self.world_size, mesh_shape=[self.world_size],
                mesh_dim_names=["world"], run_token=self.token, process_group=self.group, async_save=False,
                keep_last=keep_last, keep_every=keep_every, events=self.events,
            )
            for name in self.roles
        }

    @property
    def trainable(self) -> list[str]:
        return [name for name, role in self.roles.items() if not role.frozen]

    @property
    def frozen(self) -> list[str]:
        return [name for name, role in self.roles.items() if role.frozen]

    # ------------------------------------------------------------------------------------------ save
    def _write_role(self, name: str, directory: Path, step: int) -> dict[str, FileEntry]:
        """Writes one role into ``directory`` and its manifest; returns its entries (rank 0)."""
        role = self.roles[name]
        directory.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier()
        extra = serialised({"step": step, "rank": self.rank, "world_size": self.world_size, "rng": capture_rng_state(),
                            "stateful": {key: obj.state_dict() for key, obj in role.stateful.items()}})
        job = SaveJob(step, directory, {"step": step, "role": name}, time.perf_counter(),
                      directory / extra_state_name(self.world_size, self.rank), extra)
        state = training_state(role.model, role.optimizer)
        entries, failure = write_rank_files(state, job, self.group)
        known = gather_entries(job, entries, failure, rank=self.rank, world_size=self.world_size,
                               process_group=self.group)
        if self.rank == 0:
            if role.static_files is not None:
                role.static_files(directory)
            manifest = build_manifest(directory, step=step, world_size=self.world_size, mesh_shape=[self.world_size],
                                      mesh_dim_names=["world"], trainer_state=job.trainer_state,
                                      extra={"role": name}, known=known)
            seal(directory, manifest, fsynced=known)
            known = {entry.path: entry for entry in manifest.files}
        if dist.is_initialized():
            dist.barrier()
        if self.after_role_written is not None:
            self.after_role_written(name, step)
        return known

    def _save_frozen(self) -> None:
        """Saves each frozen role once, as ``checkpoints/<role>/`` (committed like a step)."""
        for name in self.frozen:
            final = self.root / name
            exists = _broadcast((final / "trainguard.json").is_file() if self.rank == 0 else None)
            if exists:
                continue
            tmp = self.root / f"{name}.tmp-{self.token}"
            self._write_role(name, tmp, 0)
            if self.rank == 0:
                commit_directory(tmp, final)  # sealed by _write_role; a frozen role is no step: no latest
                self.events.emit("checkpoint_committed", step=0, path=str(final), tier="durable", role=name,
                                 bytes=read_manifest(final).total_size, seconds=0.0)

    def save(self, step: int) -> None:
        """Writes every trainable role of ``step``, then commits the step (frozen roles: the first time only)."""
        started = time.perf_counter()
        self._save_frozen()
        tmp = self.root / temp_dir_name(step, self.token)
        known: dict[str, FileEntry] = {}
        for name in self.trainable:
            for path, entry in self._write_role(name, tmp / name, step).items():
                known[f"{name}/{path}"] = FileEntry(f"{name}/{path}", entry.size, entry.checksum)
        if self.rank == 0:  # each role's own manifest is hashed as a file of the step
            manifest = build_manifest(tmp, step=step, world_size=self.world_size, mesh_shape=[self.world_size],
                                      mesh_dim_names=["world"], trainer_state={"step": step},
                                      extra={"roles": self.trainable, "frozen": self.frozen}, known=known)
            final = commit_checkpoint(tmp, manifest, fsynced=known, replace=True).path
            self.events.emit("checkpoint_committed", step=step, path=str(final), bytes=manifest.total_size,
                             seconds=time.perf_counter() - started, tier="durable", roles=self.trainable)
            self._apply_retention(step)
        if dist.is_initialized():
            dist.barrier()

    def _apply_retention(self, committed: int) -> None:
        steps = [s for s in (parse_step_dir(p.name) for p in self.root.iterdir()) if s is not None]
        for step in retention_after_commit(steps, committed, [], self.keep_last, self.keep_every):
            remove_directory_crash_safe(self.root / step_dir_name(step))
            self.events.emit("checkpoint_deleted", step=step, reason="retention", tier="durable")

    # ---------------------------------------------------------------------------------------- resume
    def _load_role(self, name: str, directory: Path) -> dict[str, Any]:
        role = self.roles[name]
        manifest = read_manifest(directory)
        extra = self._writers[name].load(directory, role.model, role.optimizer, manifest.world_size)
        for key, obj in role.stateful.items():
            if key in extra["stateful"]:
                obj.load_state_dict(extra["stateful"][key])
        return extra

    def resume(self) -> int:
        """Restores every role from the newest committed step that verifies (and each frozen role from its
        own folder); returns the step (0 when there is none)."""
        error = path = None
        if self.rank == 0:
            try:
                chosen = choose_resume_checkpoint(self.resume_mode, self.root, warn=log.warning)
                path = str(chosen) if chosen else None
                for name in self.frozen:
                    if (self.root / name).is_dir():
                        bad = verify_checkpoint(self.root / name)
                        if bad:
                            raise CheckpointError(f"{self.root / name / bad[0].path}: {bad[0].reason}")
            except Exception as exc:
                error = exc
        path, error = _broadcast((path, error))
        if error is not None:
            raise error
        frozen_saved = _broadcast([name for name in self.frozen if (self.root / name).is_dir()]
                                  if self.rank == 0 else None)
        for name in frozen_saved:
            self._load_role(name, self.root / name)
        if path is None:
            return 0
        step_dir = Path(path)
        missing = [name for name in self.trainable if name not in read_manifest(step_dir).extra.get("roles", [])]
        if missing:
            raise CheckpointError(f"{step_dir}: holds no role {missing[0]!r}")
        extras = [self._load_role(name, step_dir / name) for name in self.trainable]
        if read_manifest(step_dir).world_size == self.world_size:
            restore_rng_state(extras[0]["rng"])
        step = int(extras[0]["step"])
        if self.rank == 0:
            self.events.emit("run_started", step=step, resumed_from=path, roles=self.trainable)
        return step
