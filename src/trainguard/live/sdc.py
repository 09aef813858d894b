"""Silent-data-corruption detection with its rerun on a live step (``guards.sdc.*``, docs/sdc.md).

The verdict is the closure mode's plugin's (``guards/plugins/sdc.SdcRerun``: RERUN, then APPLY, SKIP or
ABORT with an exclusion), asked by live mode's step (``live/worker.LiveStep``) through the same
``decide_step``; ``LiveSdcVotes`` is its inputs here. They are agreed by construction, as the skip decisions
are (``step_judge``): every rank judges values that every member holds alike after the step's sum, with
the same detector state.

- **Module points** (norm layers, blocks, the output head, ``guards.sdc.points``): each micro-batch's
  statistics (and peak shares) ride beside its gradient in the sum's extras (``ordered_sum``), so every
  rank receives every micro-batch's values bitwise as the rank that computed it measured them, and
  takes each point's maximum over the step's micro-batches: the closure mode's value for a rank that
  computed the whole global batch, whatever the membership. With an FSDP2 model (``fsdp_share``), which
  accumulates a rank's micro-batches itself, each micro-batch's values are read after its own backward
  inside the share and ride after the flags of ``group_reduce.reduce_partials`` the same way.
  With tensor parallel (``tp`` > 1) the ``tp`` ranks of a slot compute the same micro-batches, each on its
  own part of the activations: a module's gradient is whole on every tp rank where tp replicates it, and
  a piece where tp splits it (a column-wise layer's output: its columns), and the hooks see a plain local
  tensor either way, so which one it is cannot be told there. Each tp rank's value is then a point of its
  own, ``NAME (tp T)``, as the closure mode's TP ranks each judge their own: the same quantity as without
  tensor parallel where tp replicates the gradient, the statistic of tp rank T's piece where it splits it.
  Each micro-batch's extras hold one block per tp rank, filled by that rank alone (zeros elsewhere), so
  each block too is added to zeros only.
- **Parameter-gradient points** are read on the summed gradient as this rank holds it: whole with
  whole replicas; with parameters sharded inside replica groups (``dp_shard`` > 1: ``sharded_params``'
  rows, or FSDP2's ``Shard(0)`` DTensor, whose local tensor is the same rows), its shard's rows, measured
  as the closure mode's FSDP2 ranks measure theirs,
  and one all-gather gives every member the values of every shard of its group (``over_shards``;
  every group's shards are bitwise equal), each shard a point of its own (``grad:NAME (shard S)``).

So the detectors' state is every rank's alike; it travels with the guards' counters (a joiner's
transfer, the undo of a step, the durable checkpoint's extra state).

**The rerun.** After a level-1 detection (``enabled_level >= 2``) every member recomputes its
micro-batches of the step (same inputs, same seeded draws; with FSDP2, its shares) and the quorum sums
again. Each
micro-batch's extras and the summed gradient are compared bitwise with the first pass's (a sharded
rank compares its shard's, and whether any shard differs rides in one all-gather): a micro-batch
that differs is a transient fault of the rank that computed it (with tensor parallel, of each tp rank
whose block differs; a strike against that rank; the rerun's sum is used if its values are clean, else
the step is skipped); a difference in the sum alone
(a fault outside every module point, seen at a reduced parameter gradient) is transient with no rank
to blame, as the closure mode's reduced points strike no one; no difference: reproducible, the step
is skipped, and it is a strike when one rank alone computed the micro-batches holding the abnormal
values at module points. ``rerun: false``: unverified, skipped, no strike.

**Strikes and exclusion.** Strikes are kept per rank of the run (the book is every rank's alike, so
its key is the rank, not a host and device only that rank knows; a strike's time is the quorum's first
member's clock, carried in the rerun's all-reduce). A restart cannot exclude a device
here: a rank that reaches ``strikes`` writes its own ``faulty_ranks.json`` entry (its host and
device) and exits 17 at the step boundary (live mode's reaction to the plugin's ABORT with an exclusion:
the step goes on, its update as the exclusion says, and is saved first); the launcher takes that as a
death, its replica group leaves the quorum, and a spare (or a fresh process) takes the rank; when it
joins, every member drops the rank's strikes, which were its predecessor's.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.guards.sdc import (STATISTIC, DetectionPoints, FaultyDeviceError, GradientPoints, RerunVerdict,
                                   SdcConfig, SdcDetector, StrikeBook, faulty_ranks_path, format_detection,
                                   format_values, write_faulty_ranks)
from trainguard.guards.sdc.detectors import NOT_CHECKED, Detection, SdcLevel
from trainguard.guards.sdc.points import GRADIENT_PREFIX
from trainguard.guards.plugins.sdc import RerunOutcome
from trainguard.guards.step_plugin import StepCheck
from trainguard.guards.step_slots import Slot
from trainguard.guards.step_verdict import StepVerdict
from trainguard.live.group_reduce import StepSum

STRIKE_HOST = "live"  # the strike book's host for every rank: ranks are its keys (see the module's docstring)

CLOCK_BASE = 4096  # the reporter's clock rides in the rerun's flags as two integers below 2**24: exact in float32

# a value of this rank's shape -> that value of every shard of its replica group, ``[shards, *shape]`` in
# shard order, every member alike (a collective); with whole replicas the value alone
OverShards = Callable[[torch.Tensor], torch.Tensor]


def one_shard(value: torch.Tensor) -> torch.Tensor:
    """``OverShards`` of whole replicas."""
    return value.unsqueeze(0)


def clock_flags(reports: bool) -> list[int]:
    """This rank's part of the strikes' agreed time: the quorum's first member's clock, whole seconds."""
    now = int(time.time()) if reports else 0
    return [now // CLOCK_BASE, now % CLOCK_BASE]


def strike_device(rank: int) -> str:
    return f"rank {rank}"


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def _sum_bits(summed: StepSum) -> bytes:
    return _bits(summed.gradient) + _bits(torch.tensor([summed.loss], dtype=torch.float64))


class LiveSdc:
    def __init__(self, config: SdcConfig, model: torch.nn.Module, micro_batches: int, rank: int, run_dir: Path,
                 log: logging.Logger, events: EventLog, reports: Callable[[], bool], shards: int = 1,
                 over_shards: OverShards = one_shard, tp: int = 1, tp_rank: int = 0):
        self.config, self.rank, self.run_dir = config, rank, run_dir
        self.micro_batches = micro_batches
        # the shards of a replica group (``sharded_params``): each rank holds its shard's gradient rows
        self.shards, self.over_shards = shards, over_shards
        # tensor parallel: this rank's coordinate among the ``tp`` ranks that compute a slot's micro-batches
        self.tp, self.tp_rank = tp, tp_rank
        self.log, self.events, self.reports = log, events, reports
        statistic = STATISTIC[config.rule]
        self.shares, self.rows = config.peak > 0, config.gradients and config.row_jump > 0
        self.points = DetectionPoints(statistic, shares=self.shares)
        self.points.install(model, config.points, blocks=config.blocks, lm_head=config.lm_head)
        self.gradients = (GradientPoints(model, statistic, shares=self.shares, rows=self.rows)
                          if config.gradients else None)
        if not self.names:
            raise ConfigError(f"guards.sdc: the model ({type(model).__name__}) has no detection point; add "
                              "guards.sdc.points or set guards.sdc.enabled_level: 0")
        self.unscale = config.loss_scale ** (1 if statistic == "l2" else 2)
        self.detector = SdcDetector.from_config(config, self.names)
        self.detector.restart_changed(self.names, self.layouts)
        self.strikes = StrikeBook(config.strikes, config.strike_window_hours)
        self.host = socket.gethostname()
        self.device_label = f"cpu:{os.environ.get('LOCAL_RANK', rank)}"
        self.log.info("sdc detection points in live mode: %d (module points %d, parameter gradients %d): %s",
                      len(self.names), len(self.module_names), len(self.names) - len(self.module_names),
                      ", ".join(self.names))
        if rank == 0:  # as the closure mode's rank 0 (a replacement of rank 0 says it again)
            self.events.emit("sdc_points", step=0, count=len(self.names), names=self.names)

    @property
    def module_names(self) -> list[str]:
        """The module points, each tp rank's a point of its own with tensor parallel, tp rank by tp rank."""
        if self.tp == 1:
            return self.points.names
        return [f"{name} (tp {tp_rank})" for tp_rank in range(self.tp) for name in self.points.names]

    @property
    def names(self) -> list[str]:
        """Every point: module points (their values from the extras), then parameter gradients (each
        shard's, shard by shard, when the parameters are sharded)."""
        gradients = self.gradients.names if self.gradients is not None else []
        if self.shards > 1:
            gradients = [f"{name} (shard {shard})" for shard in range(self.shards) for name in gradients]
        return self.module_names + gradients

    @property
    def layouts(self) -> list[str]:
        """What each point measures: the step's whole global batch (module points; with tensor parallel, one
        tp rank's part of it), the summed gradient (parameter gradients: whole, or a shard of a group of
        ``shards``); none depends on the membership."""
        whole = f"live, the maximum over {self.micro_batches} micro-batches"
        module = ([whole] * len(self.points.names) if self.tp == 1 else
                  [f"{whole}, tp rank {tp_rank} of {self.tp}" for tp_rank in range(self.tp)
                   for _ in self.points.names])
        sharded = f" of {self.shards} shards" if self.shards > 1 else ""
        return module + [f"live{sharded}, {name}" for name in self.names[len(module):]]

    @property
    def planes(self) -> int:
        return 2 if self.shares else 1

    @property
    def width(self) -> int:
        """The extras of one micro-batch: each module point's statistic (and peak share), for each tp rank."""
        return self.planes * len(self.module_names)

    def begin_step(self) -> None:
        self.points.reset()

    def micro_batch_values(self) -> torch.Tensor:
        """The module points' values of the micro-batch just computed, ``[width]``: ``[planes, tp, points]``
        flat, this rank's tp block filled and the others' zeros (their ranks fill them); resets them."""
        row = torch.zeros(self.planes, self.tp, len(self.points.names))
        row[:, self.tp_rank] = self.points.collect(with_shares=self.shares).reshape(self.planes, -1)
        return row.reshape(-1)

    def state(self) -> dict[str, Any]:
        return {"sdc_detector": self.detector.state_dict(), "sdc_strikes": self.strikes.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["sdc_detector"])
        self.strikes.load_state_dict(state["sdc_strikes"])

    def forget(self, ranks: list[int]) -> None:
        """The ranks that join: their strikes were their predecessors' (struck out, or dead)."""
        for rank in ranks:
            self.strikes.forget(STRIKE_HOST, strike_device(rank))

    def by_point(self, extras: torch.Tensor) -> torch.Tensor:
        """The extras ``[micro_batches, width]`` as ``[micro_batches, planes, module points]``, in
        ``module_names`` order."""
        return extras.view(extras.shape[0], self.planes, len(self.module_names))

    def by_tp_rank(self, extras: torch.Tensor) -> torch.Tensor:
        """The extras as ``[micro_batches, tp, planes x points]``: each tp rank's block of each micro-batch."""
        blocks = extras.view(extras.shape[0], self.planes, self.tp, len(self.points.names)).transpose(1, 2)
        return blocks.reshape(extras.shape[0], self.tp, -1)

    def tp_rank_of(self, point: str) -> int:
        """The tp rank whose part module point ``point`` measures (0 without tensor parallel)."""
        return self.module_names.index(point) // len(self.points.names)

    def values(self, extras: torch.Tensor) -> tuple[list[float], list[float] | None, list[float] | None]:
        """Each point's statistic, peak share (peak criterion on) and row odds (row criterion on), in
        ``names`` order, from the step's extras ``[micro_batches, width]`` and the gradients set."""
        module = self.by_point(extras).amax(dim=0)  # NaN propagates
        if self.rows:
            module = torch.cat([module, torch.full_like(module[:1], NOT_CHECKED)])
        parts = [module]
        if self.gradients is not None:
            part = self.gradients.collect(with_shares=self.shares, with_rows=self.rows)
            self.gradients.forget()
            part = part if self.shares or self.rows else part.unsqueeze(0)  # [planes, parameters]
            # every shard's, shard by shard: [planes, shards x parameters], in ``names`` order
            parts.append(self.over_shards(part).transpose(0, 1).reshape(part.shape[0], -1))
        table = torch.cat(parts, dim=-1).tolist()
        values = table[0] if self.unscale == 1.0 else [v / self.unscale if v >= 0 else v for v in table[0]]
        return values, table[1] if self.shares else None, table[-1] if self.rows else None

    def holders(self, extras: torch.Tensor, point: str, value: float) -> list[int]:
        """The micro-batches whose value at module ``point`` is the step's ``value`` (its maximum)."""
        column = self.by_point(extras)[:, 0, self.module_names.index(point)] / self.unscale
        return [m for m, own in enumerate(column.tolist()) if own == value or (own != own and value != value)]

    def detect(self, step: int, computed_by: list[int], first: StepSum) -> list[Detection]:
        """Judges step ``step`` (the closure mode's number) from its sum's extras and the gradients set, with
        the detection's lines and events; its level-1 detections. ``computed_by``: the rank that computed
        each micro-batch (with tensor parallel, its slot's first tp rank)."""
        extras = first.extras
        values, shares, rows = self.values(extras)
        if self.config.log_values:
            self.log.info(format_values(step, self.rank, self.host, self.device_label, self.names, values))
        detections = self.detector.detect(values, step, names=self.names, shares=shares, rows=rows)
        for detection in detections:
            self.report_detection(step, computed_by, extras, detection)
        return [d for d in detections if d.level == SdcLevel.ABNORMAL]

    def after_rerun(self, step: int, computed_by: list[int], first: StepSum, level_one: list[Detection],
                    again: StepSum | None) -> RerunOutcome:
        """The attribution of the ``level_one`` detections of step ``step`` by its rerun's sum ``again`` (None:
        ``rerun: false``, unverified), every rank's alike; ``RerunOutcome.strongest`` TRANSIENT (or FAULTY with
        ``update`` APPLY): the rerun's sum is clean, the step goes on with it."""
        if again is None:
            self.attribute(step, "unverified", level_one, blamed=[], struck=False, rerun_abnormal=[])
            return self.conclude(step, RerunVerdict.REPRODUCIBLE, reran=False, blamed=[], faulty=())
        extras, clock, again_extras = first.extras, again.flags, again.extras
        now = float(clock[0] * CLOCK_BASE + clock[1])  # every rank's alike: strikes agree, times included
        first_blocks, again_blocks = self.by_tp_rank(extras), self.by_tp_rank(again_extras)
        differing = [(m, tp_rank) for m in range(extras.shape[0]) for tp_rank in range(self.tp)
                     if _bits(first_blocks[m, tp_rank]) != _bits(again_blocks[m, tp_rank])]
        # this rank's sum (whole, or its shard): whether any shard's differs, every member alike
        sum_differs = bool(self.over_shards(torch.tensor([float(_sum_bits(first) != _sum_bits(again))])).any())
        if differing or sum_differs:
            blamed = sorted({computed_by[m] + tp_rank for m, tp_rank in differing})
            # the first values never entered the detected points' state; the clean rerun's do, as they
            # would have in a run without the fault
            again_values, again_shares, again_rows = self.values(again_extras)
            index = {name: i for i, name in enumerate(self.names)}
            still = [d.point for d in level_one
                     if self.detector.point(d.point).check(
                         again_values[index[d.point]], None if again_shares is None else again_shares[index[d.point]],
                         None if again_rows is None else again_rows[index[d.point]]).level == SdcLevel.ABNORMAL]
            faulty = self.attribute(step, "transient", level_one, blamed, struck=True, rerun_abnormal=still,
                                    now=now)
            verdict = RerunVerdict.FAULTY if faulty else (RerunVerdict.REPRODUCIBLE if still
                                                          else RerunVerdict.TRANSIENT)
            return self.conclude(step, verdict, reran=True, blamed=blamed, faulty=faulty,
                                 update=StepVerdict.SKIP if still else StepVerdict.APPLY)
        # reproducible: a strike only when one rank alone computed what is abnormal at module points
        local = [d for d in level_one if not d.point.startswith(GRADIENT_PREFIX)]
        holders = sorted({computed_by[m] + self.tp_rank_of(d.point) for d in local
                          for m in self.holders(extras, d.point, d.value)})
        alone = len(holders) == 1
        faulty = self.attribute(step, "reproducible", level_one, holders if alone else [], struck=alone,
                                rerun_abnormal=[d.point for d in level_one], now=now)
        return self.conclude(step, RerunVerdict.FAULTY if faulty else RerunVerdict.REPRODUCIBLE, reran=True,
                             blamed=holders if alone else [], faulty=faulty)

    def report_detection(self, step: int, computed_by: list[int], extras: torch.Tensor,
                         detection: Detection) -> None:
        """The closure mode's line on every rank (this rank's judgement), its event once, naming the ranks
        that computed the abnormal value (none for a parameter gradient: the sum carries every rank's)."""
        self.log.log(detection.log_level, format_detection(detection, step, self.rank, self.host, self.device_label))
        if not self.reports():
            return
        computed_by = ([] if detection.point.startswith(GRADIENT_PREFIX) else
                       sorted({computed_by[m] + self.tp_rank_of(detection.point)
                               for m in self.holders(extras, detection.point, detection.value)}))
        self.events.emit("sdc_detected", step=step, point=detection.point, level=detection.level,
                         value=detection.value, thresholds=detection.thresholds, rule=detection.rule,
                         device=self.device_label, computed_by=computed_by)

    def attribute(self, step: int, kind: str, level_one: list[Detection], blamed: list[int], struck: bool,
                  rerun_abnormal: list[str], now: float | None = None) -> tuple[int, ...]:
        """Records a strike against each ``blamed`` rank when ``struck`` (every rank alike: the book is
        agreed), logs the attribution and emits its event (by the blamed rank itself, or the quorum's
        first when no rank is blamed); returns the ranks now faulty."""
        points = [d.point for d in level_one]
        what = {"transient": "rerun differs: transient fault, the rerun's gradients are used",
                "reproducible": "rerun identical: the data, the math or a persistent fault, the step is skipped",
                "unverified": "no rerun: the step is skipped"}[kind]
        if kind == "transient" and rerun_abnormal:
            what = "rerun differs: transient fault, but the rerun is abnormal too: the step is skipped"
        faulty = []
        for rank in blamed or [None]:
            strikes, is_faulty = 0, False
            if rank is not None and struck:
                is_faulty = self.strikes.record(rank, STRIKE_HOST, strike_device(rank), step,
                                                {"kind": kind, "points": points}, now)
                strikes = self.strikes.count(STRIKE_HOST, strike_device(rank), now)
            tally = (f"strike {strikes} of {self.strikes.strikes} within {self.strikes.window_hours:g} h"
                     if rank is not None and struck else "no strike")
            self.log.error(f"sdc attribution: step {step}, rank {rank if rank is not None else 'none'}, points "
                           f"{', '.join(points)}: {what}; {tally}" + ("; the rank is faulty" if is_faulty else ""))
            if rank == self.rank or (rank is None and self.reports()):
                self.events.emit("sdc_attribution", step=step, attribution=kind, points=points, strikes=strikes,
                                 faulty=is_faulty, device=self.device_label, rerun_abnormal=rerun_abnormal)
            if is_faulty:
                faulty.append(rank)
        return tuple(faulty)

    def conclude(self, step: int, verdict: RerunVerdict, reran: bool, blamed: list[int], faulty: tuple[int, ...],
                 update: StepVerdict = StepVerdict.SKIP) -> RerunOutcome:
        """The ``sdc_rerun`` event, once; ``update``: the step's apart from the ``faulty`` ranks."""
        if self.reports():
            labels = {str(rank): (RerunVerdict.FAULTY if rank in faulty else verdict).label_after(reran)
                      for rank in blamed}
            self.events.emit("sdc_rerun", step=step, verdict=verdict.label_after(reran), reran=reran, ranks=blamed,
                             verdicts=labels)
        return RerunOutcome(verdict, faulty, update)

    def strike(self, rank: int, step: int, evidence: dict[str, Any], now: float, why: str) -> bool:
        """A strike against ``rank`` from outside the rerun (a replica fingerprint attributed to it: ``why``),
        recorded by every member alike at the agreed time ``now``, with its line; whether the rank is now
        faulty (``leave_if_struck_out``)."""
        is_faulty = self.strikes.record(rank, STRIKE_HOST, strike_device(rank), step, evidence, now)
        strikes = self.strikes.count(STRIKE_HOST, strike_device(rank), now)
        self.log.error(f"sdc strike: step {step}, rank {rank}: {why}; strike {strikes} of {self.strikes.strikes} "
                       f"within {self.strikes.window_hours:g} h" + ("; the rank is faulty" if is_faulty else ""))
        return is_faulty

    def leave_if_struck_out(self, faulty: tuple[int, ...]) -> None:
        """At the step boundary: this rank reached its strike limit. Writes its own ``faulty_ranks.json``
        entry (its host and device) and ends the process (exit 17); the others go on without its group."""
        if self.rank not in faulty:
            return
        entries = [dict(entry, host=self.host, local_device=self.device_label)
                   for entry in self.strikes.faulty_entries() if entry["local_device"] == strike_device(self.rank)]
        write_faulty_ranks(faulty_ranks_path(self.run_dir), entries)
        raise FaultyDeviceError(f"faulty hardware: rank {self.rank} reached {self.config.strikes} strikes (SDC "
                                f"strikes); see {faulty_ranks_path(self.run_dir)}; its replica group leaves the "
                                "quorum and the rank is replaced")


