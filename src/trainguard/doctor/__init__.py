"""``trainguard doctor``: the node self-test (compute burn-in, collectives, storage) run before a node
joins or rejoins a run; the supervisor calls ``self_test`` and excludes a node whose report is unhealthy.

Names are imported on first use: ``trainguard doctor --help`` reads ``defaults`` without importing torch."""

from trainguard._lazy import lazy_exports

_EXPORTS = {
    "report": ("CheckResult", "DoctorReport"),
    "selftest": ("self_test",),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
