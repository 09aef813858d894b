"""Deterministic fault injection for tests and drills, configured by ``TRAINGUARD_FAULTS``."""

from trainguard.faults.injector import FaultInjector, active_faults
from trainguard.faults.spec import FaultSpec, parse_faults

__all__ = ["FaultInjector", "active_faults", "FaultSpec", "parse_faults"]
