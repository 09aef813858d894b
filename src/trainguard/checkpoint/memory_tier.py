"""The memory tier: a checkpoint of every step (or every ``checkpoint.memory_interval``) in node memory.

It is the local tier (per-rank files, replica groups, the buddy's copy of the extra state, recovery
over ``torch.distributed``) kept in node-local shared memory (``/dev/shm``: the files outlive the
training processes, not the node), and saved without stalling the loop: ``save`` captures the extra
state, plans the copy of this rank's local tensors and returns; the copy runs while the next forward
and backward run (``LazySnapshot``), the optimizer step waits for what is left of it, and a background
thread then writes and commits the step (the ring hand-over of the extra state included) on the
tier's own process group. The state is copied straight into the files the step is committed as
(``local.in_place``: one copy per step). A state on CUDA is copied so too where the tier's directory
is in node memory (tmpfs, as the default ``/dev/shm``), the files' mappings page-locked for CUDA (the
side stream's copies are asynchronous only into locked pages); with a ``checkpoint.memory_dir``
elsewhere (a disk, whose mapped pages CUDA may refuse to lock) it goes into pinned staging buffers in
shared memory, which the writer then serialises into the files.

At most one save is in flight, and the loop never waits for one: a ``save`` that finds the previous
step's write still running on any rank (one flag, all-reduced over the tier's own small group: every
rank saves the same steps, as the ring hand-over of the extra state needs) is skipped on every rank
and counted (``skipped``; the next ``local_saved`` event of the tier says how many it follows). Where a
step's write fits in a step, every step reaches the tier, and when a process dies during step S + 1,
step S - 1 at least is committed; where it does not, the tier holds every second (third...) step and
the throughput stays that of no saves (``benchmarks/nostall.py``, RESULTS-gpu.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.background import BackgroundWorker
from trainguard.checkpoint.hashing_file import FAST_TENSOR_SAVE
from trainguard.checkpoint.local.in_place import InPlaceStaging, placeholders
from trainguard.checkpoint.local.paths import SPARE_DIR, rank_file_names
from trainguard.checkpoint.local.state import local_tensors
from trainguard.checkpoint.local.tier import LocalTier
from trainguard.checkpoint.local.writer import model_file_state
from trainguard.checkpoint.snapshot import LazySnapshot, StagingGate
from trainguard.checkpoint.staging import ReusableStager, detached, serialised
from trainguard.checkpoint.state_capture import CaptureCache
from trainguard.checkpoint.writer_process import allocator_for, make_writer
from trainguard.fs.fsio import in_memory_file_system

log = logging.getLogger("trainguard")

DEFAULT_MEMORY_DIR = "/dev/shm/trainguard/{run}/node{node}"
"""``checkpoint.memory_dir``'s default; ``{run}`` is a digest of the run directory's absolute path."""


def run_key(run_dir: Path) -> str:
    """The ``{run}`` of a memory directory: the same run directory finds its memory tier again."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


class MemoryTier:
    def __init__(self, tier: LocalTier, writer: str = "process", busy_group: dist.ProcessGroup | None = None):
        """``tier``: a ``LocalTier`` whose directory is in node memory (``tier="memory"``); ``writer``
        (``checkpoint.writer``): where the rank's files are serialised and written, ``"process"`` (a
        writer process of this rank) or ``"thread"`` (the background thread); ``busy_group``: a gloo
        group of every rank of the tier, used for nothing else (the tier's own group carries the
        background writes' hand-overs, from another thread), over which the ranks agree to skip a save;
        None where the tier has one rank."""
        self.tier = tier
        self.busy_group = busy_group
        self.skipped = 0
        """Saves skipped because a write was still running (see the module's doc), since the start."""
        self._skipped_since_save = 0
        self.files = make_writer(writer, "memory")
        self.files.start()  # its interpreter starts now, beside the run's own start, not in the first save
        self.capture = CaptureCache(_local_training_state, ReusableStager(self._allocate))
        names = rank_file_names(tier.world_size, tier.rank)
        self.in_place = InPlaceStaging(tier.dir / SPARE_DIR, {kind: names[kind] for kind in ("model", "optim")},
                                       {"model": model_file_state(self.files.received(tier.dtensor_layouts)),
                                        "optim": lambda state: state})
        self._staged_in_place = False
        self._gate = StagingGate()
        self._background = BackgroundWorker("trainguard-memory-tier")
        self._inflight: threading.Event | None = None
        self._error: BaseException | None = None

    @property
    def dir(self) -> Path:
        return self.tier.dir

    @property
    def interval(self) -> int:
        return self.tier.interval

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra_state: dict[str, Any]) -> bool:
        """Starts the save of ``step`` and returns True, before the state is copied; or, where a rank's
        previous write is still running, skips it and returns False (see the module's doc)."""
        if self._anyone_busy():
            if not self.skipped:
                log.info("memory tier: step %d not saved, the previous step's write was still running (a save "
                         "finding one in flight is skipped; local_saved events count the skips)", step)
            self.skipped += 1
            self._skipped_since_save += 1
            return False
        self.wait()
        extra = detached(extra_state)  # now: the objects it comes from change at the next step
        capture = self.capture.take(model, optimizer)
        if self._staged_in_place:
            split, staged = self.in_place.stage(capture.plan, capture.split)
        else:
            split, staged = capture.split, capture.plan.staged
        snapshot = LazySnapshot(split)
        self._gate.hold(snapshot, optimizer)
        self._inflight = self._background.run(self._write, snapshot, step, staged, extra, self._skipped_since_save)
        self._skipped_since_save = 0
        return True

    def _anyone_busy(self) -> bool:
        busy = self._inflight is not None and not self._inflight.is_set()
        if self.busy_group is None:
            return busy
        flag = torch.tensor([int(busy)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.busy_group)
        return bool(flag.item())

    def _allocate(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """The staging plan's buffers: placeholders for a state staged in place, shared buffers
        (pinned for one on CUDA) otherwise."""
        # in place only where the records carry no CRC32: headers written for one step's bytes are
        # reused around the next step's
        on_cuda = any(source.device.type == "cuda" for source in sources)
        self._staged_in_place = FAST_TENSOR_SAVE and (not on_cuda or self._in_node_memory())
        return placeholders(sources) if self._staged_in_place else allocator_for(self.files)(sources)

    def _in_node_memory(self) -> bool:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return in_memory_file_system(fd)
        finally:
            os.close(fd)

    def _write(self, snapshot: LazySnapshot, step: int, staged: dict[str, Any], extra_state: dict[str, Any],
               skipped: int) -> None:
        try:
            extra = serialised(extra_state)
            snapshot.copied()
            saved = self.tier.write(step, staged["model"], staged["optim"], extra, files=self.files, skipped=skipped)
            if saved.layout_moved:
                self.in_place.replan()
        except BaseException as exc:  # raised by the next save or wait()
            self._error = exc

    def wait_for_staging(self) -> float:
        """Blocks until the live tensors may change again; returns the seconds blocked."""
        return self._gate.wait()

    def wait(self) -> None:
        """Blocks until the save in flight is committed (and the tier's retention done); raises its error."""
        self.wait_for_staging()
        if self._inflight is not None:
            self._inflight.wait()
            self._inflight = None
        self.tier.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def recover(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                newer_than: int | None) -> tuple[int, dict[str, Any]] | None:
        self.wait()
        return self.tier.recover(model, optimizer, newer_than)

    def discard_newer(self, step: int) -> None:
        self.wait()
        self.tier.discard_newer(step)


def _local_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = local_tensors(model, optimizer)
    return {"model": model_state, "optim": optim_state}
