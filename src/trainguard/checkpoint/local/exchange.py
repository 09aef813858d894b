"""Point-to-point byte transfers over the local tier's own gloo group (no shared file system needed)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist


def read_for_sending(path: Path) -> bytearray:
    """A file's bytes in a writable buffer, which a tensor can wrap without another copy."""
    with open(path, "rb", buffering=0) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        view, done = memoryview(data), 0
        while done < len(data) and (count := f.readinto(view[done:])):
            done += count
    if done != len(data):
        raise OSError(f"{path}: shrank while it was read")
    return data


def send_bytes(data: bytearray, dst: int, group: dist.ProcessGroup | None) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    if data:
        dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=dst, group=group)


def recv_bytes(src: int, group: dist.ProcessGroup | None) -> memoryview:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    if not int(size):
        return memoryview(b"")
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return memoryview(data.numpy())


def swap_in_ring(data: bytes, send_to: int | None, recv_from: int | None, group: dist.ProcessGroup | None) -> bytes | None:
    """Sends ``data`` to ``send_to`` while receiving from ``recv_from`` (a ring: every rank does both)."""
    if send_to is None or recv_from is None:
        return None
    size_out, size_in = torch.tensor([len(data)], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    requests = [dist.isend(size_out, dst=send_to, group=group), dist.irecv(size_in, src=recv_from, group=group)]
    for request in requests:
        request.wait()
    payload_in = torch.empty(int(size_in), dtype=torch.uint8)
    requests = [dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=send_to, group=group),
                dist.irecv(payload_in, src=recv_from, group=group)]
    for request in requests:
        request.wait()
    return payload_in.numpy().tobytes()
