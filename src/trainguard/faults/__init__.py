"""Deterministic fault injection for tests and drills, configured by ``TRAINGUARD_FAULTS``."""

from trainguard.faults.injector import FaultInjector
from trainguard.faults.spec import FaultSpec, parse_faults

__all__ = ["FaultInjector", "FaultSpec", "parse_faults"]
