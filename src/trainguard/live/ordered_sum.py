"""A step's gradient that does not depend on how many ranks computed it.

The global batch is a fixed list of micro-batches. Each member of the quorum computes the gradients
of its share of them (member ``i`` of ``n`` takes micro-batches ``i, i+n, i+2n, ...``), one row per
micro-batch, zeros in the rows it did not compute. One all-reduce of the ``[micro_batches, P]`` rows
adds, in each row, one computed value to zeros only, which is exact (``x + 0 == x``; a ``-0.0`` is
normalised to ``+0.0`` first so the sign of a zero does not depend on the count either). Every rank
then adds the rows by the step's fixed tree over micro-batch indices (``group_reduce.tree_sum``), on
its own CPU, the same way whatever the membership was: the sum is bitwise the one of a fault-free
run, and the one of the sharded reduction's (``group_reduce``) for the same micro-batches. The cost is
``micro_batches`` gradient-sized rows per step instead of one: this is the reduction of whole replicas
(``dp_shard`` 1, any number of groups); replica groups of several ranks use ``group_reduce``.

Beside the rows travel, exactly as they do, ``extras``: a few values per micro-batch (the SDC detection
points' statistics of that micro-batch, ``live/sdc.py``), zeros where a rank did not compute it, so every
rank gets every micro-batch's values bitwise as the rank that computed it measured them.

Trailing elements carry flags, each summed over the ranks: the number of ranks that saw a newer epoch
in the store, and the number that saw a stop asked for (the launcher's SIGTERM), so every rank learns
from the same collective that the quorum changes, or that the run stops, at the next step boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from trainguard.live.group_reduce import tree_sum


def my_micro_batches(micro_batches: int, members: int, index: int) -> list[int]:
    return list(range(index, micro_batches, members))


def computed_by(micro_batches: int, members: list[int]) -> list[int]:
    """The rank that computes each micro-batch (by index): ``my_micro_batches``'s dealing."""
    return [members[micro_batch % len(members)] for micro_batch in range(micro_batches)]


def reduce_rows(group: dist.ProcessGroup, rows: torch.Tensor, flags: Sequence[int],
                wait: Callable[[dist.Work], None],
                extras: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """The summed gradient (rows added by the fixed tree), each flag's count over the world and the
    ``[micro_batches, K]`` extras, each micro-batch's as its rank gave them (None without);
    ``wait`` waits for the all-reduce (``collective.wait`` bound to the epoch)."""
    parts = [(rows + 0.0).flatten()]
    if extras is not None:
        parts.append((extras.to(rows.dtype) + 0.0).flatten())
    flat = torch.cat([*parts, torch.tensor([float(flag) for flag in flags], dtype=rows.dtype)])
    wait(group.allreduce([flat]))
    total = tree_sum(list(flat[:rows.numel()].view_as(rows)))
    carried = None if extras is None else flat[rows.numel():rows.numel() + extras.numel()].view(extras.shape).clone()
    return total, [int(count) for count in flat[-len(flags):].tolist()], carried
