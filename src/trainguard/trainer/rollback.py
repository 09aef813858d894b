"""In-process rollback of the reference trainer (``check_for_global_norm``): the I/O side of guards/rollback.py.

Every rank arrives here at the same step with the same spike: the verdict came from values that rode
the global-norm all-reduce, and the guard state is identical on every rank. The policy says which steps'
batches to skip; the checkpoint manager restores the newest healthy checkpoint from before the spike
(after the save in flight has committed); the sampler then never yields the skipped global positions,
on any layout, and saves them in every later checkpoint so they stay skipped after restarts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.guards.rollback import RollbackAbort, Spike

if TYPE_CHECKING:
    from trainguard.trainer.loop import Trainer


def roll_back(trainer: "Trainer", spike: Spike) -> None:
    """Restores the checkpoint, skips the window's samples and sets ``trainer.step`` to the restored
    step; raises RollbackAbort (exit 3) when the spike recurred too often or nothing precedes it."""
    guard, sampler = trainer.rollback, trainer.sampler
    try:
        plan = guard.plan(spike)
        policy = guard.policy_state()
        skipped_before = list(sampler.skipped)
        restored = trainer.checkpoints.roll_back(before_step=spike.step)
        if restored is None:
            raise RollbackAbort(guard.abort_summary(spike, "there is no healthy checkpoint before it to roll back to"))
    except RollbackAbort as abort:
        trainer.log.error("%s", abort)
        if trainer.rank == 0:
            trainer.events.emit("rollback_abort", step=spike.step, metric=spike.metric, value=spike.value,
                                threshold=spike.threshold, message=str(abort))
        raise
    # The checkpoint brought back its own guard and sampler state; the rollbacks made since must stay.
    guard.restore_policy_state(policy)
    for start, end in skipped_before:
        sampler.skip(start, end)
    first = guard.starts_after(restored)
    per_step = sampler.global_batch_size * trainer.config.train.micro_batches
    start, end = sampler.span_ahead((first - restored - 1) * per_step, (plan.last_step - first + 1) * per_step)
    sampler.skip(start, end)
    trainer.step = restored
    trainer.max_embedding_norm = None
    trainer.log.warning(
        "rollback: %s %s of step %d is greater than threshold %r: restored global_step_%d and skipping the "
        "batches of steps %d-%d (global samples [%d, %d)), rollback %d of at most %d without progress",
        spike.metric, f"[{spike.value:.6f}]", spike.step, float(spike.threshold), restored, first, plan.last_step,
        start, end, plan.attempt, guard.cfg.max_rollbacks,
    )
    if trainer.rank == 0:
        trainer.events.emit(
            "rollback", step=spike.step, to_step=restored, metric=spike.metric, value=spike.value,
            threshold=spike.threshold, window=[first, plan.last_step], attempt=plan.attempt,
            skipped=[[start, end]], skipped_ranges=[list(r) for r in sampler.skipped],
            skipped_samples=sampler.skipped_samples,
        )
