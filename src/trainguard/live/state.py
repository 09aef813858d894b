"""A live rank's state, in the three parts that move differently through a live run.

- **Its shard**: the model's parameters and the optimizer's state (this rank's rows of them in a sharded
  replica group, ``sharded_params``). A joiner receives it from a live replica of its shard.
- **The engine's run state**: the guards' counters and windows (``step_judge``) and the LR scheduler,
  both stepped by the engine with each update (the scheduler with the optimizer, never on a skipped
  step, as the closure mode's), and the report of the last committed step (``committed``: what
  ``guard.step`` returns). Every member holds them alike; they are undone with the shard when a
  member undoes a step, and a joiner takes the quorum's lowest live rank's: the call in which a rank
  rejoins returns the step it rejoined at, as that rank committed it, so its loop goes on from the
  same boundary as the survivors' loops.
- **The loop's objects** (``Guard(stateful=...)``): the user's own bookkeeping (a data position, a
  counter), updated by the loop *before* each ``guard.step`` call (as the closure mode's data loader
  advances before the step that saves it), never inside ``loss_of`` (which must stay a pure function
  of the step, the micro-batch and the parameters, or survivors could not compute a lost group's
  share). The loop sees every committed step once (``LiveWorker.train``: a step committed before a
  failed save, or the boundary a left-out rank rejoins at, is still returned), so its objects advance
  once per step. They are taken as they are when a step commits: a joiner takes the quorum's lowest
  live rank's, and every durable checkpoint holds them, so a joiner's and a resumed job's next loop
  iteration continue them as the fault-free run's does. An undo leaves them alone: the member that
  undoes a step has already returned that step to its loop, whose objects are past it (the redone step
  is not returned again).

An FSDP2 rank's DTensors travel as their local rows (``dtensor_state``). Everything here is plain tensors, numbers, strings and lists: ``torch.load(weights_only=True)`` loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainguard.checkpoint.manager import Stateful
from trainguard.errors import ConfigError
from trainguard.live.dtensor_state import model_state_like, optimizer_state_like, plain, plain_copy
from trainguard.live.step_judge import LiveJudge

GUARDS, SCHEDULER = "live_guards", "scheduler"  # the engine's objects' names in a checkpoint's extra state


def loop_objects(stateful: Mapping[str, Stateful] | None) -> dict[str, Stateful]:
    """``Guard(stateful=...)`` as live mode keeps it; a name of the engine's own is refused in one line."""
    objects = dict(stateful or {})
    taken = {GUARDS, SCHEDULER} & set(objects)
    if taken:
        raise ConfigError(f"Guard(stateful=...): the names {sorted(taken)} are the live engine's own; choose other "
                          "names")
    return objects


class LiveState:
    """``scheduler``: any ``torch.optim.lr_scheduler`` scheduler stepped without arguments (None: the LR
    stays the optimizer's); ``stateful``: the loop's objects by name."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, judge: LiveJudge,
                 scheduler: Any = None, stateful: Mapping[str, Stateful] | None = None):
        self.model, self.optimizer, self.judge, self.scheduler = model, optimizer, judge, scheduler
        self.stateful = loop_objects(stateful)
        # the last committed step's report (``worker.CommittedStep`` as a dict): None before the first
        self.committed: dict[str, Any] | None = None

    def checkpointed(self) -> dict[str, Stateful]:
        """What a durable checkpoint's extra state holds besides the model and the optimizer, by name: the
        closure mode's names for the scheduler and the loop's objects."""
        engine = {GUARDS: self.judge} | ({SCHEDULER: self.scheduler} if self.scheduler is not None else {})
        return engine | self.stateful

    def after_update(self) -> None:
        """The scheduler's step, after the optimizer's (an applied update only)."""
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """The whole state: what a joiner receives, a final state file and the drill's checkpoints hold."""
        engine = self.engine_state()
        return {**engine, "model": plain(engine["model"]), "optimizer": plain(engine["optimizer"]),
                "stateful": {name: obj.state_dict() for name, obj in self.stateful.items()}}

    def engine_state(self) -> dict[str, Any]:
        """The shard and the engine's run state (references to the live tensors)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "guards": self.judge.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "committed": self.committed}

    def undo_point(self) -> dict[str, Any]:
        """A copy of ``engine_state``, taken before a step's update: what ``undo`` restores (DTensors as their
        local rows, as ``load_shard`` takes them)."""
        return plain_copy(self.engine_state())

    def undo(self, point: dict[str, Any]) -> None:
        """Back to ``undo_point``'s state; the loop's objects stay as they are (the module's docstring)."""
        self.load_shard(point)
        self.load_run_state(point)

    def load(self, state: dict[str, Any], run_state: dict[str, Any] | None = None) -> None:
        """Everything from ``state`` (a peer's, a drill checkpoint's); the engine's run state and the loop's
        objects from ``run_state`` instead when given (the quorum's lowest live rank's, at a join)."""
        self.load_shard(state)
        self.load_run_state(state if run_state is None else run_state, loop_objects=True)

    def load_shard(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(model_state_like(self.model, state["model"]))
        self.optimizer.load_state_dict(optimizer_state_like(self.optimizer, state["optimizer"]))

    def load_run_state(self, state: dict[str, Any], loop_objects: bool = False) -> None:
        self.judge.load_state_dict(state["guards"])
        self.committed = state.get("committed")
        if self.scheduler is not None:
            if state.get("scheduler") is None:
                raise ConfigError("live recovery: this rank has an LR scheduler and the state it received has none: "
                                  "every rank of a live run must build the same scheduler")
            self.scheduler.load_state_dict(state["scheduler"])
        if loop_objects:
            received = state.get("stateful", {})
            missing = sorted(set(self.stateful) - set(received))
            if missing:
                raise ConfigError(f"live recovery: the state received holds no stateful object named {missing}: "
                                  "every rank of a live run must pass the same Guard(stateful=...) names")
            for name, obj in self.stateful.items():
                obj.load_state_dict(received[name])
