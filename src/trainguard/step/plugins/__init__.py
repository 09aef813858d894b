"""The closure mode's own guards of the step as plugins of its skeleton, each answering with a typed
``StepVerdict``: ``state`` (fingerprints: ROLLBACK for a recompute, ABORT for a struck-out device),
``checkpoint/spike_rollback`` (ROLLBACK, ABORT; live mode asks it too); and ``sdc``, the closure mode's inputs of
the SDC plugin both modes ask (``guards/plugins/sdc.SdcRerun``: RERUN, then SKIP or ABORT). The plugins both step
engines run (data skip, a non-finite norm, the skip streak, SDC detection) are ``guards/plugins/``."""
