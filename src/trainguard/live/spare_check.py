"""A warm spare's self-test before it says it is ready: the node doctor's burn-in of its device and its
storage check of the run's checkpoint directory (``trainguard doctor``'s checks, in the spare's own
process: a spare is one process of its node). A spare that fails is never handed a rank; the launcher
passes it over for the next spare, or a cold start.

The collective check of ``trainguard doctor`` needs the node's other local ranks, which a lone spare
does not have; its collectives are checked by the join itself (a failed one ends the epoch).
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from trainguard.doctor.burnin import burn_in
from trainguard.doctor.report import DoctorReport
from trainguard.doctor.defaults import DEFAULT_REPS
from trainguard.doctor.selftest import default_size
from trainguard.doctor.storage import check_storage
from trainguard.faults.spec import parse_faults

STORAGE_MB = 8  # enough to see a read-only or full disk and a checksum mismatch, short on a shared node


def check_spare(run_dir: Path, spare: int, faults: str | None) -> DoctorReport:
    """``faults``: ``miscompute`` entries (the live drill's, ``live.drill``), ``rank=`` naming the spare
    they act on (default: every spare)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mine = [spec for spec in parse_faults(faults) if spec.rank is None or spec.rank == spare]
    checks = [burn_in(device, DEFAULT_REPS, default_size(), faults=mine, target=f"spare {spare} ({device})"),
              check_storage(run_dir / "checkpoints", STORAGE_MB)]
    return DoctorReport(socket.gethostname(), 1, checks)
