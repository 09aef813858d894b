"""Starts the training processes with torchrun's elastic agent on loopback and returns their exit code.

The agent runs in this process (not as a ``torchrun`` child) so the workers' own exit codes, which
carry meaning (3 data-skip abort, 4 no checkpoint, 16 resumable stop, 17 faulty hardware), are not
flattened into torchrun's generic 1. Without CUDA the workers are forked from this process after it
has imported the trainer, so each rank does not pay seconds of imports again (CUDA forbids forking).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainguard.errors import EXIT_CRASH

MEANINGFUL_EXIT_CODES = (2, 3, 4, 16, 17)


def exit_code_of(failure_codes: list[int]) -> int:
    """The code that explains a failed group: a meaningful code if any rank gave one, else crash."""
    for code in MEANINGFUL_EXIT_CODES:
        if code in failure_codes:
            return code
    return EXIT_CRASH


def launch_local(nproc: int, worker_args: list[str], run_dir: Path) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from trainguard.trainer.entry import run_worker

    fork = not torch.cuda.is_available()
    if fork:
        import trainguard.trainer.loop  # noqa: F401  (imported once, inherited by every forked rank)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"is_host": True},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="fork" if fork else "spawn",
        local_addr="127.0.0.1",
    )
    try:
        elastic_launch(config, entrypoint=run_worker)(worker_args)
    except ChildFailedError as exc:
        return exit_code_of([failure.exitcode for failure in exc.failures.values()])
    return 0
