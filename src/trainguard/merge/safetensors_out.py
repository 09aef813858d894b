"""Streaming safetensors output: headers planned from shapes alone, then each tensor written as it comes.

safetensors' own ``save_file`` needs every tensor of a file in memory at once; the format is simple
enough (8-byte header length, JSON header with byte ranges, raw little-endian data) to write one
tensor at a time. Past ``max_shard_size`` the output is ``model-0000i-of-0000n.safetensors`` files
plus ``model.safetensors.index.json``, the layout ``from_pretrained`` reads.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainguard.fs.fsio import SYNC_FILE_RANGE_WRITE, sync_file_range
from trainguard.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB`` (10^9, as Hugging Face counts), ``500MiB``, or a byte count."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ConfigError(f"--max-shard-size {text}: expected a size like 5GB, 500MB or 2GiB")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if size <= 0:
        raise ConfigError(f"--max-shard-size {text}: must be positive")
    return size


@dataclass(frozen=True)
class OutputTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for size in self.shape:
            n *= size
        return n


def plan_shards(tensors: list[OutputTensor], max_bytes: int) -> list[list[OutputTensor]]:
    """Tensors in order into files of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(tensors: list[OutputTensor]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in _DTYPE_NAMES:
            raise ConfigError(f"{tensor.name}: dtype {tensor.dtype} cannot be written to safetensors")
        entries[tensor.name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(header)) + header




def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


class _Output:
    """A new file written sequentially; writeback of what is complete starts at once (asynchronously),
    so the disk works while later tensors are read, and the closing fsync finds little left to do."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.position = 0

    def write(self, data: memoryview) -> None:
        _write_all(self.fd, data)
        if sync_file_range is not None:
            sync_file_range(self.fd, self.position, data.nbytes, SYNC_FILE_RANGE_WRITE)
        self.position += data.nbytes

    def close_durably(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


def write_safetensors(directory: Path, tensors: list[OutputTensor], produce: Iterable[Iterable[torch.Tensor]],
                      max_bytes: int, written: Callable[[int], None] = lambda n: None) -> list[str]:
    """Writes the tensors of ``tensors`` into shards; ``produce`` gives, for each in order, parts whose
    bytes one after another are the tensor's (its row blocks, or the whole tensor). Returns the file
    names. Each file is fsynced; the caller commits the directory."""
    shards = plan_shards(tensors, max_bytes)
    names = shard_names(len(shards))
    produced = iter(produce)
    for name, shard in zip(names, shards):
        out = _Output(directory / name)
        try:
            out.write(memoryview(_header(shard)))
            for spec in shard:
                size = 0
                for part in next(produced):
                    if part.dtype != spec.dtype:
                        raise AssertionError(f"{spec.name}: produced {part.dtype}, planned {spec.dtype}")
                    data = part.contiguous().reshape(-1).view(torch.uint8).numpy()
                    out.write(memoryview(data))
                    size += data.nbytes
                    written(data.nbytes)
                    del part, data
                if size != spec.nbytes:
                    raise AssertionError(f"{spec.name}: produced {size} bytes, planned {spec.nbytes}")
        finally:
            out.close_durably()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names
