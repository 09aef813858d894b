"""Offline conversion of any readable checkpoint into a durable (DCP) one, sharded or universal.

Both outputs are ordinary trainguard durable checkpoints (DCP files, ``.metadata``, the source's
extra-state files and ``huggingface/``, a manifest), so ``--resume T`` loads them on any layout with
DCP's resharding and no special path:

- ``dcp``: every distinct block of the source kept as one DCP chunk (a local per-rank checkpoint
  becomes reshardable without ever holding a full tensor);
- ``universal`` (in the spirit of reference 002's universal checkpoint): one file per parameter,
  ``<fqn>.distcp``, holding the parameter and its optimizer state as full fp32 tensors (plus its
  param-group settings), and ``universal.json`` indexing them. Any topology can start from it, and
  each parameter can be read or edited on its own.
Memory stays near one full tensor (universal) or one block (dcp).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo

from trainguard.checkpoint.hashing_file import HashingFile, save_tensor
from trainguard.fs.layout import HF_DIR, MANIFEST_NAME, parse_step_dir
from trainguard.checkpoint.commit import seal
from trainguard.checkpoint.manifest import FileEntry, build_manifest, read_manifest
from trainguard.checkpoint.safe_load import DCP_METADATA_NAME, safe_torch_load
from trainguard.errors import CheckpointError, ConfigError
from trainguard.merge.hf_layout import parameter_order
from trainguard.merge.merger import hf_dir_of, stream_full_tensors
from trainguard.merge.pieces import CheckpointContents, read_piece
from trainguard.merge.read_ranks import rank_file_dirs
from trainguard.merge.source import open_checkpoint
from trainguard.merge.target import check_target, staged_directory
from trainguard.merge.verl_state import is_verl_extra_state, trainguard_extra_state

FORMATS = ("dcp", "universal")
UNIVERSAL_INDEX = "universal.json"
_OTHER = "_other.distcp"
_EXTRA_STATE = re.compile(r"extra_state_world_size_\d+_rank_\d+\.pt")


class _DcpFiles:
    """Writes DCP records into named files and builds the matching ``.metadata``."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: dict[str, HashingFile] = {}
        self.state: dict[str, Any] = {}
        self.storage: dict[MetadataIndex, _StorageInfo] = {}

    def _file(self, name: str) -> HashingFile:
        if name not in self.files:
            # one file per parameter stays open until close: no aligned buffer each
            self.files[name] = HashingFile(self.directory / name, direct=False)
        return self.files[name]

    def tensor_chunk(self, name: str, key: str, shape: tuple[int, ...], offsets: tuple[int, ...],
                     tensor: torch.Tensor) -> None:
        stream = self._file(name)
        start = stream.tell()
        save_tensor(tensor.contiguous(), stream)
        item = self.state.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=tensor.dtype),
                                                                torch.Size(shape), []))
        item.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(tensor.shape)))
        self.storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(name, start, stream.tell() - start)

    def value(self, name: str, key: str, value: Any) -> None:
        stream = self._file(name)
        start = stream.tell()
        buffer = io.BytesIO()
        torch.save(value, buffer)
        stream.write(buffer.getbuffer())
        self.state[key] = BytesStorageMetadata()
        self.storage[MetadataIndex(key)] = _StorageInfo(name, start, stream.tell() - start)

    def close(self) -> dict[str, FileEntry]:
        entries = {}
        for name, stream in self.files.items():
            size, checksum = stream.close_durably()
            entries[name] = FileEntry(name, size, checksum)
        planner_data = {key: tuple(key.split(".", 1)) for key in self.state}
        metadata = Metadata(state_dict_metadata=self.state, planner_data=planner_data, storage_data=self.storage)
        stream = HashingFile(self.directory / DCP_METADATA_NAME)
        try:
            stream.write(pickle.dumps(metadata))
            size, checksum = stream.close_durably()
        finally:
            stream.close()
        entries[DCP_METADATA_NAME] = FileEntry(DCP_METADATA_NAME, size, checksum)
        return entries


def _parameter_of(key: str) -> str | None:
    """The parameter a key belongs to: ``model.<fqn>``, ``optim.state.<fqn>.<x>``, ``optim.param_groups.<fqn>.<x>``."""
    for prefix in ("model.", "optim.state.", "optim.param_groups."):
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return rest if prefix == "model." else rest.rsplit(".", 1)[0]
    return None


def _file_name(fqn: str) -> str:
    return f"{fqn}.distcp"


def _write_sharded(contents: CheckpointContents, out: _DcpFiles, advance: Callable[[int], None]) -> dict:
    names: dict[str, str] = {}
    for tensor in contents.tensors.values():
        for piece in tensor.pieces:
            name = names.setdefault(piece.where, f"__{len(names)}_0.distcp")
            block = read_piece(tensor, piece)
            out.tensor_chunk(name, tensor.key, tensor.shape, piece.offsets, block)
            advance(block.numel() * block.element_size())
            del block
    for key, value in contents.objects.items():
        out.value(_OTHER, key, value)
    return {}


