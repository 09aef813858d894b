"""The sharded reduction of a live step (``live.group_reduce``): the fixed tree over micro-batch
indices, the layout's slots and the lost groups' hand-over, and the two exchanges over a real gloo
group, whose result is bitwise the whole tree's whether every group is alive or one is lost."""

from __future__ import annotations

import pytest
import torch

from helpers.gloo_threads import run_ranks
from trainguard.live.group_reduce import (Exchange, SlotLayout, elements_received, reduce_partials, reduce_sharded,
                                         tree_sum)


def _leaves(count: int, length: int = 7, seed: int = 0) -> list[torch.Tensor]:
    # magnitudes spread over many binades, so that the order of the additions shows in the bits
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(length, generator=generator) * 10.0 ** torch.randint(-4, 5, (length,), generator=generator)
            for _ in range(count)]


def test_the_tree_adds_the_halves_and_not_in_sequence():
    a, b, c, d = _leaves(4)
    assert torch.equal(tree_sum([a, b, c, d]), (a + b) + (c + d))
    assert torch.equal(tree_sum([a, b, c]), a + (b + c))
    assert torch.equal(tree_sum([a]), a) and tree_sum([a]) is not a
    big, one = torch.tensor([1e8]), torch.tensor([1.0])  # float32: 1e8 + 1 rounds to 1e8
    assert tree_sum([big, one, -big, one]).item() == 0.0  # (1e8 + 1) + (-1e8 + 1); in sequence it would be 1
    with pytest.raises(ValueError):
        tree_sum([])


@pytest.mark.parametrize("groups,group_size,micro_batches", [(1, 2, 2), (2, 2, 8), (4, 2, 16), (2, 4, 16), (4, 1, 8)])
def test_slots_then_groups_then_the_root_is_the_whole_tree_bitwise(groups, group_size, micro_batches):
    """The group-partial sum in group order: slot trees, group trees over the slots, the root over the
    groups, equal to the tree over every micro-batch, bit for bit."""
    layout = SlotLayout(groups, group_size, micro_batches)
    layout.check()
    leaves = _leaves(micro_batches, seed=groups * 10 + group_size)
    partials = [tree_sum([tree_sum([leaves[m] for m in layout.slot_micro_batches(j, k)]) for k in range(group_size)])
                for j in range(groups)]
    assert torch.equal(tree_sum(partials), tree_sum(leaves))


