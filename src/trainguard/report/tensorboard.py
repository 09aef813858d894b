"""TensorBoard scalars of a run (loss, gradient norm, skips, detections, checkpoint health), when installed.

Written from the event log after the fact into ``RUN_DIR/tensorboard/``, so the trainer needs no
TensorBoard dependency and a report of a finished run still gets them.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from trainguard.report.facts import RunFacts

TENSORBOARD_DIR = "tensorboard"


def summary_writer_class():
    """``SummaryWriter`` from torch.utils.tensorboard, or None when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def write_scalars(facts: RunFacts) -> Path | None:
    """Writes the scalars to ``RUN_DIR/tensorboard/`` (replacing an older export); None when unavailable."""
    writer_class = summary_writer_class()
    if writer_class is None:
        return None
    out = facts.run_dir / TENSORBOARD_DIR
    # Rewritten whole each time: appending a second export would draw every curve twice.
    shutil.rmtree(out, ignore_errors=True)
    writer = writer_class(log_dir=str(out))
    try:
        # A step redone after a resume: its last value, as the run's final history holds it.
        final = {p.step: p for p in facts.steps}
        for step, point in sorted(final.items()):
            for tag, value in (("train/loss", point.loss), ("train/global_norm", point.global_norm)):
                if value is not None and math.isfinite(value):
                    writer.add_scalar(tag, value, step, walltime=point.time)
        # Every skip of every attempt: a step skipped and later redone without a spike still shows.
        for skip in facts.skips:
            writer.add_scalar("guards/skipped", 1.0, skip.step, walltime=skip.time)
            if skip.threshold is not None and math.isfinite(skip.threshold):
                writer.add_scalar("guards/skip_threshold", skip.threshold, skip.step, walltime=skip.time)
        per_step: dict[int, int] = {}
        for detection in facts.detections:
            if detection.step is not None:
                per_step[detection.step] = per_step.get(detection.step, 0) + 1
        for step, count in sorted(per_step.items()):
            writer.add_scalar("sdc/detections", count, step)
        for ckpt in facts.checkpoints:
            if ckpt.health is not None:
                writer.add_scalar(f"checkpoint/{ckpt.tier}_unhealthy", float(ckpt.health == "unhealthy"), ckpt.step,
                                  walltime=ckpt.time)
            if ckpt.seconds is not None:
                writer.add_scalar(f"checkpoint/{ckpt.tier}_save_seconds", ckpt.seconds, ckpt.step, walltime=ckpt.time)
        for incident in facts.incidents:
            if incident.recovered_s is not None and incident.last_step is not None:
                writer.add_scalar("recovery/seconds_to_redo_lost_work", incident.recovered_s, incident.last_step,
                                  walltime=incident.time)
    finally:
        writer.close()
    return out
