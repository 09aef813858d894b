"""A replica group's share computed with FSDP2 (``live/fsdp_share.py``, ``live/fsdp_comms.py``) over real
gloo groups in 4 forked processes, 2 replica groups x 2: each group's ranks make the group their default
group and shard a tiny MLP (dropout in it) with ``fully_shard`` over its mesh; every FSDP2 collective runs
on a 4-rank "epoch" group, as in a live run. Group 0 computes its own share and then group 1's at the same
positions; group 1 computes its own: group 0's partial of group 1 is bitwise group 1's, one
reduce-scatter ran per share, and each exchange waited once (its statuses beside its data). And the state a live rank undoes to, and sends a joiner as plain rows, comes
back bitwise into the DTensor shards. And a loss that raises mid-forward on one rank (rank 1, in its
second micro-batch, between two FSDP modules), on both ranks at once, or mid-backward on one, makes both
ranks of its group abandon the share at the same exchange, FSDP2's state reset; the share tried again is
bitwise group 1's computation of it."""

from __future__ import annotations

import multiprocessing
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainguard.live.fsdp_comms import EpochAllGather, EpochReduceScatter, GroupChannel
from trainguard.live.fsdp_share import FsdpShares, ShareAbandoned, fsdp_modules
from trainguard.live.group_reduce import SlotLayout
from trainguard.live.state import LiveState

LAYOUT = SlotLayout(2, 2, 8)


def _loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro_batch)
    return F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 3, generator=g))


class _Raiser(torch.nn.Module):
    """Raises in its ``armed``-th forward (counting from 1), or in that forward's backward with
    ``in_backward``, as a user's model whose forward or backward fails."""

    armed, in_backward = 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.armed -= 1
        if self.armed == 0 and not self.in_backward:
            raise RuntimeError("injected: the forward failed")
        if self.armed == 0:
            x = x * 1.0
            x.register_hook(self.raise_in_backward)
        return x

    @staticmethod
    def raise_in_backward(_grad: torch.Tensor) -> None:
        raise RuntimeError("injected: the backward failed")


