"""Builds a live rank's parameter layout (``live/layout.py``) once, for the worker: the kind its model and
mesh call for (``choose_layout``), the sharded ones' slot alignment checked first."""

from __future__ import annotations

import torch

from trainguard.live.fsdp_share import fsdp_modules
from trainguard.live.group_reduce import SlotLayout
from trainguard.live.layout import EpochLink, LayoutKind, ParamLayout, choose_layout
from trainguard.live.layout_fsdp import FsdpLayout
from trainguard.live.layout_replica import ReplicaLayout
from trainguard.live.layout_rows import RowsLayout


def build_layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer, link: EpochLink, rank: int,
                 group_size: int, slots: SlotLayout) -> ParamLayout:
    """The layout of ``model`` on ``rank`` in replica groups of ``group_size`` ranks laid out as ``slots``
    (its ``tp`` the ranks of a ``dp_shard`` position); ConfigError (one line) or ValueError (the slots do
    not align with the step's fixed sum) when the run cannot use it."""
    kind = choose_layout(bool(fsdp_modules(model)), group_size, slots.tp)
    if kind is LayoutKind.REPLICA:
        return ReplicaLayout(model, link, rank, slots.micro_batches)
    slots.check()
    if kind is LayoutKind.FSDP:
        return FsdpLayout(model, link, rank, group_size, slots)
    return RowsLayout(model, optimizer, link, rank, group_size, slots)
