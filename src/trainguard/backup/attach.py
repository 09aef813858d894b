"""Joining the mirror to a ``CheckpointManager`` from above, through its hooks (the checkpoint tiers
do not import ``backup``)."""

from __future__ import annotations

from pathlib import Path

from trainguard.backup.background import BackgroundMirror
from trainguard.backup.restore import restore_for_resume
from trainguard.backup.url import is_url
from trainguard.checkpoint.manager import CheckpointManager


def attach_mirror(manager: CheckpointManager, mirror: BackgroundMirror | None = None) -> None:
    """Acts on the manager's ``config.mirror``: its ``resume`` may name a mirror URL (restored into the
    run's checkpoints first); with ``mirror.url``, rank 0 also mirrors every committed checkpoint there
    in the background (queued before the manager's other commit hooks run) and retention keeps what
    still waits for upload. ``mirror``: the one to join instead of starting one (a live run's managers,
    one per quorum, share this process's)."""
    config = manager.config.mirror
    endpoint_url = config.endpoint_url if config is not None else None

    def resume_source(mode: str, root: Path) -> str:
        return restore_for_resume(mode, root, endpoint_url) if is_url(mode) else mode

    manager.resume_source = resume_source
    if manager.rank == 0 and config is not None and config.url:
        manager.mirror = mirror or BackgroundMirror(config, manager.root, manager.events)
        manager.commit_hooks.insert(0, manager.mirror.submit)
