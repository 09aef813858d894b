"""The typed verdicts of a step's guards and the precedence that turns them into the step's one decision.

Each guard of the step is a plugin (``guards/plugins/``, ``step/plugins/``) that, asked at its place in the step skeleton's
fixed order, answers with a ``StepVerdict``. ``decide`` applies the precedence the step has always had:

- the plugins are asked in order, and only while no earlier one has decided (a plugin that
  ``watches_every_step``, the skip streak, is asked whatever was decided, to count skipped steps);
- a RERUN or a ROLLBACK is carried out at once, before any later plugin is asked: the rerun's scalars
  are what the later plugins judge (an SDC detection reruns before the data skip is decided), and a
  rollback that finds nothing to restore lets the step go on as if nothing had been decided;
- ABORT wins over everything and ends the step, and so does a rollback carried out; otherwise the first
  SKIP stands.

Every rank holds the same reduced scalars and guard state, so every rank reaches the same decision.
Pure logic: the asking and the carrying out are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Generic, Protocol, TypeVar


class StepVerdict(IntEnum):
    """What a guard asks of the step; the larger, the stronger."""

    APPLY = 0  # no objection: the optimizer and the scheduler step
    SKIP = 1  # drop this step's update
    RERUN = 2  # run the step's forward and backward again before judging it (SDC attribution)
    ROLLBACK = 3  # restore an earlier checkpoint instead of taking the step
    ABORT = 4  # end the run


ENDS_THE_STEP = (StepVerdict.ROLLBACK, StepVerdict.ABORT)


class Watching(Protocol):
    # asked even after an earlier plugin decided (the skip streak counts every skipped step)
    watches_every_step: bool


Plugin = TypeVar("Plugin", bound=Watching)


@dataclass(frozen=True)
class Decision(Generic[Plugin]):
    verdict: StepVerdict
    # the plugin whose verdict it is; None for APPLY
    by: Plugin | None


def decide(plugins: Sequence[Plugin], ask: Callable[[Plugin, StepVerdict], StepVerdict],
           carry_out: Callable[[Plugin, StepVerdict], StepVerdict],
           decided: Decision[Plugin] | None = None) -> Decision[Plugin]:
    """Asks ``plugins`` in order (``ask(plugin, verdict so far)``); ``carry_out(plugin, RERUN or ROLLBACK)``
    does it and returns the verdict that stands: the plugin's after a rerun (never RERUN again),
    ROLLBACK once restored, APPLY when there was nothing to restore. ``decided``: the decision of an
    earlier phase of the same step, which this one goes on from."""
    decision = decided if decided is not None else Decision(StepVerdict.APPLY, None)
    for plugin in plugins:
        if decision.verdict in ENDS_THE_STEP:
            break
        if decision.verdict is not StepVerdict.APPLY and not plugin.watches_every_step:
            continue
        verdict = ask(plugin, decision.verdict)
        if verdict in (StepVerdict.RERUN, StepVerdict.ROLLBACK):
            verdict = carry_out(plugin, verdict)
            if verdict is StepVerdict.RERUN:
                raise ValueError(f"{type(plugin).__name__} asked for a second rerun of one step")
        if verdict > decision.verdict:
            decision = Decision(verdict, plugin)
    return decision
