"""An FSDP2 model's state as plain rows (``live/dtensor_state.py``), on a real one-rank gloo group: tied
weights (one parameter under two keys of ``state_dict()``, as llama-micro's embedding and output layer)
come out as one shared copy, so a live rank's final file and a joiner's transfer hold its rows once; and
the rows go back into the DTensor shards bitwise."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trainguard.live.dtensor_state import model_state_like, plain


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


@pytest.fixture
def mesh(tmp_path):
    assert not dist.is_initialized(), "a process group is already initialised in this process"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_tied_dtensors_become_one_shared_copy_and_load_back_bitwise(mesh):
    torch.manual_seed(0)
    model = fully_shard(_Tied(), mesh=mesh)
    state = model.state_dict()
    assert isinstance(state["embed.weight"], DTensor) and state["embed.weight"] is not state["head.weight"]
    rows = plain(state)
    assert not isinstance(rows["embed.weight"], DTensor) and rows["embed.weight"] is rows["head.weight"]
    one, both = io.BytesIO(), io.BytesIO()
    torch.save({"embed.weight": rows["embed.weight"]}, one)
    torch.save(rows, both)
    assert len(both.getvalue()) < 1.5 * len(one.getvalue())  # the 512 bytes of rows saved once, not twice
    expected = model.embed.weight.to_local().clone()
    with torch.no_grad():
        model.embed.weight.to_local().zero_()
    model.load_state_dict(model_state_like(model, torch.load(io.BytesIO(both.getvalue()), weights_only=True)))
    assert torch.equal(model.embed.weight.to_local(), expected) and model.head.weight is model.embed.weight


def test_distinct_dtensors_stay_distinct_copies(mesh):
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), mesh=mesh)
    rows = plain({"model": model.state_dict(), "again": [model.state_dict()["0.weight"]]})
    assert len({id(tensor) for tensor in rows["model"].values()}) == 4
    assert rows["again"][0] is rows["model"]["0.weight"]  # the same shard met twice: one copy
    assert not any(tensor.untyped_storage().data_ptr() == model[0].weight.to_local().untyped_storage().data_ptr()
                   for tensor in rows["model"].values())  # copies, not views of the live shards
