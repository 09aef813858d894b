"""A replica group's parameters sharded by rows across its ranks (``live.sharded_params``): FSDP2's
``torch.chunk`` split, the local storage, whole parameters from one exchange over a real gloo group,
an update of the rows equal to an unsharded one, the whole state for a save, and a group's whole
state put back together (``shards.whole_state``)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.gloo_threads import run_ranks
from trainguard.live.compare import bitwise_differences
from trainguard.live.sharded_params import ShardedParams, chunk_rows, norm_by_rows, row_squares
from trainguard.live.shards import whole_state


@pytest.mark.parametrize("rows,shards", [(8, 2), (5, 2), (1, 2), (7, 4), (3, 4)])
def test_the_rows_are_torch_chunks(rows, shards):
    chunks = torch.arange(rows).chunk(shards)
    for shard in range(shards):
        first, end = chunk_rows(rows, shards, shard)
        expected = chunks[shard].tolist() if shard < len(chunks) else []
        assert list(range(first, end)) == expected


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _wait_all(works) -> None:
    for work in works:
        work.wait()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_each_rank_holds_half_of_its_groups_parameters():
    whole = sum(p.numel() for p in _model().parameters())
    held = [ShardedParams(_model(), 2, rank) for rank in range(2)]
    assert [params.local_numel() for params in held] == [whole // 2, whole // 2]
    assert all(params.whole_numel() == whole for params in held)
    assert [tuple(p.shape) for p in held[1].params] == [(2, 6), (2,), (1, 4), (1,)]


def test_unshard_reshard_and_a_sharded_update_equal_the_unsharded_ones_bitwise():
    """Two ranks of a group over a real gloo group: the whole parameters come back bit for bit, each
    steps AdamW on its rows, and the two shards put together are one unsharded step's state."""
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator) for p in reference.parameters()]
    for param, grad in zip(reference.parameters(), grads):
        param.grad = grad.clone()
    before = copy.deepcopy(reference.state_dict())
    optimizer.step()
    models = {rank: _model() for rank in range(2)}  # built here: the global RNG is not the threads' to share

    def rank(group, rank: int) -> dict:
        model = models[rank]
        params = ShardedParams(model, 2, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
        params.unshard(group, [0, 1], rank, _wait_all)
        unsharded = copy.deepcopy(model.state_dict())
        params.reshard()
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        params.set_grads(params.shard_flat(flat, rank))
        opt.step()
        sharded = copy.deepcopy(_state(model, opt))
        with params.whole(group, [0, 1], rank, opt, _wait_all):
            saved = copy.deepcopy(_state(model, opt))  # what a durable save sees: the whole state
        return {"unsharded": unsharded, "sharded": sharded, "saved": saved, "after": _state(model, opt)}

    results = run_ranks([0, 1], rank)
    expected = _state(reference, optimizer)
    for rank in range(2):
        assert bitwise_differences(results[rank]["unsharded"], before) == [], rank
        assert bitwise_differences(results[rank]["saved"], expected) == [], rank
        assert bitwise_differences(results[rank]["after"], results[rank]["sharded"]) == [], rank
    assert bitwise_differences(whole_state([results[0]["sharded"], results[1]["sharded"]]), expected) == []


def test_a_scalar_parameter_is_refused_naming_it():
    model = torch.nn.Linear(2, 2)
    model.scale = torch.nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="'scale' is a scalar"):
        ShardedParams(model, 2, 0)


def test_the_norm_from_the_groups_rows_is_a_whole_replicas_bitwise_an_empty_shard_included():
    """The global norm by rows (float64 squares of each dim-0 row, one sum in parameter order): from two
    ranks' rows over a real gloo group, bit for bit the norm of the whole gradient, though shard 1 holds
    nothing of the 1-row output layer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=generator) * 10.0 ** torch.randint(-3, 4, p.shape, generator=generator)
             for p in model.parameters()]
    expected = norm_by_rows(row_squares(grads))
    models = {rank: copy.deepcopy(model) for rank in range(2)}

    def rank(group, rank: int) -> float:
        params = ShardedParams(models[rank], 2, rank)
        local = [params.rows(grad, params.shard) for grad in grads]
        return norm_by_rows(params.whole_row_squares(group, [0, 1], rank, local, _wait_all))

    assert run_ranks([0, 1], rank) == {0: expected, 1: expected}
