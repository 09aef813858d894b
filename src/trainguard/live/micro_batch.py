"""What a live step computes, whatever the parameter layout (``live/layout.py``): one micro-batch's share of
the step's loss and its gradient (``micro_batch_grad``), the step's work handed to the layout
(``StepWork``), and the rows of whole-parameter micro-batches (``compute_micro_batches``: whole replicas,
and our own row-sharded groups while their parameters are gathered)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainguard.live.rng import micro_batch_rng
from trainguard.live.step_failures import failure_text

# the loss of micro-batch ``m`` of step ``t`` (model, t, m): a pure function of (t, m) and the parameters
MicroBatchLoss = Callable[[torch.nn.Module, int, int], torch.Tensor]


def micro_batch_grad(model: torch.nn.Module, loss_of: MicroBatchLoss, step: int, micro_batch: int,
                     micro_batches: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's share of the step's loss (the mean over micro-batches) and its flat gradient,
    its random draws (dropout) seeded from ``(seed, step, micro_batch)``: the same on any rank (rng.py)."""
    model.zero_grad(set_to_none=True)
    with micro_batch_rng(seed, step, micro_batch):
        share = loss_of(model, step, micro_batch) / micro_batches
        share.backward()
    return share.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@dataclass(frozen=True)
class StepWork:
    """One pass over a step's micro-batches as the worker hands it to its layout: the step (for messages),
    the loss, the data position handed to it (``LiveWorker.data_position``), the step's micro-batch count and the run's seed,
    the heartbeat, and with SDC detection on ``measure``, which fills a micro-batch's values in the step's
    extras after its backward (``live/sdc.py``)."""
    step: int
    loss_of: MicroBatchLoss
    position: int
    micro_batches: int
    seed: int
    beat: Callable[[], None]
    measure: Callable[[int], None] | None
    micro_batch_s: float = 0.0  # the drill's simulated compute per micro-batch
    # raises ``EpochAborted`` once the step's epoch has ended (a member died): the rest of the computation is of
    # no use, the next epoch computes the step again, and the survivors' next epoch need not wait for it
    leave_if_ended: Callable[[], None] = lambda: None


def compute_micro_batches(model: torch.nn.Module, work: StepWork, mine: list[int], catch: bool
                          ) -> tuple[dict[int, torch.Tensor], str | None]:
    """This rank's micro-batches of the step, the parameters whole: each one's gradient then its share of
    the loss (a -0.0 made +0.0: ``ordered_sum``). With ``catch``, an error of the loss or its backward is
    returned as its line instead, every micro-batch from the one that raised on a row of zeros
    (``live/step_failures.py``)."""
    computed, failure = {}, None
    for micro_batch in mine:
        work.beat()
        work.leave_if_ended()
        if failure is not None:
            computed[micro_batch] = torch.zeros_like(next(iter(computed.values())))
            continue
        try:
            share, grad = micro_batch_grad(model, work.loss_of, work.position, micro_batch, work.micro_batches,
                                           work.seed)
        except Exception as error:  # the user's code: no collective runs in it
            if not catch:
                raise
            failure = failure_text(error)
            computed[micro_batch] = torch.zeros(sum(p.numel() for p in model.parameters()) + 1)
            continue
        computed[micro_batch] = torch.cat([grad, share.reshape(1)]) + 0.0
        if work.measure is not None:
            work.measure(micro_batch)
        time.sleep(work.micro_batch_s)  # the compute time a real micro-batch would take
    return computed, failure
