"""A trainguard durable (DCP) checkpoint as pieces: each saved chunk read straight from its record."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from trainguard.checkpoint.manifest import read_manifest
from trainguard.checkpoint.safe_load import DCP_METADATA_NAME, load_dcp_metadata
from trainguard.errors import CheckpointError
from trainguard.merge.pieces import CheckpointContents, Piece, ShardedTensor


def _read_record(path: Path, offset: int, length: int, what: str):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (it holds {what})") from None
    if len(data) != length:
        raise CheckpointError(f"{path}: truncated ({what} needs bytes {offset}..{offset + length})")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load {what} at byte {offset}: {type(exc).__name__}") from None


def open_dcp(directory: Path) -> CheckpointContents:
    metadata = load_dcp_metadata(directory)
    storage = {}
    for index, info in (metadata.storage_data or {}).items():
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{directory / info.relative_path}: {index.fqn} is stored with transforms "
                                  f"{info.transform_descriptors}, which this reader does not apply")
        storage[(index.fqn, tuple(index.offset) if index.offset is not None else None)] = info

    def locate(key: str, offsets: tuple[int, ...] | None):
        info = storage.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{directory / DCP_METADATA_NAME}: no storage entry for {key} at {offsets}")
        return directory / info.relative_path, info.offset, info.length

    tensors: dict[str, ShardedTensor] = {}
    objects = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensor = ShardedTensor(key, tuple(item.size), item.properties.dtype)
            for chunk in item.chunks:
                path, offset, length = locate(key, tuple(chunk.offsets))
                what = f"{key} block {list(chunk.offsets)}"
                read = (lambda p=path, o=offset, n=length, w=what: _read_record(p, o, n, w))
                tensor.pieces.append(Piece(tuple(chunk.offsets), tuple(chunk.sizes), read,
                                           f"{path.name} at byte {offset}"))
            tensors[key] = tensor
        elif isinstance(item, BytesStorageMetadata):
            path, offset, length = locate(key, None)
            objects[key] = _read_record(path, offset, length, key)
    world_size, mesh_shape, mesh_dims = 1, [1], ["world"]
    try:
        manifest = read_manifest(directory)
        world_size, mesh_shape, mesh_dims = manifest.world_size, manifest.mesh_shape, manifest.mesh_dim_names
    except CheckpointError:
        pass  # a DCP checkpoint written by other tools: no manifest, the layout does not matter for reading
    return CheckpointContents(tensors, objects, f"DCP checkpoint {directory}", world_size, mesh_shape, mesh_dims)