class _NoGuards:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _rank(rank: int, port: int, results) -> None:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        group, position = divmod(rank, 2)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"mesh/{group}", store), rank=position, world_size=2)
        epoch = dist.ProcessGroupGloo(dist.PrefixStore("epoch", store), rank, 4, timedelta(seconds=30))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), _Raiser(),
                                    torch.nn.Linear(16, 3))
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        for layer in (model[0], model[4], model):
            fully_shard(layer, mesh=mesh)
        calls, exchanges, waits = [], [], []

        def counting(cls, counts):
            original = cls.__call__

            def counted(self, *args, **kwargs):
                counts.append(1)
                return original(self, *args, **kwargs)

            cls.__call__ = counted

        counting(EpochReduceScatter, calls)
        counting(EpochAllGather, exchanges)
        counting(EpochReduceScatter, exchanges)

        def wait_group(works):
            waits.append(1)
            for work in works:
                work.wait()

        channel = GroupChannel(epoch, [0, 1, 2, 3], wait_group)
        shares = FsdpShares(model, fsdp_modules(model), rank, 2, lambda: channel)
        computed = {}
        for share_of in ([0, 1] if group == 0 else [1]):
            before = len(calls)
            computed[share_of] = shares.share(_loss_of, 3, LAYOUT.slot_micro_batches(share_of, position), 8, 7,
                                              lambda: None)
            computed[f"reduce_scatters_{share_of}"] = len(calls) - before
        waits_per_exchange = len(waits) / len(exchanges)
        theirs = torch.empty_like(computed[1])  # group 1's partial at this position, sent to group 0's rank
        if group == 1:
            epoch.send([computed[1]], rank - 2, 0).wait()
        else:
            epoch.recv([theirs], rank + 2, 0).wait()
        # a step undone (LiveState.undo_point/undo) and a joiner's load of a peer's state (LiveState.state_dict),
        # both plain rows (a deepcopy of DTensors costs 5x the CPU) made DTensors again, give back the shards bitwise
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        shares.set_grads(computed[1][:-1])
        optimizer.step()
        state = LiveState(model, optimizer, _NoGuards())
        before, sent = state.undo_point(), state.state_dict()
        shares.set_grads(computed[1][:-1])
        optimizer.step()
        stepped = [param.to_local().clone() for param in model.parameters()]
        state.undo(before)
        undone = [param.to_local().clone() for param in model.parameters()]
        optimizer.step()  # the same gradients again: bitwise the step that was undone
        redone = all(torch.equal(param.to_local(), again) for param, again in zip(model.parameters(), stepped))
        state.load(sent)
        loaded = all(torch.equal(param.to_local(), kept) for param, kept in zip(model.parameters(), undone))
        plain = all(type(value) is torch.Tensor for value in [*sent["model"].values(), *before["model"].values()])
        # group 0's share of step 5: rank 1's second forward raises; then both ranks' first; then rank 1's
        # second backward (after the reduce-scatter of the last layer, before the first layer's)
        attempts = {0: [(0, False), (1, False), (0, False), (0, False)], 1: [(2, False), (1, False), (2, True),
                                                                            (0, False)]}
        failures = []
        for armed, in_backward in (attempts[position] if group == 0 else [(0, False)]):
            model[3].armed, model[3].in_backward = armed, in_backward
            try:
                retried = shares.share(_loss_of, 5, LAYOUT.slot_micro_batches(0, position), 8, 7, lambda: None)
            except ShareAbandoned as abandoned:
                failures.append(abandoned.failure)
        theirs_retried = torch.empty_like(retried)
        if group == 1:
            epoch.send([retried], rank - 2, 1).wait()
        else:
            epoch.recv([theirs_retried], rank + 2, 1).wait()
        results[rank] = {"mine_of_1": computed[1].tolist(), "group_1_rank": theirs.tolist(),
                         "undo": redone and loaded and plain,
                         "reduce_scatters": computed[f"reduce_scatters_{1}"],
                         "waits_per_exchange": waits_per_exchange,
                         "local_numel": shares.local_numel(), "failures": failures,
                         "retried_equal": group == 1 or torch.equal(retried, theirs_retried)}
    except BaseException:
        results[rank] = traceback.format_exc()


def test_a_group_computing_another_groups_share_gets_bitwise_that_groups_partial():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    context = multiprocessing.get_context("fork")
    with context.Manager() as manager:
        results = manager.dict()
        procs = [context.Process(target=_rank, args=(rank, store.port, results)) for rank in range(4)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(90)
        results = dict(results)
    for rank in range(4):
        assert isinstance(results.get(rank), dict), results.get(rank)
    assert all(results[rank]["undo"] for rank in range(4))
    # rank 1's forward raised, then both ranks', then rank 1's backward: both ranks of group 0 abandoned the share
    # each time (rank 0 at the exchange rank 1 said so in), and the last try is bitwise group 1's computation
    forward, backward = "RuntimeError: injected: the forward failed", "RuntimeError: injected: the backward failed"
    assert [results[rank]["failures"] for rank in range(4)] == [[None, forward, None], [forward, forward, backward],
                                                                 [], []]
    assert all(results[rank]["retried_equal"] for rank in range(4))
    for rank in (0, 1):  # group 0's positions computed group 1's share
        assert results[rank]["mine_of_1"] == results[rank]["group_1_rank"], rank
    # one reduce-scatter per FSDP module (3 here: two layers and the root, which holds no parameter of its
    # own) per share, not one per micro-batch
    assert {results[rank]["reduce_scatters"] for rank in range(4)} == {2}
    # each exchange's statuses travel beside its data: one round trip, one wait (not a status round first)
    assert {results[rank]["waits_per_exchange"] for rank in range(4)} == {1.0}
    # the rows of each shard: 16 x 8 + 16 + 3 x 16 + 3 = 195 elements split 8/8 rows, 2/1 rows
    assert [results[rank]["local_numel"] for rank in range(4)] == [8 * 8 + 8 + 2 * 16 + 2, 8 * 8 + 8 + 16 + 1] * 2
