"""What a closure-mode run saves: each checkpoint's record of the run, its health, and the save policy
after a step (every tier's interval, the last step, a planned stop)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from trainguard.config.load import config_to_dict
from trainguard.config.schema import RunConfig
from trainguard.guards.step_engine import update_lr
from trainguard.step.builder import GuardParts
from trainguard.step.local_tier import fire_wipe_faults
from trainguard.step.position import RunPosition


class StepSaves:
    def __init__(self, parts: GuardParts, config: RunConfig, optimizer: torch.optim.Optimizer, scheduler: Any,
                 position: RunPosition):
        self.parts, self.config, self.optimizer, self.scheduler = parts, config, optimizer, scheduler
        self.position = position

    def lr(self) -> float:
        return update_lr(self.optimizer, self.scheduler)

    def health(self) -> dict | None:
        """The save's health: the embedding norm's verdict, and no NaN/Inf state, replicas agreeing
        (collective: every rank calls it when a tier saves)."""
        embedding = self.parts.embedding
        verdict = embedding.health(self.config.guards.health) if embedding is not None else None
        return self.parts.state.before_save(self.position.step, verdict)

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint's manifest records about the run: step, data position, lr, loss, config."""
        state: dict[str, Any] = {"step": self.position.step}
        consumed = next((obj.consumed_samples for obj in self.parts.stateful.values()
                         if hasattr(obj, "consumed_samples")), None)
        if consumed is not None:
            state["consumed_samples"] = consumed
        state.update(lr=self.lr(), loss=self.position.last_loss, config=config_to_dict(self.config))
        return state

    def by_policy(self, step: int) -> None:
        """After ``step``: the saves its tiers' intervals, the last step or a planned stop call for."""
        checkpoints, lifecycle, state = self.parts.checkpoints, self.parts.lifecycle, self.parts.state
        last = step == self.position.total
        planned = step == self.position.stop_at and not last  # always saved: the run is meant to go on later
        health = functools.cache(self.health)  # one max over ranks, only if a tier saves
        if checkpoints.due(step, last_step=last, stopping=planned).durable:
            lifecycle.beat("save", step)
        blocked = checkpoints.save(step, self.trainer_state(), health, last_step=last, stopping=planned)
        if planned:  # the stop's save went to the durable tier; the local tier keeps its schedule
            checkpoints.save(step, self.trainer_state(), health, last_step=last)
        if blocked is not None:
            lifecycle.note_save(blocked)
        if state.checks_at_rest(step + 1):
            # the next step starts with the at-rest check, whose mismatch rolls back to this step's
            # save: its copy is made now, not while the resting memory may already be corrupt
            checkpoints.wait_for_staging()
        if checkpoints.local is not None and checkpoints.last_local_step == step:
            fire_wipe_faults(self.parts.faults, checkpoints.local, step)
