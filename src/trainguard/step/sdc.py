"""Silent-data-corruption detection wired into ``Guard.step``.

Per step: the detection points' statistics are read with one host sync, judged by the rule, and a
rank with a level-1 value raises the ``SDC_STOP`` count of the step's all-reduce, so every rank
learns that some rank detected without another collective. After a level-1 detection
(enabled_level ≥ 2) the guard reruns the closure with the RNGs and the data restored; the detecting
ranks compare their values and report their ``RerunVerdict`` through the rerun's all-reduce: the
fault was transient (use the rerun), reproducible (skip the step) or has made their device faulty
(exit 17).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.guards.sdc import (
    STATISTIC,
    DetectionPoints,
    GradientPoints,
    RerunAttribution,
    RerunVerdict,
    SdcConfig,
    SdcDetector,
    StrikeBook,
    format_detection,
    format_values,
)
from trainguard.guards.sdc.detectors import NOT_CHECKED, Detection, SdcLevel
from trainguard.guards.sdc.points import GRADIENT_PREFIX, output_head


class SdcGuard:
    def __init__(self, config: SdcConfig, model: torch.nn.Module, micro_batches: int, device: torch.device,
                 rank: int, host: str, log: logging.Logger, events: EventLog):
        self.config = config
        self.rank, self.host, self.device = rank, host, device
        self.log, self.events = log, events
        statistic = STATISTIC[self.config.rule]
        self.points = DetectionPoints(statistic, micro_batches=micro_batches, device=device,
                                      shares=self.config.peak > 0)
        self.points.install(model, self.config.points, blocks=self.config.blocks, lm_head=self.config.lm_head)
        self.gradients = (GradientPoints(model, statistic, shares=self.config.peak > 0, rows=self.config.row_jump > 0)
                          if self.config.gradients else None)
        # a module point measures this rank's share of the step's batch, which the world size sets; a
        # parameter-gradient point this rank's shard (GradientPoints.layouts)
        self._world = f"world {dist.get_world_size() if dist.is_initialized() else 1}"
        self._gradient_layouts = ([f"{self._world}, {layout}" for layout in self.gradients.layouts]
                                  if self.gradients is not None else [])
        # the loss scale divides out of the statistic: v1's L2 norm scales with it, v3's max(g²) with its square
        self.unscale = self.config.loss_scale ** (1 if statistic == "l2" else 2)
        self._announce(model)
        self.detector = SdcDetector.from_config(self.config, self.names)
        self.detector.restart_changed(self.names, self.layouts)  # records them: no history yet to drop
        self.strikes = StrikeBook(self.config.strikes, self.config.strike_window_hours)
        # strikes are kept per (host, device): on CPU every rank has device index None, so the local rank
        # names the device instead, or the ranks of one host would share their strikes
        local = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", rank))
        self.device_label = f"{device.type}:{local}"
        self.attribution = RerunAttribution(self.strikes, host, self.device_label)
        self.detections: list[Detection] = []
        self.first_values: list[float] = []
        self.first_shares: list[float] | None = None
        self.first_rows: list[float] | None = None

    @property
    def stateful(self) -> dict[str, Any]:
        return {"sdc_detector": _LoadedDetector(self), "sdc_strikes": self.strikes}

    def restart_changed_layouts(self) -> None:
        """After a load: the points whose saved history was taken on another layout (a resume on another
        number of ranks, a state saved without layouts) start a fresh warm-up."""
        restarted = self.detector.restart_changed(self.names, self.layouts)
        if restarted:
            self.log.info("sdc: %d detection point(s) measure another layout than their saved history (%s): "
                          "they start a fresh warm-up", len(restarted), self._layout_change(restarted))

    def begin_pass(self) -> None:
        self.points.reset()
        if self.gradients is not None:
            self.gradients.forget()

    def take_gradient_norms(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The parameter-gradient points' local norms of this pass, for the global norm to reuse; they
        are dropped here, so that the old gradients they hold are not kept alive into the next step."""
        if self.gradients is None:
            return []
        norms = self.gradients.norms
        self.gradients.forget()
        return norms

    @property
    def names(self) -> list[str]:
        """Every point, in the order of ``values()``: module and tensor points, then parameter gradients."""
        return self.points.names + (self.gradients.names if self.gradients is not None else [])

    @property
    def layouts(self) -> list[str]:
        """What each point of ``names`` measures, in the same order: its detector's history is keyed by it."""
        return [self._world] * len(self.points.names) + self._gradient_layouts

    def _layout_change(self, restarted: list[str]) -> str:
        first = restarted[0]
        more = f", and {len(restarted) - 1} more" if len(restarted) > 1 else ""
        return f"{first}: {self.detector.layouts[first]}{more}"

    def _announce(self, model: torch.nn.Module) -> None:
        """Logs how many detection points there are and which; none at all is a configuration error."""
        module_points = self.points.names
        if not self.names:
            raise ConfigError(
                f"guards.sdc: the model ({type(model).__name__}) has no detection point: no norm layer, no "
                "transformer block (guards.sdc.blocks), no parameter gradient (guards.sdc.gradients) and no "
                "guards.sdc.points; add points or set guards.sdc.enabled_level: 0")
        # the output head's point (a grad_output point, like the blocks') is counted with the custom points
        head = 1 if self.config.lm_head and output_head(model) is not None else 0
        norms = sum(1 for name in module_points if self.points.where(name) == "auto") + head
        self.log.info("sdc detection points: %d (norm layers and custom points %d, block outputs %d, parameter "
                      "gradients %d): %s", len(self.names), norms, len(module_points) - norms,
                      len(self.names) - len(module_points), ", ".join(self.names))
        if self.rank == 0:
            self.events.emit("sdc_points", step=0, count=len(self.names), names=self.names)

    def values(self) -> tuple[list[float], list[float] | None, list[float] | None]:
        """This pass's statistic per point and, with the peak criterion on, peak share per point, with
        the row criterion on, row odds per point (``NOT_CHECKED`` for the points without: every module
        point, vectors, embedding tables), in one sync, the loss scale divided out of the statistic (the
        shares and odds are ratios: it cancels)."""
        shares = self.points.shares
        rows = self.gradients is not None and self.gradients.rows
        module_part = self.points.collect(with_shares=shares)
        module_part = module_part if shares else module_part.unsqueeze(0)  # [planes, points]
        if rows:
            module_part = torch.cat([module_part, torch.full_like(module_part[:1], NOT_CHECKED)])
        parts = [module_part]
        if self.gradients is not None:
            gradient_part = self.gradients.collect(with_shares=shares, with_rows=rows)
            gradient_part = gradient_part if shares or rows else gradient_part.unsqueeze(0)
            parts.append(gradient_part.to(module_part.device))
        table = torch.cat(parts, dim=-1).tolist()
        values = table[0]
        if self.unscale != 1.0:
            values = [v / self.unscale if v >= 0 else v for v in values]  # NOT_CHECKED stays negative
        return values, table[1] if shares else None, table[-1] if rows else None

    def check(self, step: int) -> bool:
        """Judges this pass's values; logs and records detections; True when this rank saw a level-1 value."""
        self.first_values, self.first_shares, self.first_rows = self.values()
        if self.config.log_values:
            self.log.info(format_values(step, self.rank, self.host, self.device, self.names, self.first_values))
        self.detections = self.detector.detect(self.first_values, step, names=self.names, shares=self.first_shares,
                                               rows=self.first_rows)
        for detection in self.detections:
            self.log.log(detection.log_level, format_detection(detection, step, self.rank, self.host, self.device))
            self.events.emit("sdc_detected", step=step, point=detection.point, level=detection.level,
                             value=detection.value, thresholds=detection.thresholds, rule=detection.rule,
                             device=self.device_label)
        return any(d.level == SdcLevel.ABNORMAL for d in self.detections)

    @property
    def detected_locally(self) -> bool:
        """This pass saw a level-1 value at a point this rank computed alone (not a reduced gradient,
        which carries every rank's contribution)."""
        return any(d.level == SdcLevel.ABNORMAL and not d.point.startswith(GRADIENT_PREFIX) for d in self.detections)

    def attribute(self, step: int, reran: bool, alone: bool = False) -> RerunVerdict:
        """After the rerun (or, with ``rerun: false``, instead of it): this rank's verdict, NONE when it
        detected nothing at level 1. A transient fault counts only if the rerun is clean. ``alone``: no
        other rank saw a level-1 value at a point of its own at this step."""
        level_one = [d.point for d in self.detections if d.level == SdcLevel.ABNORMAL]
        if not level_one:
            return RerunVerdict.NONE
        names = self.names
        first = {p: self.first_values[names.index(p)] for p in level_one}
        rerun = rerun_shares = rerun_rows = None
        if reran:
            values, shares, rows = self.values()
            rerun = {p: values[names.index(p)] for p in level_one}
            rerun_shares = {p: None if shares is None else shares[names.index(p)] for p in level_one}
            # NOT_CHECKED (negative) odds are no check: the row criterion skips them, as at the first pass
            rerun_rows = {p: None if rows is None else rows[names.index(p)] for p in level_one}
        # a reduced parameter gradient carries every rank's contribution: a fault there may be another
        # rank's, so only the points this rank computed alone can strike it
        local = any(not p.startswith(GRADIENT_PREFIX) for p in level_one)
        attribution = self.attribution.on_detection(step, self.rank, first, rerun, local=local, alone=alone)
        still_abnormal = []
        if attribution.kind == "transient":
            # the detected points' first values never entered their state; the clean rerun's do, as
            # they would have in a run without the fault
            still_abnormal = [p for p in level_one
                              if self.detector.point(p).check(rerun[p], rerun_shares[p], rerun_rows[p]).level
                              == SdcLevel.ABNORMAL]
        self.log.error(attribution.message + (f"; the rerun is abnormal too at {', '.join(still_abnormal)}"
                                              if still_abnormal else ""))
        self.events.emit("sdc_attribution", step=step, attribution=attribution.kind, points=list(attribution.points),
                         strikes=attribution.strikes, faulty=attribution.faulty, device=self.device_label,
                         rerun_abnormal=still_abnormal)
        if attribution.faulty:
            return RerunVerdict.FAULTY
        if attribution.kind == "transient" and not still_abnormal:
            return RerunVerdict.TRANSIENT
        return RerunVerdict.REPRODUCIBLE


class _LoadedDetector:
    """The detector as checkpoints hold it: a load compares the saved history's layouts with this run's
    once, where they can change, not at every step."""

    def __init__(self, guard: SdcGuard):
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        return self.guard.detector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.detector.load_state_dict(state)
        self.guard.restart_changed_layouts()
