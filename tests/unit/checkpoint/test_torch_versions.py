"""What differs between torch versions: the DTensor allow-list holds what this torch has, a file naming a
torch class this torch lacks is refused in one line naming the class and this torch, the mesh pickled
into replicas' files records the same rank with or without ``DeviceMesh``'s ``_rank``, and tensor records
are written by ``torch.save`` where torch's private writer differs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainguard.checkpoint import hashing_file
from trainguard.checkpoint.hashing_file import HashingFile, save_tensor
from trainguard.checkpoint.local.paths import FSDP_CONFIG_NAME, TORCH_VERSION_KEY
from trainguard.checkpoint.local.state import MESH_TAKES_RANK, mesh_as_seen_by
from trainguard.checkpoint.local.tier import written_under
from trainguard.checkpoint.safe_load import DTENSOR_CLASS_NAMES, resolve_global, safe_torch_load
from trainguard.errors import IncompatibleCheckpointError


def test_the_allow_list_names_classes_some_supported_torch_lacks_and_resolves_only_what_exists():
    resolved = {name: resolve_global(name) for name in DTENSOR_CLASS_NAMES}
    assert resolved["torch.distributed.tensor.DTensor"] is DTensor
    assert resolved["torch.distributed.tensor.placement_types.Shard"] is Shard
    assert resolve_global("torch.distributed._mesh_layout._NoSuchLayout") is None
    assert resolve_global("torch.no_such_module.Thing") is None


class FromANewerTorch:
    """Stands for a class a newer torch pickles into a DTensor's spec (``_mesh_layout._FlatLayout`` under
    2.15 read by 2.10, ``_mesh_layout._MeshLayout`` under 2.13 read by 2.8)."""

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes


def test_a_file_naming_a_torch_class_this_torch_lacks_is_refused_in_one_line(tmp_path, monkeypatch):
    import torch.distributed.device_mesh as home

    FromANewerTorch.__module__ = home.__name__
    FromANewerTorch.__qualname__ = FromANewerTorch.__name__ = "_LayoutOfANewerTorch"
    monkeypatch.setattr(home, "_LayoutOfANewerTorch", FromANewerTorch, raising=False)
    path = tmp_path / "model_world_size_2_rank_0.pt"
    torch.save({"weight": torch.ones(2), "layout": FromANewerTorch((2,))}, path)
    monkeypatch.delattr(home, "_LayoutOfANewerTorch")  # now as under the older torch that reads it

    with pytest.raises(IncompatibleCheckpointError) as refused:
        safe_torch_load(path)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (f"cannot load {path}: it names torch.distributed.device_mesh._LayoutOfANewerTorch, which "
                       f"torch {torch.__version__} lacks")


def test_a_local_step_says_which_torch_wrote_it(tmp_path):
    assert written_under(tmp_path) == "unknown"  # steps of trainguard versions that did not record it
    (tmp_path / FSDP_CONFIG_NAME).write_text(json.dumps({"FSDP_version": 2, TORCH_VERSION_KEY: "2.15.0"}))
    assert written_under(tmp_path) == "2.15.0"


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_pickled_mesh_records_the_rank_it_is_built_for_not_the_callers(one_rank_group):
    """Replicas' local-tier files are byte-identical: the mesh in them records the lowest replica's rank,
    through ``DeviceMesh``'s ``_rank`` keyword from torch 2.10, through the fallback before (``make
    test-compat`` runs this under both)."""
    ranks = torch.arange(4).reshape(2, 2)
    mesh = mesh_as_seen_by(ranks, ("ddp", "fsdp"), 3)
    assert list(mesh.get_coordinate()) == [1, 1]
    assert mesh.mesh_dim_names == ("ddp", "fsdp")
    if MESH_TAKES_RANK:
        assert list(DeviceMesh("cpu", ranks, _init_backend=False).get_coordinate()) == [0, 0]  # the caller's


@pytest.mark.parametrize("fast", [True, False], ids=["private-writer", "torch.save-fallback"])
def test_a_tensor_record_loads_back_with_either_writer(tmp_path, monkeypatch, fast):
    if fast and not hashing_file.FAST_TENSOR_SAVE:
        pytest.skip(f"torch {torch.__version__}'s private writer differs: only the fallback runs here")
    monkeypatch.setattr(hashing_file, "FAST_TENSOR_SAVE", fast)
    tensor = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    stream = HashingFile(tmp_path / "record")
    save_tensor(tensor, stream)
    stream.close_durably()
    assert torch.equal(torch.load(tmp_path / "record", weights_only=True), tensor)
