"""The guards of the step as plugins of its skeleton, each answering with a typed ``StepVerdict``:
``state`` (fingerprints: ROLLBACK for a recompute, ABORT for a struck-out device), ``sdc`` (RERUN, then
SKIP or ABORT), ``data_skip`` (SKIP, ABORT), ``spike_rollback`` (ROLLBACK, ABORT), ``nonfinite`` (SKIP),
``skip_streak`` (ABORT)."""
