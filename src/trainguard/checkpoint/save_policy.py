"""When each checkpoint tier saves a step: the save policy, pure.

- durable: every ``save_interval`` steps (0: never periodically), at the last step of the schedule
  when periodic saves are on, and always before a stop (``stopping``: a planned stop, a signal, the
  kill switch, a faulty device: the run is meant to go on later from there);
- local: every ``local_interval`` steps on schedule only (a stop's save goes to the durable tier),
  and never a step judged unhealthy: auto resume prefers a local step to an older durable one and
  would bring it back (the durable copy is kept, marked, for inspection);
- memory: every ``memory_interval`` steps, by the local tier's rules;
- no tier saves the same step twice (a stop right after a scheduled save, or right after resume).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SaveDecision:
    durable: bool
    local: bool
    memory: bool = False

    def __bool__(self) -> bool:
        return self.durable or self.local or self.memory


def decide_save(step: int, *, save_interval: int, local_interval: int, last_step: bool, stopping: bool,
                unhealthy: bool, durable_saved: int | None, local_saved: int | None, memory_interval: int = 0,
                memory_saved: int | None = None) -> SaveDecision:
    """``durable_saved``/``local_saved``/``memory_saved``: the step each tier last saved (or resumed
    from), None if none."""
    periodic = bool(save_interval) and step % save_interval == 0
    durable = durable_saved != step and (stopping or periodic or (last_step and save_interval > 0))

    def per_rank(interval: int, saved: int | None) -> bool:
        return not stopping and bool(interval) and step % interval == 0 and not unhealthy and saved != step

    return SaveDecision(durable, per_rank(local_interval, local_saved), per_rank(memory_interval, memory_saved))
