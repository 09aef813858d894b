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
layout is not resumed from. The closure mode's buddy copies of the extra state, its repair of a rank's
missing files from a replica and the memory tier's lazy copy by a writer process are not done here: a
rank that lacks a step (its node's directory lost) makes the job resume from an older step or the
durable tier.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint.local.paths import FSDP_CONFIG_NAME, TORCH_VERSION_KEY, node_of, rank_file_names, resolve_local_dir
from trainguard.checkpoint.local.reader import KINDS, rank_holdings
from trainguard.checkpoint.local.writer import clean_rank_leftovers, prune, rank_steps, remove_rank_step, save_rank_step
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.checkpoint.staging import serialised
from trainguard.errors import CheckpointError
from trainguard.events import EventLog
from trainguard.fs.layout import step_dir_name
from trainguard.run_secret import owner_only_dir

log = logging.getLogger("trainguard")

LIVE_LAYOUT_KEY = "live"  # fsdp_config.json's record of the live layout a step was saved in


@dataclass(frozen=True)
class ResumePoint:
    """Where a whole job resumes: ``tier`` ``"durable"`` (``step`` None: a fresh start), ``"memory"`` or
    ``"local"``."""
    tier: str
    step: int | None


def choose_live_resume(durable_step: int | None, held: dict[str, Sequence[Sequence[int]]]) -> ResumePoint:
    """The newest step that every rank holds in one per-rank tier (``held``: tier -> each rank's verified
    steps, the tiers in order of preference at an equal step), when it is newer than the durable
    checkpoint's ``durable_step`` (None: there is none); else the durable checkpoint."""
    best = ResumePoint("durable", durable_step)
    for tier, ranks in held.items():
        common = set.intersection(*(set(steps) for steps in ranks)) if ranks else set()
        newest = max(common, default=None)
        if newest is not None and (best.step is None or newest > best.step):
            best = ResumePoint(tier, newest)
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
        self.dir = resolve_local_dir(template, run_dir, node=node_of(rank, ranks_per_node), rank=rank)
        self.layout = {"world_size": world, "group_size": group_size}
        self.last_saved: int | None = None  # the step this rank last saved here (or resumed from)
        self._pruner: threading.Thread | None = None
        owner_only_dir(self.dir, f"the live {tier} tier's directory")
        clean_rank_leftovers(self.dir, world, rank)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Writes this rank's ``state`` (``LiveState.state_dict``) of ``step``, committed by its rank manifest."""
        self.wait()
        owner_only_dir(self.dir, f"the live {self.tier} tier's directory")  # a wiped node's directory comes back
        saved = save_rank_step(self.dir, step, rank=self.rank, world_size=self.world, model_state=state["model"],
                               optim_state=state["optimizer"],
                               extra_state=serialised({"step": step, **run_state(state)}), replica_extras={},
                               fsdp_config={LIVE_LAYOUT_KEY: self.layout, TORCH_VERSION_KEY: torch.__version__})
        self.last_saved = step
        self.events.emit("local_saved", step=step, bytes=saved.bytes, seconds=saved.seconds, path=str(self.dir),
                         tier=self.tier)
        # deleting old files costs about as much as writing them: off the training path
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

    def discard_newer(self, step: int) -> None:
        """Drops this rank's steps after ``step``: a timeline the job did not continue."""
        self.wait()
        for newer in rank_steps(self.dir, self.world, self.rank):
            if newer > step:
                remove_rank_step(self.dir, newer, self.world, self.rank)
