"""The step API: ``Guard`` owns what happens between a training loop's backward and its optimizer step."""

from trainguard._lazy import lazy_exports

_EXPORTS = {
    "guard": ("Config", "Guard", "StepOutcome"),
    "builder": ("SkippableData",),  # checkpoint/rollback.py's, the one rollback of both step engines
    "sdc": ("RerunVerdict",),
    "slots": ("Slot",),
    "verdict": ("StepVerdict",),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
