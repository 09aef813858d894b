"""Mirroring committed checkpoints from a training run in a background thread.

``submit`` is called on rank 0 after each durable commit and only enqueues: no training step ever
waits for the mirror. One worker thread uploads in commit order; a failure (mirror unreachable,
wrong credentials, missing bucket) becomes a ``mirror_failed`` event and one warning line, and
training goes on. Checkpoints waiting for their upload are reported by ``pending_steps`` so that
durable retention does not delete them first. On start the worker also finishes what an earlier
incarnation left: committed local checkpoints that should be mirrored but are not complete there.

A rollback abandons the checkpoints newer than the one it restored (``abandon_after``): their queued
uploads are dropped, and a job behind any upload in flight deletes their mirrored copies, so the
mirror never offers ``--resume URL`` a state the run fled from. Every job carries a ticket (the order
in which it was decided); an upload is dropped only when it was decided before the rollback, so the
same step saved again on the new timeline (queued after the deletion) is uploaded and kept.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass
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
ABANDONED = "abandoned by a rollback"


@dataclass(frozen=True)
class _Job:
    kind: str  # "upload", "catch up" or "abandon"
    step: int  # upload: the checkpoint's step; abandon: the step restored (newer ones are abandoned)
    ticket: int  # when it was decided: a rollback drops the uploads of abandoned steps decided before it
    path: Path | None = None
    in_flight: int | None = None  # abandon: an abandoned step whose upload was running (its remnants go too)


class BackgroundMirror:
    def __init__(self, config: MirrorConfig, root: Path, events: EventLog):
        self.config = config
        self.root = Path(root)
        self.events = events
        self.mirror = open_mirror(config.url, config.endpoint_url)
        self.throttle = throttle_from_mbps(config.bandwidth_mbps)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: Counter[int] = Counter()  # queued or running uploads by step
        self._lock = threading.Lock()
        self._tickets = 0
        self._rollbacks: list[tuple[int, int]] = []  # (ticket, step restored) of each abandon_after
        self._uploading: int | None = None
        self._thread = threading.Thread(target=self._run, name="trainguard-mirror", daemon=True)
        self._queue.put(_Job("catch up", _CATCH_UP, self._ticket()))
        self._thread.start()

    def wants(self, step: int) -> bool:
        return step % self.config.every == 0

    def submit(self, step: int, path: Path) -> None:
        """Queues the committed checkpoint ``path`` for upload if its step is one to mirror."""
        if not self.wants(step):
            return
        with self._lock:
            self._enqueue_upload(step, Path(path), self._ticket())

    def abandon_after(self, step: int) -> None:
        """A rollback restored ``step``: the uploads of newer steps queued until now are dropped, and
        once the upload in flight (if any) has ended, every mirrored copy newer than ``step`` is
        deleted. Uploads submitted after this call (the new timeline) are not affected."""
        with self._lock:
            ticket = self._ticket()
            self._rollbacks.append((ticket, step))
            in_flight = self._uploading if self._uploading is not None and self._uploading > step else None
            self._queue.put(_Job("abandon", step, ticket, in_flight=in_flight))

    def pending_steps(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def _ticket(self) -> int:
        self._tickets += 1
        return self._tickets

    def _enqueue_upload(self, step: int, path: Path, ticket: int) -> None:
        self._pending[step] += 1
        self._queue.put(_Job("upload", step, ticket, path))

    def _abandoned(self, job: _Job) -> bool:
        """True for an upload of a step that a rollback abandoned after the upload was decided."""
        return any(job.ticket < ticket and job.step > restored for ticket, restored in self._rollbacks)

    def close(self) -> None:
        """Waits for the queued uploads to finish (at the end of a run, never during a step)."""
        waiting = self.pending_steps()
        if waiting:
            log.info("waiting for %d mirror upload(s) to %s to finish", len(waiting), self.mirror.url)
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if job.kind == "catch up":
                    self._catch_up(job.ticket)
                elif job.kind == "abandon":
                    self._delete_abandoned(job)
                else:
                    self._upload(job)
            except Exception as exc:  # reported, never raised into training
                message = str(exc) if isinstance(exc, CheckpointError) else describe_error(exc, self.mirror.url)
                with self._lock:
                    abandoned = job.kind == "upload" and self._abandoned(job)
                if abandoned:  # its files were deleted under it by the rollback: nothing lost
                    log.info("mirror: upload of global_step_%d stopped: %s", job.step, ABANDONED)
                elif job.kind == "abandon":
                    log.warning("mirror: checkpoints after global_step_%d (%s) not deleted from %s: %s",
                                job.step, ABANDONED, self.mirror.url, message)
                    self.events.emit("mirror_failed", step=None, url=self.mirror.url, error=message,
                                     abandoned_after=job.step)
                else:
                    what = "earlier checkpoints" if job.kind == "catch up" else f"checkpoint global_step_{job.step}"
                    log.warning("mirror: %s not mirrored: %s", what, message)
                    self.events.emit("mirror_failed", step=job.step if job.step >= 0 else None, url=self.mirror.url,
                                     error=message)
            finally:
                with self._lock:
                    self._uploading = None
                    if job.kind == "upload":
                        self._pending -= Counter({job.step: 1})

    def _upload(self, job: _Job) -> None:
        with self._lock:
            if self._abandoned(job):  # queued before a rollback abandoned its step
                return
            self._uploading = job.step
        step, path = job.step, job.path
        if not path.is_dir():  # deleted before its turn (e.g. replaced by a redone step)
            return
        result = mirror_checkpoint(path, self.mirror, throttle=self.throttle, workers=self.config.workers)
        if not result.already_complete:
            log.info("mirrored global_step_%d to %s (%.1f MB in %.1fs)", step, result.url,
                     result.bytes_uploaded / 1e6, result.seconds)
        self.events.emit("checkpoint_mirrored", step=step, url=result.url, bytes=result.bytes_total,
                         bytes_uploaded=result.bytes_uploaded, seconds=result.seconds,
                         already_complete=result.already_complete)
        with self._lock:
            abandoned = self._abandoned(job)
        if not abandoned:  # the deletion queued behind it removes it; retention must not count it
            self._apply_retention()

    def _catch_up(self, ticket: int) -> None:
        mirrored = list_mirrored(self.mirror)
        for info in list_checkpoints(self.root):
            if info.committed and self.wants(info.step) and info.step not in mirrored:
                with self._lock:  # decided now: a rollback after this drops them like any queued upload
                    self._enqueue_upload(info.step, info.path, ticket)

    def _delete_abandoned(self, job: _Job) -> None:
        """Deletes every mirrored copy newer than the restored ``job.step``, newest first, and what the
        upload running at the rollback left if it did not finish. Only uploads of the old timeline
        ran before this job: the new timeline's are queued behind it."""
        mirrored = list_mirrored(self.mirror)
        abandoned = {step for step in mirrored if step > job.step}
        for step in sorted(abandoned | ({job.in_flight} if job.in_flight is not None else set()), reverse=True):
            delete_mirrored(self.mirror, step)
            if step in abandoned:
                log.info("mirror: deleted global_step_%d from %s (%s at step %d)", step, self.mirror.url,
                         ABANDONED, job.step)
                self.events.emit("checkpoint_deleted", step=step, reason=ABANDONED, tier="mirror")

    def _apply_retention(self) -> None:
        if self.config.keep_every is None:
            return
        mirrored = list_mirrored(self.mirror)
        unhealthy = [s for s, m in mirrored.items() if marked_unhealthy(m.health)]
        for step in mirror_deletions(mirrored, self.config.keep_every, unhealthy):
            delete_mirrored(self.mirror, step)
            self.events.emit("checkpoint_deleted", step=step, reason="retention", tier="mirror")
