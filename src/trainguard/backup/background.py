"""Mirroring committed checkpoints from a training run in a background thread.

``submit`` is called on rank 0 after each durable commit and only enqueues: no training step ever
waits for the mirror. One worker thread uploads in commit order; a failure (mirror unreachable,
wrong credentials, missing bucket) becomes a ``mirror_failed`` event and one warning line, and
training goes on. Checkpoints waiting for their upload are reported by ``pending_steps`` so that
durable retention does not delete them first. On start the worker also finishes what an earlier
incarnation left: committed local checkpoints that should be mirrored but are not complete there.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

from trainguard.backup.config import MirrorConfig
from trainguard.backup.mirror import delete_mirrored, list_mirrored, mirror_checkpoint
from trainguard.backup.retention_mirror import mirror_deletions
from trainguard.backup.throttle import throttle_from_mbps
from trainguard.backup.url import describe_error, open_mirror
from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.errors import CheckpointError
from trainguard.events import EventLog
from trainguard.guards.health import marked_unhealthy

log = logging.getLogger("trainguard")
_CATCH_UP = -1


class BackgroundMirror:
    def __init__(self, config: MirrorConfig, root: Path, events: EventLog):
        self.config = config
        self.root = Path(root)
        self.events = events
        self.mirror = open_mirror(config.url, config.endpoint_url)
        self.throttle = throttle_from_mbps(config.bandwidth_mbps)
        self._queue: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="trainguard-mirror", daemon=True)
        self._queue.put((_CATCH_UP, self.root))
        self._thread.start()

    def wants(self, step: int) -> bool:
        return step % self.config.every == 0

    def submit(self, step: int, path: Path) -> None:
        """Queues the committed checkpoint ``path`` for upload if its step is one to mirror."""
        if not self.wants(step):
            return
        with self._lock:
            self._pending.add(step)
        self._queue.put((step, Path(path)))

    def pending_steps(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def close(self) -> None:
        """Waits for the queued uploads to finish (at the end of a run, never during a step)."""
        waiting = self.pending_steps()
        if waiting:
            log.info("waiting for %d mirror upload(s) to %s to finish", len(waiting), self.mirror.url)
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            step, path = job
            try:
                if step == _CATCH_UP:
                    self._catch_up()
                else:
                    self._upload(step, path)
            except Exception as exc:  # reported, never raised into training
                message = str(exc) if isinstance(exc, CheckpointError) else describe_error(exc, self.mirror.url)
                what = "earlier checkpoints" if step == _CATCH_UP else f"checkpoint global_step_{step}"
                log.warning("mirror: %s not mirrored: %s", what, message)
                self.events.emit("mirror_failed", step=step if step >= 0 else None, url=self.mirror.url, error=message)
            finally:
                with self._lock:
                    self._pending.discard(step)

    def _upload(self, step: int, path: Path) -> None:
        if not path.is_dir():  # deleted before its turn (e.g. replaced by a redone step)
            return
        result = mirror_checkpoint(path, self.mirror, throttle=self.throttle, workers=self.config.workers)
        if not result.already_complete:
            log.info("mirrored global_step_%d to %s (%.1f MB in %.1fs)", step, result.url,
                     result.bytes_uploaded / 1e6, result.seconds)
        self.events.emit("checkpoint_mirrored", step=step, url=result.url, bytes=result.bytes_total,
                         bytes_uploaded=result.bytes_uploaded, seconds=result.seconds,
                         already_complete=result.already_complete)
        self._apply_retention()

    def _catch_up(self) -> None:
        mirrored = list_mirrored(self.mirror)
        for info in list_checkpoints(self.root):
            if info.committed and self.wants(info.step) and info.step not in mirrored:
                with self._lock:
                    self._pending.add(info.step)
                self._queue.put((info.step, info.path))

    def _apply_retention(self) -> None:
        if self.config.keep_every is None:
            return
        mirrored = list_mirrored(self.mirror)
        unhealthy = [s for s, m in mirrored.items() if marked_unhealthy(m.health)]
        for step in mirror_deletions(mirrored, self.config.keep_every, unhealthy):
            delete_mirrored(self.mirror, step)
            self.events.emit("checkpoint_deleted", step=step, reason="retention", tier="mirror")
