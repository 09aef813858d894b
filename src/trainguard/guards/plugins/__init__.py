"""The step's guards that both step engines run, as plugins answering a typed ``StepVerdict``:
``data_skip`` (SKIP, ABORT), ``nonfinite`` (SKIP), ``skip_streak`` (ABORT), in the order
``update.update_plugins`` gives them. They judge values every rank holds alike (the closure mode's
all-reduced scalars, live mode's order-fixed sum), through ``step_skips.StepSkips``. ``sdc`` (RERUN, then
APPLY, SKIP or ABORT) is asked by both engines' integrity phase, each mode's collectives behind its inputs
(``sdc.SdcVotes``: the closure mode's ``step/plugins/sdc.py``, live mode's ``live/sdc.py``). The plugins that
need the closure mode's collectives or checkpoints (state, rollback mode) are ``step/plugins/``."""