def _write_universal(contents: CheckpointContents, out: _DcpFiles, advance: Callable[[int], None]) -> dict:
    params = [key[len("model."):] for key in contents.tensors if key.startswith("model.")]
    by_param: dict[str, list[str]] = {fqn: [] for fqn in params}
    for key in list(contents.tensors) + list(contents.objects):
        fqn = _parameter_of(key)
        by_param.setdefault(fqn if fqn in by_param else "", []).append(key)
    order = [key for keys in by_param.values() for key in keys if key in contents.tensors]
    tensors = [contents.tensors[key] for key in order]
    for key, full in zip(order, stream_full_tensors(tensors, torch.float32)):
        fqn = _parameter_of(key)
        out.tensor_chunk(_file_name(fqn) if fqn in params else _OTHER, key, tuple(full.shape),
                         (0,) * full.dim(), full)
        advance(full.numel() * full.element_size())
        del full
    for key, value in contents.objects.items():
        fqn = _parameter_of(key)
        out.value(_file_name(fqn) if fqn in params else _OTHER, key, value)
    return {
        "format": "trainguard-universal",
        "version": 1,
        "params": {fqn: {"file": _file_name(fqn), "shape": list(contents.tensors[f"model.{fqn}"].shape),
                         "dtype": "float32", "keys": sorted(by_param[fqn])} for fqn in params},
        "other": {"file": _OTHER, "keys": sorted(by_param.get("", []))},
    }


def _source_step(source: Path, contents: CheckpointContents, extra_files: list[Path]) -> tuple[int, dict]:
    try:
        manifest = read_manifest(source)
        return manifest.step, manifest.trainer_state
    except CheckpointError:
        pass
    step = parse_step_dir(source.name)
    if step is None:  # a role of a step, as verl lays it out: global_step_N/actor
        step = parse_step_dir(source.resolve().parent.name)
    if step is None and extra_files:
        step = safe_torch_load(extra_files[0]).get("step")
    if not isinstance(step, int):
        raise CheckpointError(f"{source}: cannot tell the step (no manifest, no global_step_N name of it or "
                              "its parent, no step in its extra state)")
    return step, {"step": step}


def _copy_extra_state(source: Path, target: Path, step: int) -> None:
    """trainguard's extra state as it is; verl's in trainguard's form (verl_state), so the step resumes."""
    state = safe_torch_load(source)
    if not is_verl_extra_state(state):
        shutil.copy2(source, target)
        return
    world_size, rank = (int(n) for n in re.findall(r"\d+", source.name))
    torch.save(trainguard_extra_state(state, step=step, rank=rank, world_size=world_size), target)


def convert_checkpoint(source: Path, target: Path, fmt: str, *, force: bool = False,
                       progress: Callable[[int, str], Callable[[int], None]] | None = None) -> Path:
    source, target = Path(source), Path(target)
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    check_target(target, force)
    contents = open_checkpoint(source, include_optimizer=True, param_order=lambda: parameter_order(hf_dir_of(source)))
    if not any(key.startswith("optim.") for key in contents.tensors):
        raise CheckpointError(f"{contents.description}: holds no optimizer state (optim_world_size_W_rank_R.pt "
                              "files); a resumable checkpoint needs it")
    extra_files = sorted((p for d in rank_file_dirs(source) for p in d.iterdir() if _EXTRA_STATE.fullmatch(p.name)),
                         key=lambda p: p.name)
    if not extra_files:
        raise CheckpointError(f"{source}: no extra_state_world_size_W_rank_R.pt files (step, data position, "
                              "RNG); a resumable checkpoint needs them")
    step, trainer_state = _source_step(source, contents, extra_files)
    total = sum(t.nbytes * (4 // t.dtype.itemsize if fmt == "universal" and t.dtype.is_floating_point else 1)
                for t in contents.tensors.values())
    advance = progress(total, f"converting to {fmt}") if progress else (lambda n: None)
    with staged_directory(target, force) as staging:
        out = _DcpFiles(staging)
        try:
            writer = _write_universal if fmt == "universal" else _write_sharded
            index = writer(contents, out, advance)
            known = out.close()
        finally:
            for stream in out.files.values():
                stream.close()  # after a failure; a no-op for files already closed durably
        if index:
            (staging / UNIVERSAL_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for path in extra_files:
            _copy_extra_state(path, staging / path.name, step)
        hf_dir = hf_dir_of(source)
        if hf_dir.is_dir():
            shutil.copytree(hf_dir, staging / HF_DIR)
        manifest = build_manifest(staging, step=step, world_size=contents.world_size,
                                  mesh_shape=contents.mesh_shape, mesh_dim_names=contents.mesh_dim_names,
                                  trainer_state=trainer_state, known=known,
                                  extra={"converted_from": str(source), "format": fmt})
        seal(staging, manifest, fsynced=known)  # the copies and universal.json were written plainly
    assert (target / MANIFEST_NAME).is_file()
    return target
