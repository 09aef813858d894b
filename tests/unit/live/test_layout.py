"""The parameter layout a live rank gets (``live/layout.py``'s ``choose_layout``, ``layout_build``) and the
layouts' logic that needs no process group: which micro-batches a rank computes and who computes each, the
whole replicas' gradients from the step's sum, and the micro-batch loop that replica and row layouts share
(a raising loss caught as one line). Their collectives run in tests/integration/test_live_*.py."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainguard.errors import ConfigError
from trainguard.live.collective import EpochAborted, end_epoch, leave_if_ended
from trainguard.live.group_reduce import Exchange, SlotLayout
from trainguard.live.layout import LayoutKind, choose_layout
from trainguard.live.layout_build import build_layout
from trainguard.live.layout_replica import ReplicaLayout, set_whole_grads
from trainguard.live.layout_rows import RowsLayout
from trainguard.live.micro_batch import StepWork, compute_micro_batches


@pytest.mark.parametrize(("fully_sharded", "group_size", "tp", "kind"), [
    (False, 1, 1, LayoutKind.REPLICA),
    (False, 2, 1, LayoutKind.ROWS),
    (False, 4, 1, LayoutKind.ROWS),
    (True, 2, 1, LayoutKind.FSDP),
    (True, 4, 2, LayoutKind.FSDP),  # tensor parallel is a parameter of the FSDP2 layout
])
def test_a_model_and_mesh_get_one_layout(fully_sharded, group_size, tp, kind):
    assert choose_layout(fully_sharded, group_size, tp) is kind


@pytest.mark.parametrize(("fully_sharded", "group_size", "tp", "names"), [
    (True, 1, 1, ("fully_shard", "parallel.dp_shard is 1", "trainguard.data_parallel_mesh()")),
    (False, 2, 2, ("parallel.tp=2", "no FSDP2 module", "trainguard.device_mesh(tp)")),
    (False, 1, 2, ("parallel.tp=2", "no FSDP2 module")),
])
def test_a_model_the_mesh_cannot_hold_is_refused_in_one_line(fully_sharded, group_size, tp, names):
    with pytest.raises(ConfigError) as refused:
        choose_layout(fully_sharded, group_size, tp)
    line = str(refused.value)
    assert "\n" not in line and all(name in line for name in names)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_build_layout_makes_the_chosen_layout_and_checks_the_slots_first():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replica = build_layout(model, optimizer, None, 1, 1, SlotLayout(4, 1, 8))
    assert isinstance(replica, ReplicaLayout) and replica.kind is LayoutKind.REPLICA and not replica.marks_span_step
    whole = [p.shape for p in model.parameters()]
    rows = build_layout(model, optimizer, None, 3, 2, SlotLayout(2, 2, 8))
    assert isinstance(rows, RowsLayout) and rows.marks_span_step
    assert [p.shape[0] for p in model.parameters()] == [2, 2, 1, 1]  # rank 3 keeps shard 1's rows (4, 4, 2, 2 split in two)
    assert [p.shape[1:] for p in model.parameters()] == [s[1:] for s in whole]
    with pytest.raises(ValueError, match="train.micro_batches"):  # 2 × 2 slots do not divide 6 micro-batches
        build_layout(_model(), optimizer, None, 0, 2, SlotLayout(2, 2, 6))
    with pytest.raises(ConfigError, match="parallel.tp=2"):
        build_layout(_model(), optimizer, None, 0, 4, SlotLayout(2, 2, 8, tp=2))


def test_whole_replicas_deal_micro_batches_round_robin_over_the_members():
    layout = ReplicaLayout(_model(), None, 3, 8)
    exchange = Exchange([0, 1, 3], 3, SlotLayout(4, 1, 8))  # rank 2 lost
    assert layout.my_micro_batches(exchange) == [2, 5]
    assert layout.computed_by(exchange) == [0, 1, 3, 0, 1, 3, 0, 1]
    assert torch.equal(layout.over_shards(torch.tensor([1.0, 2.0])), torch.tensor([[1.0, 2.0]]))


def test_row_shards_compute_their_slot_and_a_lost_groups_at_the_same_position():
    slots = SlotLayout(2, 2, 8)
    layout = build_layout(_model(), None, None, 1, 2, slots)
    exchange = Exchange([0, 1], 1, slots)  # group 1 (ranks 2, 3) lost: group 0 computes its slots too
    assert layout.my_micro_batches(exchange) == [2, 3, 6, 7]
    assert layout.computed_by(exchange) == [0, 0, 1, 1, 0, 0, 1, 1]


def test_set_whole_grads_lays_the_flat_sum_out_over_the_parameters():
    model = _model()
    flat = torch.arange(sum(p.numel() for p in model.parameters()), dtype=torch.float32)
    set_whole_grads(model, flat)
    assert torch.equal(torch.cat([p.grad.flatten() for p in model.parameters()]), flat)


def _work(loss_of, measure=None) -> StepWork:
    return StepWork(step=5, loss_of=loss_of, position=5, micro_batches=4, seed=1, beat=lambda: None, measure=measure)


def test_the_micro_batch_loop_rows_are_the_gradient_then_the_share_of_the_loss():
    model, data = _model(), torch.randn(4, 3, 3)
    measured = []
    computed, failure = compute_micro_batches(model, _work(lambda m, t, i: m(data[i]).square().mean(),
                                                           measured.append), [1, 3], catch=False)
    assert failure is None and sorted(computed) == [1, 3] and measured == [1, 3]
    numel = sum(p.numel() for p in model.parameters())
    assert all(row.numel() == numel + 1 for row in computed.values())
    expected = model(data[3]).square().mean().detach() / 4
    assert float(computed[3][-1]) == pytest.approx(float(expected))


def test_a_raising_loss_is_one_line_with_zeros_from_that_micro_batch_or_raises_without_catch():
    model = _model()

    def loss_of(m, t, i):
        if i == 2:
            raise KeyError("no sample 2")
        return m(torch.ones(1, 3)).sum()

    computed, failure = compute_micro_batches(model, _work(loss_of), [0, 2, 3], catch=True)
    assert failure is not None and "KeyError" in failure and "\n" not in failure
    assert computed[0].abs().sum() > 0 and not computed[2].any() and not computed[3].any()
    with pytest.raises(KeyError):
        compute_micro_batches(model, _work(loss_of), [0, 2, 3], catch=False)


def test_the_micro_batch_loop_leaves_at_the_next_micro_batch_once_its_epoch_has_ended():
    """A member died while this rank computed: the rest of its micro-batches are not computed (the next epoch
    computes the step again), even with ``catch`` on, which is for the loss's own errors."""
    model, computed_by_loss = _model(), []

    def loss_of(m, t, i):
        computed_by_loss.append(i)
        return m(torch.ones(1, 3)).sum()

    def leave_if_ended():
        if computed_by_loss:  # the epoch ended during the first micro-batch
            raise EpochAborted("epoch 0 ended while this rank computed step 5")

    work = dataclasses.replace(_work(loss_of), leave_if_ended=leave_if_ended)
    with pytest.raises(EpochAborted, match="computed step 5"):
        compute_micro_batches(model, work, [0, 2, 3], catch=True)
    assert computed_by_loss == [0]


