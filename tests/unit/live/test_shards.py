"""The split of a replica group's optimizer state and update between its shards (``live.shards``): the
ownership rule, the sharded step against an unsharded one, and the whole state put back together."""

from __future__ import annotations

import copy
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainguard.live.compare import bitwise_differences
from trainguard.live.shards import ShardedUpdate, shard_owners, whole_state


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What a shard holds: its parameters and optimizer state (``whole_state``'s input)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_the_largest_parameter_goes_first_to_the_least_loaded_shard():
    # 100 -> shard 0 (100); 60 -> 1 (60); 50 -> 1 (110); the first 10 -> 0 (110); the second 10: a tie -> 0
    assert shard_owners([10, 100, 10, 60, 50], 2) == [0, 0, 0, 1, 1]
    assert shard_owners([4, 4, 4], 1) == [0, 0, 0]
    assert shard_owners([1], 3) == [0]  # a shard may own nothing
    with pytest.raises(ValueError, match="shards must be"):
        shard_owners([1], 0)


def test_every_parameter_has_one_owner_and_the_loads_stay_balanced():
    sizes = [int(s) for s in torch.randint(1, 1000, (40,), generator=torch.Generator().manual_seed(3))]
    owners = shard_owners(sizes, 4)
    loads = [sum(n for n, o in zip(sizes, owners) if o == s) for s in range(4)]
    assert set(owners) == {0, 1, 2, 3} and max(loads) - min(loads) <= max(sizes)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _grads(model):
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def test_two_shards_stepping_their_parameters_and_gathering_equal_one_unsharded_step_bitwise():
    """Two ranks of one replica group over a real gloo group: each steps the parameters it owns, then
    copies the other's; both end with the parameters of an unsharded step, and their optimizer states
    put together are the unsharded one's."""
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.01)
    _grads(reference)
    optimizer.step()
    store = dist.HashStore()
    models = [_model() for _ in range(2)]  # here: the global RNG is not the threads' to share
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
            model = models[rank]
            opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
            _grads(model)
            update = ShardedUpdate(model, 2, rank)
            update.drop_unowned_grads()
            opt.step()
            update.gather(group, [0, 1], lambda work: work.wait())
            results[rank] = copy.deepcopy(_state(model, opt))
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    expected = _state(reference, optimizer)
    for rank in range(2):
        assert bitwise_differences(results[rank]["model"], expected["model"]) == [], rank
    assert results[0]["optimizer"]["state"].keys().isdisjoint(results[1]["optimizer"]["state"])
    assert bitwise_differences(whole_state([results[0], results[1]]),
                               whole_state([copy.deepcopy(expected)])) == []


def test_a_non_contiguous_parameter_is_refused_when_sharded():
    model = torch.nn.Linear(3, 4)
    model.weight = torch.nn.Parameter(torch.zeros(3, 4).t())
    with pytest.raises(ValueError, match="contiguous"):
        ShardedUpdate(model, 2, 0)
    assert not ShardedUpdate(model, 1, 0).sharded
