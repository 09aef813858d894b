"""A command for ``trainguard run`` whose one rank starts slowly: the supervisor's stop must reach it.

Run as ``slow_start_rank.py RUN_DIR GO_FILE``, it is the node's agent: it starts itself as the rank (the
supervisor signals only processes below an agent) and exits with the rank's code. The rank waits for
GO_FILE before it installs its stop handlers and writes its first heartbeat (a rank still importing
torch), then waits up to 30 s for a stop: exit 16 and an exit heartbeat when it got one, else 0."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trainguard.errors import EXIT_OK, EXIT_RESUMABLE_STOP
from trainguard.runtime.lifecycle import NONE, Lifecycle, LifecycleConfig


def rank(run_dir: Path, go: Path) -> int:
    while not go.exists():
        time.sleep(0.05)
    lifecycle = Lifecycle.for_rank(LifecycleConfig(), run_dir, 0, "cpu")
    lifecycle.beat("train", 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if lifecycle.decide() != NONE:
            lifecycle.beat("exit", 1, EXIT_RESUMABLE_STOP)
            return EXIT_RESUMABLE_STOP
        time.sleep(0.05)
    lifecycle.beat("exit", 1, EXIT_OK)
    return EXIT_OK


if __name__ == "__main__":
    run_dir, go = Path(sys.argv[1]), Path(sys.argv[2])
    if sys.argv[3:] == ["--rank"]:
        raise SystemExit(rank(run_dir, go))
    raise SystemExit(subprocess.run([sys.executable, __file__, str(run_dir), str(go), "--rank"]).returncode)