class _CountingStore:
    """A real ``HashStore`` whose ``check`` calls (one loopback round trip each on the run's TCPStore) are counted."""

    def __init__(self):
        self.store, self.checks = dist.HashStore(), 0

    def set(self, key, value):
        self.store.set(key, value)

    def check(self, keys):
        self.checks += 1
        return self.store.check(keys)


def test_the_micro_batch_loop_looks_at_the_epoch_before_its_first_micro_batch_too():
    """One store check per micro-batch, the first one's included: for whole replicas nothing reads
    ``abort/<epoch>`` between the previous step's sum and the first micro-batch (``LiveStep``'s ``begin`` reads
    no store key unless a replica check is due; the sum's wait reads it only while the sum is incomplete; the
    rows' gather reads it only while its thread is still running at a poll), and ``LiveRank.step``'s caller
    runs its own code between steps: the first check is the one that sees a member that died between two
    steps, before any micro-batch is computed."""
    model, computed_by_loss, store = _model(), [], _CountingStore()

    def loss_of(m, t, i):
        computed_by_loss.append(i)
        return m(torch.ones(1, 3)).sum()

    work = dataclasses.replace(_work(loss_of), leave_if_ended=functools.partial(leave_if_ended, store, 7,
                                                                                "computed step 5"))
    computed, _ = compute_micro_batches(model, work, [0, 2, 3], catch=True)
    assert sorted(computed) == [0, 2, 3] and store.checks == 3
    end_epoch(store, 7)  # a member died after the step's sum, before the next step
    with pytest.raises(EpochAborted, match="epoch 7 ended while this rank computed step 5"):
        compute_micro_batches(model, work, [0, 2, 3], catch=True)
    assert computed_by_loss == [0, 2, 3] and store.checks == 4


def test_fsdp2_registers_its_unsharded_parameters_while_it_computes_which_the_fsdp_layout_reads_as_not_at_rest():
    """``FsdpLayout.at_rest`` (what a rank whose store is gone may save to its per-rank tier) compares the
    module's registered parameters with the sharded ones it saw at its start: FSDP2 registers other objects
    while a module is unsharded and its sharded ones again after."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        sharded = list(model.parameters())
        model.unshard()
        assert not any(param is kept for param, kept in zip(model.parameters(), sharded))
        model.reshard()
        assert all(param is kept for param, kept in zip(model.parameters(), sharded))
    finally:
        dist.destroy_process_group()
