"""The parameter layout of a live run's ranks: one strategy per layout behind ``ParamLayout``, chosen once
when the worker is built (``choose_layout``), so that ``LiveWorker`` keeps one step skeleton (quorum,
exchange, verdicts, commit, recovery) and asks its layout for what differs:

- ``REPLICA``: whole replicas (``parallel.dp_shard`` 1), one all-reduce of a row per micro-batch
  (``ordered_sum``; ``layout_replica.py``);
- ``ROWS``: our own row shards in each replica group (``sharded_params``), gathered whole around a step's
  micro-batches and reduced by group (``group_reduce``; ``layout_rows.py``);
- ``FSDP``: a model sharded with ``fully_shard`` over the replica group's mesh, tensor parallel inside it
  when ``parallel.tp`` > 1, each group's share one reduce-scatter (``fsdp_share``; ``layout_fsdp.py``).

A layout reaches the epoch through ``EpochLink`` (the worker): its group and quorum change at every
recovery, so a layout reads them at each call and keeps none.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.live.group_reduce import Exchange, StepSum
from trainguard.live.micro_batch import StepWork
from trainguard.live.quorum import Quorum
from trainguard.live.shards import shard_of


class LayoutKind(enum.Enum):
    REPLICA = "replica"  # whole replicas
    ROWS = "rows"  # our own row shards in each replica group
    FSDP = "fsdp"  # FSDP2 over the replica group's mesh (with tensor parallel when tp > 1)


def choose_layout(fully_sharded: bool, group_size: int, tp: int) -> LayoutKind:
    """The layout of a model (``fully_sharded``: it has FSDP2 modules) in replica groups of ``group_size``
    ranks with ``tp`` tensor-parallel ranks per ``dp_shard`` position; a ``ConfigError`` of one line when
    the model and the mesh disagree."""
    if fully_sharded:
        if group_size == 1:
            raise ConfigError("live recovery: the model is sharded with fully_shard but parallel.dp_shard is 1 "
                              "(whole replicas): shard it over trainguard.data_parallel_mesh(), which is None then")
        return LayoutKind.FSDP
    if tp > 1:
        raise ConfigError(f"live recovery with parallel.tp={tp}: the model has no FSDP2 module; apply "
                          "parallelize_module over trainguard.device_mesh(tp)['tp'], then fully_shard over its "
                          "'dp_shard' dimension")
    return LayoutKind.ROWS if group_size > 1 else LayoutKind.REPLICA


class EpochLink(Protocol):
    """What a layout reads of its rank's current epoch (``LiveWorker`` is one)."""
    store: dist.Store
    events: EventLog
    step_index: int

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    @property
    def quorum(self) -> Quorum | None: ...

    def wait(self, work: dist.Work) -> None: ...

    def wait_all(self, works: list[dist.Work]) -> None: ...

    def beat(self) -> None: ...

    def recover(self, error: RuntimeError) -> None: ...


class ParamLayout(Protocol):
    """One parameter layout's part of a live step (the worker's skeleton calls these in this order)."""
    kind: LayoutKind
    # the stall watch's marks span the whole step (from the layout's first gather), not the sum alone
    marks_span_step: bool

    def my_micro_batches(self, exchange: Exchange) -> list[int]:
        """The micro-batches this rank computes in a step of the epoch (for its events and samples)."""

    def computed_by(self, exchange: Exchange) -> list[int]:
        """The rank that computes each micro-batch of a step of this epoch."""

    def compute(self, work: StepWork, exchange: Exchange, mine: list[int], catch: bool
                ) -> tuple[dict[int, torch.Tensor], str | None]:
        """This rank's parts of the step's sum (each with its loss last) and, with ``catch``, the line of its
        computation's error (the parts then partly zeros: the step is not committed); without, it raises."""

    def reduce(self, exchange: Exchange, computed: dict[int, torch.Tensor], flags: list[int],
               extras: torch.Tensor | None) -> StepSum:
        """The step's fixed-order sum of every member's ``computed``, ``flags`` and ``extras`` summed
        beside; sets this rank's gradients from it."""

    def row_squares(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The squares of each parameter's whole gradient by rows (``sharded_params.row_squares``), every
        member's alike and bitwise the same for any layout."""

    def over_shards(self, mine: torch.Tensor) -> torch.Tensor:
        """``mine`` of every shard of this rank's replica group, ``[group_size, *mine.shape]`` in shard
        order (every group's shards are equal, so every member finds the same)."""

    def whole_state(self) -> contextlib.AbstractContextManager[None]:
        """The model and optimizer whole inside the block (for the durable tier)."""

    def at_rest(self) -> bool:
        """Whether the model holds this rank's parameters as between steps (none gathered whole): the state
        its per-rank tier would save."""

    def left_out(self, quorum: Quorum) -> None:
        """This rank is not a member of ``quorum``: raises when the layout cannot rejoin alone."""

    def waiting_beat(self, epoch: int) -> Callable[[], None]:
        """The heartbeat while this rank waits for the epoch after ``epoch``."""


def over_group_shards(link: EpochLink, rank: int, group_size: int, mine: torch.Tensor) -> torch.Tensor:
    """A sharded layout's ``over_shards``: one all-gather over the epoch, the values of this rank's group
    picked in shard order."""
    mine = mine.contiguous()
    members = link.quorum.members
    every = [torch.empty_like(mine) for _ in members]
    link.wait(link.group.allgather([every], [mine]))
    first = rank - shard_of(rank, group_size)
    return torch.stack([every[link.quorum.index(first + s)] for s in range(group_size)])
