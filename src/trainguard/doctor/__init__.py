"""``trainguard doctor``: the node self-test (compute burn-in, collectives, storage) run before a node
joins or rejoins a run; the supervisor calls ``self_test`` and excludes a node whose report is unhealthy."""

from trainguard.doctor.report import CheckResult, DoctorReport
from trainguard.doctor.selftest import self_test

__all__ = ["CheckResult", "DoctorReport", "self_test"]
