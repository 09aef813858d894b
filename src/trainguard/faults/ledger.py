"""Which one-shot faults already fired in a run directory, so a restarted run does not repeat them."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from trainguard.faults.spec import FaultSpec


def marker_name(spec: FaultSpec, rank: int) -> str:
    """Index plus a hash of the text: editing an entry makes it a new fault that fires again."""
    digest = hashlib.sha256(spec.text.encode()).hexdigest()[:12]
    return f"{spec.index}-{digest}-rank{rank}"


class FiredLedger:
    """Marker files in ``RUN_DIR/faults/fired/``, one per fault and rank."""

    def __init__(self, run_dir: Path, rank: int):
        self.directory = Path(run_dir) / "faults" / "fired"
        self.rank = rank
        self._claimed: set[int] = set()

    def claim(self, spec: FaultSpec, step: int) -> bool:
        """Records the firing durably and says whether this caller may fire; False if it already fired.

        The marker is fsynced before the caller acts, so a fault that kills the process is still
        recorded; creating it with O_EXCL makes the claim atomic.
        """
        if spec.index in self._claimed:
            return False
        self._claimed.add(spec.index)
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.directory / marker_name(spec, self.rank), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            record = {
                "index": spec.index, "text": spec.text, "rank": self.rank, "step": step, "time": time.time(), "pid": os.getpid()
            }
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        directory_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)
        return True
