"""The parameters of a replica group sharded across its ranks, as FSDP2's ``fully_shard`` lays them out.

Rank ``r`` of groups of ``g`` ranks is shard ``r % g``: of every parameter it keeps the rows of
``torch.chunk(param, g, dim=0)[r % g]`` (FSDP2's ``Shard(0)``; the last shards may be short or empty),
and its optimizer state is that of those rows only (the optimizer steps the local rows: an update
that is elementwise, as SGD's and Adam's are, needs nothing else). Between steps each parameter's
``data`` is its local rows; a step's forwards and backwards see whole parameters: ``unshard`` copies
them together from one exchange of the group's shards, ``reshard`` puts the local rows back. Plain
tensors and our own exchange, not ``fully_shard``: an epoch's gloo group is made and dropped with
its quorum (``collective``), and every wait on it must watch the epoch's abort key, which FSDP2's
collectives inside forward and backward do not. A forward outside a step (the loop's body evaluating
the model) gathers the parameters before it and frees them after (``layout_rows.RowsLayout``'s hooks on the
model), as FSDP2's root forward does: every rank of the group must call it, at the same point.

So the ``state_dict`` of the model and of the optimizer is the shard's (what a joining rank receives
from a live replica of its shard, ``transfer.send_shards``, and what a final state file holds);
``whole_state`` (``shards``) puts a group's shards back together.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from trainguard.live.shards import shard_of


def chunk_rows(rows: int, shards: int, shard: int) -> tuple[int, int]:
    """``torch.chunk``'s rows ``[first, end)`` of ``shard`` (of ``shards``) of a dim 0 of ``rows``."""
    per_shard = -(-rows // shards)
    return min(shard * per_shard, rows), min((shard + 1) * per_shard, rows)


def shard_numel(shape: torch.Size, shards: int, shard: int) -> int:
    first, end = chunk_rows(shape[0], shards, shard)
    return (end - first) * shape[1:].numel()


GATHER_TAG = 7  # the tag of a group's gathers on the epoch's group (the reduction uses collectives only)


def row_squares(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's squared L2 norm per dim-0 row, in float64: a row is the unit every shard holds
    whole, so these do not depend on the layout."""
    squares = [tensor.detach().double().square() for tensor in tensors]
    return [square.flatten(1).sum(dim=1) if square.dim() > 1 else square for square in squares]


def norm_by_rows(squares: list[torch.Tensor]) -> float:
    """The global norm from every parameter's row squares (``row_squares`` of whole tensors, in parameter
    order): one float64 sum of one vector, the same whatever the layout that computed it (whole replicas
    or sharded groups), so clipping and the guards see the same norm bit for bit."""
    return math.sqrt(float(torch.cat(squares).sum()))


def gather_rows(group: dist.ProcessGroup, members: list[int], rank: int, group_size: int,
                locals_: list[torch.Tensor], shapes: list[torch.Size],
                wait_all: Callable[[list[dist.Work]], None]) -> list[torch.Tensor]:
    """The whole tensors of ``locals_`` (this rank's ``torch.chunk`` rows of a tensor of ``shapes[i]`` each),
    from this rank's replica group alone: its rows sent to, and the others' received from, each other rank
    of the group (gloo's send and recv on the epoch's group, so that only the group's ranks take part: a
    forward of the loop's body is the group's collective, not the quorum's); a copy, no arithmetic.
    ``wait_all``: waits for the sends and receives (gloo's say they are complete only once waited for:
    ``collective.wait_all``)."""
    shard = shard_of(rank, group_size)
    first = rank - shard
    mine = torch.cat([local.detach().reshape(-1) for local in locals_])
    shards = {rank: mine}
    works = []
    for peer in range(first, first + group_size):
        if peer == rank:
            continue
        shards[peer] = torch.empty(sum(shard_numel(shape, group_size, peer - first) for shape in shapes),
                                   dtype=mine.dtype)
        works.append(group.send([mine], members.index(peer), GATHER_TAG))
        works.append(group.recv([shards[peer]], members.index(peer), GATHER_TAG))
    wait_all(works)
    offsets = [0] * group_size
    wholes = []
    for shape in shapes:
        pieces = []
        for position in range(group_size):
            count = shard_numel(shape, group_size, position)
            pieces.append(shards[first + position][offsets[position]:offsets[position] + count])
            offsets[position] += count
        wholes.append(torch.cat(pieces).view(shape))
    return wholes


class ShardedParams:
    """This rank's rows of every parameter of ``model`` (taken at construction: the model must be whole
    then, as every rank builds it from the same seed)."""

    def __init__(self, model: torch.nn.Module, group_size: int, rank: int):
        self.params = list(model.parameters())
        for name, param in model.named_parameters():
            if param.dim() == 0:
                raise ValueError(f"live recovery shards parameters by rows (dim 0): parameter {name!r} is a scalar")
            if param.dtype != torch.float32:
                raise ValueError(f"live recovery's sharded reduction carries float32: parameter {name!r} is {param.dtype}")
        self.group_size, self.shard = group_size, shard_of(rank, group_size)
        self.shapes = [param.shape for param in self.params]
        self.local: list[torch.Tensor] = []  # the local rows, while the parameters are whole
        with torch.no_grad():
            for param in self.params:
                param.data = self.rows(param.data, self.shard).clone()

    def rows(self, tensor: torch.Tensor, shard: int) -> torch.Tensor:
        first, end = chunk_rows(tensor.shape[0], self.group_size, shard)
        return tensor[first:end]

    def local_numel(self) -> int:
        return sum(param.numel() for param in self.params)

    def whole_numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)

    def shard_length(self, shard: int) -> int:
        return sum(shard_numel(shape, self.group_size, shard) for shape in self.shapes)

    def shard_flat(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        """Shard ``shard`` of a flat whole gradient (the parameters in order): each parameter's rows."""
        parts, offset = [], 0
        for shape in self.shapes:
            parts.append(self.rows(flat[offset:offset + shape.numel()].view(shape), shard).reshape(-1))
            offset += shape.numel()
        return torch.cat(parts)

    def set_grads(self, local: torch.Tensor) -> None:
        """Each parameter's gradient: its rows of this rank's flat shard of the step's gradient."""
        offset = 0
        for param in self.params:
            param.grad = local[offset:offset + param.numel()].view_as(param).clone()
            offset += param.numel()

    def gather_whole(self, group: dist.ProcessGroup, members: list[int], rank: int, locals_: list[torch.Tensor],
                     wait_all: Callable[[list[dist.Work]], None],
                     shapes: list[torch.Size] | None = None) -> list[torch.Tensor]:
        """``gather_rows`` of ``locals_`` (each laid out as the parameter of the same index: this rank's rows
        of a tensor of ``shapes[i]``, the parameter's shape by default)."""
        self.indices(locals_)
        return gather_rows(group, members, rank, self.group_size, locals_, self.shapes if shapes is None else shapes,
                           wait_all)

    def whole_row_squares(self, group: dist.ProcessGroup, members: list[int], rank: int, grads: list[torch.Tensor],
                          wait_all: Callable[[list[dist.Work]], None]) -> list[torch.Tensor]:
        """``row_squares`` of the whole gradient from this rank's rows of it (``grads``, one per
        parameter): each rank's row squares gathered inside the group, bitwise a whole replica's."""
        rows = [torch.Size([shape[0]]) for shape in self.shapes]
        return self.gather_whole(group, members, rank, row_squares(grads), wait_all, rows)

    def indices(self, locals_: list[torch.Tensor]) -> range:
        if len(locals_) != len(self.params):
            raise ValueError(f"{len(locals_)} tensors for {len(self.params)} parameters")
        return range(len(locals_))

    @property
    def is_whole(self) -> bool:
        return bool(self.local)

    def unshard(self, group: dist.ProcessGroup, members: list[int], rank: int,
                wait_all: Callable[[list[dist.Work]], None]) -> None:
        """Makes every parameter whole for a step's forwards and backwards (``gather_whole``). On a failure
        the parameters stay the local rows."""
        wholes = self.gather_whole(group, members, rank, [param.data for param in self.params], wait_all)
        self.local = [param.data for param in self.params]
        for param, whole in zip(self.params, wholes):
            param.data = whole

    def reshard(self) -> None:
        """Puts back the local rows (the parameters were not changed while whole: no copy back)."""
        for param, local in zip(self.params, self.local):
            param.data = local
        self.local = []

    @contextlib.contextmanager
    def whole(self, group: dist.ProcessGroup, members: list[int], rank: int, optimizer: torch.optim.Optimizer,
              wait_all: Callable[[list[dist.Work]], None]) -> Iterator[None]:
        """The parameters and the optimizer state whole inside the block (a durable save or resume:
        ``live.durable``, through ``torch.distributed.checkpoint``'s state dicts, which key a tensor by
        its parameter's name). On leaving, each keeps this rank's rows of whatever it holds then: the same
        rows after a save, the loaded ones after a resume (whose optimizer state appears inside)."""
        names = sorted({name for param in self.params for name, value in optimizer.state.get(param, {}).items()
                        if isinstance(value, torch.Tensor) and value.dim() > 0})
        present = [name for name in names if all(name in optimizer.state.get(param, {}) for param in self.params)]
        if present != names:
            raise ValueError(f"optimizer state {sorted(set(names) - set(present))} is missing for some parameters")
        wholes = [self.gather_whole(group, members, rank, [optimizer.state[param][name] for param in self.params], wait_all)
                  for name in names]
        self.unshard(group, members, rank, wait_all)
        for name, tensors in zip(names, wholes):
            for param, tensor in zip(self.params, tensors):
                optimizer.state[param][name] = tensor
        try:
            yield
        finally:
            self.local = []
            with torch.no_grad():
                for param in self.params:
                    param.data = self.rows(param.data, self.shard).clone()
                for index, param in enumerate(self.params):
                    for name, value in optimizer.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == self.shapes[index]:
                            optimizer.state[param][name] = self.rows(value, self.shard).clone()
