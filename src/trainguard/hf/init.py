"""Initial weights from a Hugging Face directory, read shard by shard: every rank reads only its own slices.

How (the torchtitan recipe, with PyTorch's own Hugging Face reader):

1. the model is built on the ``meta`` device (``hf.config.build_empty_model``): no memory, no initialization;
2. it is parallelized as usual (TP, FSDP2 / HSDP, or pruned to a pipeline stage), still on ``meta``;
3. :func:`materialize` allocates each rank's shards (uninitialized) and recomputes the non-persistent
   buffers (the rotary frequencies), which no checkpoint holds;
4. :func:`load_hf_weights` runs ``torch.distributed.checkpoint.load`` on the model's sharded state dict
   with :class:`HFDirReader`, a ``StorageReader`` (DCP's public reader interface) over the files the
   index names. DCP plans, for each rank, the slices its DTensor shards own; the reader reads each with
   ``safe_open(...).get_slice(name)[slices]`` from the memory-mapped file and copies it into the shard.
   No rank broadcasts, no process ever holds a full copy of the model.

Weights are converted to the model's dtype (float32) as they are copied.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from transformers import PretrainedConfig

from trainguard.hf.config import HFTensor, hf_tensors, tensors_to_load
from trainguard.hf.fused_experts import StoredTensor, model_shape


def materialize(model: nn.Module, device: torch.device, hf_model: nn.Module) -> None:
    """Allocates ``model``'s parameters and buffers (this rank's shards only) on ``device``, uninitialized,
    then recomputes the non-persistent buffers with ``hf_model``'s own initializer (``hf_model`` is the
    Hugging Face model ``model`` was built from, or ``model`` itself)."""
    model.to_empty(device=device)
    for module in model.modules():
        if module._non_persistent_buffers_set:
            hf_model._init_weights(module)


@dataclass(frozen=True)
class StoredChunk:
    """Where one chunk of a model tensor lies: the checkpoint tensor ``name`` in the safetensors ``file``."""

    file: str
    name: str


class HFDirReader(StorageReader):
    """A DCP reader of a Hugging Face directory whose metadata comes from the checked files of the
    directory (the index's shards, or ``model.safetensors``), not from every ``*.safetensors`` file lying
    there, and names the model's tensors: a fused expert tensor (``hf.fused_experts``) is described as
    made of one chunk per checkpoint tensor that holds a block of it, so DCP asks each rank's slice of it
    from just the per-expert tensors that slice covers. Written on DCP's public ``StorageReader``
    interface, not on ``HuggingFaceStorageReader``, whose storage records and read path are private and
    changed between torch 2.8 and 2.9."""

    def __init__(self, tensors: dict[str, HFTensor], to_load: dict[str, list[StoredTensor]]):
        super().__init__()
        self.tensors = tensors
        self.to_load = to_load  # model tensor -> the checkpoint tensors that hold it (tensors_to_load)
        self.bytes_read = 0
        self.storage_data: dict[MetadataIndex, StoredChunk] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return Path(checkpoint_id).is_dir()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        state_dict_metadata: dict[str, TensorStorageMetadata] = {}
        storage_data: dict[MetadataIndex, StoredChunk] = {}
        for name, parts in self.to_load.items():
            shape = model_shape(parts)
            chunks = [ChunkStorageMetadata(offsets=torch.Size(part.offsets), sizes=torch.Size(part.block_sizes(len(shape))))
                      for part in parts]
            for part, chunk in zip(parts, chunks):
                stored = self.tensors[part.name]
                storage_data[MetadataIndex(fqn=name, offset=chunk.offsets)] = StoredChunk(str(stored.file), part.name)
            state_dict_metadata[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=self.tensors[parts[0].name].dtype), size=torch.Size(shape),
                chunks=chunks)
        return Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads each planned slice, one open (memory-mapped) file at a time."""
        from safetensors import safe_open

        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        for file, items in per_file.items():
            with safe_open(file, framework="pt") as f:
                for item in items:
                    self._read_slice(f, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_slice(self, f: Any, req: ReadItem, planner: LoadPlanner) -> None:
        """Reads the requested slice of the chunk from the checkpoint tensor that holds it (the slice of
        a per-expert tensor, given the fused tensor's size-1 expert dimension) into the model tensor."""
        stored = self.tensors[self.storage_data[req.storage_index].name]
        dims = len(stored.shape)
        slices = tuple(slice(offset, offset + length)
                       for offset, length in zip(req.storage_offsets[-dims:], req.lengths[-dims:]))
        block = f.get_slice(stored.name)[slices]
        self.bytes_read += block.numel() * block.element_size()
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise AssertionError(f"{stored.name}: DCP asks for {list(req.lengths)} into {list(target.shape)}")
        target.copy_(block.reshape(target.shape))
        planner.commit_tensor(req, target)


def _rss_bytes(field: str) -> int | None:
    """``VmRSS`` or ``VmHWM`` of this process from /proc (None where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss() -> int:
    return _rss_bytes("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> int:
    """Resets the kernel's peak-RSS mark (``VmHWM``) to the current RSS and returns it, so that
    :func:`peak_rss_since_reset` measures one phase (without /proc, ``ru_maxrss`` overstates it)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return current_rss()


def peak_rss_since_reset() -> int:
    return _rss_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_hf_weights(model: nn.Module, config: PretrainedConfig, hf_dir: Path,
                    process_group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Fills ``model``'s (sharded, materialized) parameters from ``hf_dir``; collective over
    ``process_group`` (all ranks, whatever their pipeline stage). Returns facts for the event log."""
    started = time.perf_counter()
    tensors = hf_tensors(Path(hf_dir))
    to_load = tensors_to_load(config, tensors, Path(hf_dir))
    # the parameters themselves (DTensors for FSDP2/TP): DCP reads into them in place
    state = {name: value for name, value in model.state_dict().items() if name in to_load}
    reader = HFDirReader(tensors, to_load)
    dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(), process_group=process_group)
    return {"tensors": len(state), "bytes_read": reader.bytes_read, "seconds": time.perf_counter() - started}
