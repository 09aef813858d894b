"""The ``checkpoint`` section: how often each tier saves, what is kept, where a run resumes from."""

from __future__ import annotations

from dataclasses import dataclass, field

WRITERS = ("process", "thread")
"""The values of ``checkpoint.writer``."""


@dataclass
class MirrorConfig:
    url: str | None = None  # any fsspec URL (s3://bucket/prefix, file:///path, ...); None: no mirror
    every: int = 1  # mirror committed checkpoints whose step is a multiple of this (1 = every one)
    keep_every: int | None = None  # in the mirror keep only multiples of this step (and the newest); None = all
    bandwidth_mbps: float | None = None  # upload cap in megabytes (10^6 bytes) per second; None = no cap
    endpoint_url: str | None = None  # S3-compatible endpoint; default AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    workers: int = 4  # files uploaded at once


@dataclass
class CheckpointConfig:
    save_interval: int = 50  # 0 disables periodic saves
    keep_last: int = 3
    keep_every: int | None = None
    async_save: bool = True
    writer: str = "process"  # where async saves and the memory tier write: "process" (a writer process per rank) or "thread"
    resume: str = "auto"
    local_interval: int = 0  # steps between local-tier saves (every rank its own files); 0 = off
    local_dir: str | None = None  # template with {node} and {rank}; relative to the run dir; None = local/node{node}
    local_keep_last: int = 2
    memory_interval: int = 0  # steps between memory-tier saves (the local tier in node memory, lazy copy); 0 = off
    memory_dir: str | None = None  # template with {run}, {node} and {rank}; None = /dev/shm/trainguard/{run}/node{node}
    memory_keep_last: int = 2
    mirror: MirrorConfig = field(default_factory=MirrorConfig)