def test_slots_are_contiguous_and_tile_the_micro_batches():
    layout = SlotLayout(2, 2, 8)
    assert [layout.slot_micro_batches(j, k) for j in range(2) for k in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("groups,group_size,micro_batches", [(3, 2, 12), (2, 2, 6), (2, 2, 2)])
def test_a_layout_the_tree_cannot_align_with_is_refused_naming_the_keys(groups, group_size, micro_batches):
    with pytest.raises(ValueError, match=r"dp_replicate × dp_shard .* train\.micro_batches"):
        SlotLayout(groups, group_size, micro_batches).check()


def test_lost_groups_are_dealt_to_the_live_ones_in_group_order():
    layout = SlotLayout(4, 2, 8)
    assert layout.responsibilities([0, 1, 2, 3]) == {0: [0], 1: [1], 2: [2], 3: [3]}
    assert layout.responsibilities([0, 2]) == {0: [0, 1], 2: [2, 3]}
    assert layout.responsibilities([3]) == {3: [0, 1, 2, 3]}
    exchange = Exchange([0, 1, 4, 5], 5, layout)  # groups 0 and 2 alive; rank 5 is shard 1 of group 2
    assert exchange.my_groups() == [2, 3] and exchange.my_micro_batches() == [5, 7]


def _halves(flat: torch.Tensor, shard: int) -> torch.Tensor:
    return flat.view(2, -1)[shard]  # 2 shards of a flat gradient of even length: its halves


@pytest.mark.parametrize("groups,members", [(2, [0, 1, 2, 3]), (2, [0, 1]), (2, [2, 3]),
                                            (4, list(range(8))), (4, [0, 1, 2, 3]), (4, [2, 3, 6, 7]),
                                            (4, [4, 5])])
def test_the_exchange_gives_each_shard_the_whole_trees_sum_bitwise_with_or_without_lost_groups(groups, members):
    """``groups`` × 2 over a real gloo group: each member computes the slots it is responsible for (a
    survivor, the lost groups' too), and after the two exchanges each holds its shard of the tree over
    every micro-batch and the tree's loss, bit for bit, and the flags' counts over the members; and every
    micro-batch's extras (SDC detection values: a NaN, a -0.0 among them) as the rank that computed it
    gave them, which ``computed_by`` names."""
    layout = SlotLayout(groups, 2, 4 * groups)
    leaves = _leaves(layout.micro_batches, length=6, seed=5)  # each: a gradient of 5 then a loss; the
    gradients = [torch.cat([leaf[:5], torch.zeros(1)]) for leaf in leaves]  # gradient padded to 6: 3 per shard
    losses = [leaf[5] for leaf in leaves]
    whole = tree_sum(gradients)
    loss = float(tree_sum([one.reshape(1) for one in losses]))
    extras = torch.stack([leaf[:3] * 1e-3 for leaf in leaves])
    extras[0, 0], extras[-1, 1] = float("nan"), -0.0
    owners = layout.computed_by(Exchange(members, members[0], layout).live_groups())

    def rank(group, rank: int):
        exchange = Exchange(members, rank, layout)
        slots = {j: tree_sum([torch.cat([gradients[m], losses[m].reshape(1)])
                              for m in layout.slot_micro_batches(j, exchange.shard)])
                 for j in exchange.my_groups()}
        mine = torch.zeros_like(extras)
        mine[exchange.my_micro_batches()] = extras[exchange.my_micro_batches()]
        return exchange.my_micro_batches(), reduce_sharded(group, exchange, slots, _halves, 3, [1, rank],
                                                           lambda work: work.wait(), mine)

    results = run_ranks(members, rank)
    expected_extras = extras + 0.0  # the -0.0 travels as +0.0
    for member, (computed, summed) in results.items():
        assert torch.equal(summed.gradient, _halves(whole, member % 2)), member
        assert summed.loss == loss and summed.flags == [len(members), sum(members)], member
        assert summed.extras.numpy().tobytes() == expected_extras.numpy().tobytes(), member
        assert sorted(computed) == [m for m, owner in enumerate(owners) if owner == member], member


def test_the_elements_received_per_step_follow_the_layout():
    """Stage 1: a shard of each slot the group computes, from each other rank of the group; stage 2: a
    shard of each group partial, from the same shard of each other live group (each shard with its loss)."""
    assert elements_received(SlotLayout(2, 2, 8), 3, [0, 1], 0) == 1 * 1 * 4 + 1 * 4
    assert elements_received(SlotLayout(2, 2, 8), 3, [0], 0) == 1 * 2 * 4  # the lost group's slots too
    assert elements_received(SlotLayout(4, 2, 8), 3, [0, 1], 1) == 1 * 2 * 4 + 2 * 4  # groups 3 and 2 dealt


@pytest.mark.parametrize("members", [[0, 1, 2, 3], [0, 1], [2, 3]])
def test_partials_already_reduce_scattered_are_added_in_group_order_whichever_groups_live(members):
    """``reduce_partials`` (FSDP2's shares: each rank holds its shard of each group partial it computed and
    its slot's loss): every member gets its shard of the partials' sum in group order, the loss summed over
    the slots by the tree, and the flags' counts, bitwise the same with either group lost; and every
    micro-batch's extras (SDC detection values, a NaN and a -0.0 among them) as the rank that computed it
    (a survivor, for a lost group's) gave them."""
    layout = SlotLayout(2, 2, 8)
    extras = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    extras[0, 0], extras[-1, 1] = float("nan"), -0.0
    partials = {(j, s): torch.randn(3 + (s == 0), generator=torch.Generator().manual_seed(10 * j + s))
                for j in range(2) for s in range(2)}  # shard 0 one element longer (uneven rows)
    slot_loss = {(j, s): torch.tensor([0.1 * (2 * j + s) + 0.01]) for j in range(2) for s in range(2)}
    expected_loss = float(tree_sum([tree_sum([slot_loss[j, s] for s in range(2)]) for j in range(2)]))

    def rank(group, rank: int):
        exchange = Exchange(members, rank, layout)
        shares = {j: torch.cat([partials[j, exchange.shard], slot_loss[j, exchange.shard]]) for j in exchange.my_groups()}
        mine = torch.zeros_like(extras)
        mine[exchange.my_micro_batches()] = extras[exchange.my_micro_batches()]
        return reduce_partials(group, exchange, shares, [1], lambda work: work.wait(), mine)

    for member, summed in run_ranks(members, rank).items():
        assert torch.equal(summed.gradient, partials[0, member % 2] + partials[1, member % 2]), member
        assert summed.loss == expected_loss and summed.flags == [len(members)], member
        assert summed.extras.numpy().tobytes() == (extras + 0.0).numpy().tobytes(), member  # -0.0 arrives +0.0


def test_tensor_parallel_peers_share_a_slot_and_the_first_of_them_is_counted_as_its_rank():
    # 2 groups of dp_shard 2 x tp 2 (8 ranks, tp fastest): ranks 4k..4k+3 are group k, slots (0,1) by dp position
    layout = SlotLayout(2, 2, 8, tp=2)
    assert layout.ranks_per_group == 4
    every = Exchange(list(range(8)), 5, layout)
    assert (every.group, every.shard, every.slot) == (1, 1, 0)
    assert Exchange(list(range(8)), 4, layout).my_micro_batches() == every.my_micro_batches() == [4, 5]
    assert Exchange(list(range(8)), 6, layout).my_micro_batches() == [6, 7]
    assert layout.computed_by([0, 1]) == [0, 0, 2, 2, 4, 4, 6, 6]
    # group 1 lost: group 0's ranks at each dp position compute group 1's slot at that position too
    degraded = Exchange([0, 1, 2, 3], 1, layout)
    assert degraded.my_micro_batches() == [0, 1, 4, 5] and degraded.live_groups() == [0]
    assert layout.computed_by([0]) == [0, 0, 2, 2, 0, 0, 2, 2]
