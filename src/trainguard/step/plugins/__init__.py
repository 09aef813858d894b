"""The closure mode's own guards of the step as plugins of its skeleton, each answering with a typed
``StepVerdict``: ``state`` (fingerprints: ROLLBACK for a recompute, ABORT for a struck-out device), ``sdc``
(RERUN, then SKIP or ABORT), ``checkpoint/spike_rollback`` (ROLLBACK, ABORT; live mode asks it too). The plugins both step engines run (data
skip, a non-finite norm, the skip streak) are ``guards/plugins/``."""