class LiveSdcVotes:
    """``guards/plugins/sdc.SdcVotes`` of one live step: ``LiveSdc`` judges its ``first`` sum (and its rerun's),
    whose values every member holds alike, so nothing is reduced for the verdict but the rerun's sum itself,
    whose flags carry the strikes' agreed time (``clock_flags``). ``computed_by``: the rank that computed
    each micro-batch."""

    def __init__(self, sdc: LiveSdc, computed_by: list[int], first: StepSum):
        self.sdc, self.computed_by, self.first = sdc, computed_by, first
        self.level_one: list[Detection] = []  # the step's level-1 detections (``detected``)

    @property
    def config(self) -> SdcConfig:
        return self.sdc.config

    def flags(self, step: int) -> dict[Slot, Any]:
        return {}  # the values ride in the sum's extras

    def detected(self, check: StepCheck) -> bool:
        self.level_one = self.sdc.detect(check.step, self.computed_by, self.first)
        return bool(self.level_one)

    def rerun_flags(self, step: int, reran: bool) -> list[int]:
        return clock_flags(self.sdc.reports())

    def after_rerun(self, step: int, rerun: StepSum | None, reran: bool) -> RerunOutcome:
        return self.sdc.after_rerun(step, self.computed_by, self.first, self.level_one, rerun)
