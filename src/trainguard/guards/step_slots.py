"""The scalars of one step, summed over every rank in one all-reduce of constant size.

Every rank contributes its share of each slot and reads back the world's sums: the squared global
norm (each rank's weighted share, see ``norms.global_norm``), the loss (each loss-holding rank's
share of the mean) and, for the guards, *counts* of ranks that raised an indicator. A count says
whether anything fired anywhere; only then does the guard spend a second, rare-path collective to
learn which ranks (a gather at an SDC rerun) or how much (a max of the embedding norm at a save). The
buffer therefore never grows with the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from trainguard.norms import KnownNorms, global_norm_and_sums


class Slot(IntEnum):
    """Positions in the buffer after the squared norm (which ``global_norm_and_sums`` puts first)."""

    LOSS = 0  # each loss-holding rank's share of the mean loss
    SDC_STOP = 1  # ranks whose detection points saw a level-1 value (the step must be rerun or skipped)
    SDC_TRANSIENT = 2  # after a rerun: ranks whose fault was transient (the rerun is used)
    SDC_REPRODUCIBLE = 3  # after a rerun: ranks whose detection came back (the step is skipped)
    SDC_FAULTY = 4  # after a rerun: ranks whose device reached its strike limit (exit 17)
    SDC_LOCAL = 5  # ranks with a level-1 value at a point they computed alone (not a reduced gradient)
    STATE_AT_REST = 6  # ranks whose shards changed since the last update (guards.fingerprint.at_rest)


SLOTS = len(Slot)


@dataclass(frozen=True)
class Reduced:
    """The world's sums of one step's scalars."""

    global_norm: float
    loss: float
    counts: dict[Slot, int]

    def count(self, slot: Slot) -> int:
        return self.counts[slot]


def local_slots(device: torch.device, loss_share: torch.Tensor | None = None,
                flags: dict[Slot, bool | int | torch.Tensor] | None = None) -> torch.Tensor:
    """This rank's contribution: its loss share and a 1 in each raised indicator's slot (a flag still
    on the device is copied there, without a host synchronisation)."""
    slots = torch.zeros(SLOTS, dtype=torch.float64, device=device)
    if loss_share is not None:
        slots[Slot.LOSS] = loss_share
    for slot, raised in (flags or {}).items():
        slots[slot] = raised
    return slots


def reduce_step(grads: list[torch.Tensor], slots: torch.Tensor, ranks_per_stage: int, known: KnownNorms = ()) -> Reduced:
    """One all-reduce (and one host sync) of the norm and every slot; ``known``: local gradient norms
    measured already (the SDC gradient points')."""
    norm, sums = global_norm_and_sums(grads, slots, ranks_per_stage, known=known)
    return Reduced(norm, sums[Slot.LOSS], {slot: int(sums[slot]) for slot in Slot if slot != Slot.LOSS})
