"""The launcher's bound on a stop it asked for (SIGTERM or SIGUSR1 to the launcher: ``quorum.STOP``).

The quorum takes the stop at its next step boundary, or in the epoch after a failed one (``LiveWorker.recover``);
a launcher that waited for ever on ranks that do not (the defect docs/live_recovery.md recorded: a run looping
in failed epochs outlived ``timeout 70`` by 15 minutes) must not. The bound is made of the run's own keys:
the step in flight reaching its boundary (the stall watch's bound, ``fault_tolerance.stall_steps`` median
steps, at least ``stall_s``), a collective failed meanwhile timing out (``collective_timeout_s``) and a silent
rank found (``hang_s``). A durable save in progress is not judged here (a large model's save is slow on its
own: the stall watch judges it): the clock starts again after it. Past the bound the launcher ends every rank
with nothing more saved, as a second signal does, and exits ``EXIT_RESUMABLE_STOP``.
"""

from __future__ import annotations

from dataclasses import dataclass


def stop_bound_s(stall_bound_s: float, collective_timeout_s: float, hang_s: float) -> float:
    return stall_bound_s + collective_timeout_s + hang_s


@dataclass
class StopDeadline:
    """From the launcher's stop request (``since``, monotonic seconds) on: whether the quorum's stop is overdue."""

    since: float

    def overdue(self, now: float, saving: bool, bound_s: float) -> bool:
        """``saving``: a member is inside a durable save now (the clock starts again after it)."""
        if saving:
            self.since = now
            return False
        return now - self.since > bound_s
