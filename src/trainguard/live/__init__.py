"""Live recovery: surviving replica groups keep stepping through a rank's death, and its replacement
rejoins at a step boundary, with the same result as a run without the failure (docs/live_recovery.md)."""
