"""Starts the training processes with torchrun's elastic agent on loopback and returns their exit code.

The agent runs in this process (not as a ``torchrun`` child) so the workers' own exit codes, which
carry meaning (3 data-skip abort, 4 no checkpoint, 16 resumable stop, 17 faulty hardware), are not
flattened into torchrun's generic 1. Without CUDA the workers are forked, from a fork server forked
from this process after it has imported the trainer and before it starts any thread
(``fork_server``), so each rank does not pay seconds of imports again (CUDA forbids forking).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainguard.forking import thread_count
from trainguard.runtime.agent_control import node_address, serve_from_environment
from trainguard.runtime.fork_server import START_METHOD, run_rank, start_fork_server
from trainguard.runtime.policy import exit_code_of
from trainguard.runtime.nodes import ENV_AGENT_REPORT, ENV_NNODES, ENV_NODE_RANK, ENV_RDZV_ENDPOINT


def start_rank_server(preload: tuple[str, ...]) -> None:
    """The fork server of this process if it still has one thread; else (something it imported or
    ran already started a thread) Python's own fork server, a new interpreter that imports ``preload``
    once per incarnation: seconds slower to start, never a rank forked from a process with threads."""
    threads = thread_count()
    if threads == 1:
        start_fork_server()
        return
    print(f"trainguard: warning: the agent already has {threads} threads; its ranks start from Python's own "
          "fork server, which imports the trainer again (seconds per incarnation)", file=sys.stderr, flush=True)
    multiprocessing.set_forkserver_preload(list(preload))


def launch_local(nproc: int, worker_args: list[str], run_dir: Path, entrypoint: Callable[[list[str]], Any],
                 preload: tuple[str, ...] = ()) -> int:
    """Runs ``entrypoint(worker_args)`` in ``nproc`` ranks; ``preload`` names the modules to import
    here first when the ranks are forked (imported once, inherited by every rank). Call it before
    this process starts any thread: the ranks' fork server is forked from it."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A rank that exits non-zero has said why in one line; the agent's traceback of its own poll loop
    # ("ProcessExitedException") repeats nothing useful. The exit codes reach the supervisor below.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Nor does its "Terminating process N via signal SIGTERM" of the ranks still running after one
    # failed: rank 0's line already said what failed, and the others are to stay quiet.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    import torch

    fork = not torch.cuda.is_available()
    if fork:
        for module in preload:
            importlib.import_module(module)
    # Slurm's --signal=USR1 reaches every process of the step: the ranks act on it (save, exit 16),
    # the agent must not die of it; SIGUSR2 asks the ranks for stack dumps. Ranks install their own.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if fork:  # after the signals above (the server and its ranks inherit them), before any thread
        start_rank_server(preload)
    nnodes = int(os.environ.get(ENV_NNODES, "1"))
    if ENV_RDZV_ENDPOINT in os.environ:
        # one agent per node, started by the supervisor: static rendezvous, so the node rank (the
        # supervisor's slot) fixes the global ranks on this node, whichever node holds the slot
        rendezvous = dict(rdzv_backend="static", rdzv_endpoint=os.environ[ENV_RDZV_ENDPOINT],
                          rdzv_configs={"rank": int(os.environ.get(ENV_NODE_RANK, "0")), "timeout": 300})
    else:
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"is_host": True})
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=os.environ.get(ENV_RDZV_ENDPOINT, uuid.uuid4().hex),
        **rendezvous,
        max_restarts=0,
        monitor_interval=0.1,
        start_method=START_METHOD if fork else "spawn",
        local_addr=node_address(),
    )
    serve_from_environment(run_dir)  # signals, stop and liveness through this agent (--launcher hosts)
    try:
        elastic_launch(config, entrypoint=run_rank)(entrypoint, worker_args)
    except ChildFailedError as exc:
        with contextlib.suppress(OSError):  # on a full disk the ranks' exit codes still count
            _write_agent_report(exc)
        return exit_code_of([failure.exitcode for failure in exc.failures.values()])
    return 0


def error_text(message: str | dict[str, Any]) -> str:
    """A rank's error as text: torchrun's error file holds it as a string, or (written by ``@record``) as
    ``{"message": text, "extraInfo": {"py_callstack": ..., "timestamp": ...}}``."""
    return message if isinstance(message, str) else str(message.get("message", ""))


def _write_agent_report(exc: ChildFailedError) -> None:
    """Which ranks failed how, for the supervisor's fault attribution (torchrun's error files, in one)."""
    path = os.environ.get(ENV_AGENT_REPORT)
    if not path:
        return
    failures = []
    for rank, failure in exc.failures.items():
        entry = {"rank": rank, "local_rank": failure.local_rank, "exitcode": failure.exitcode, "pid": failure.pid,
                 "signal": failure.signal_name() if failure.exitcode < 0 else None, "timestamp": failure.timestamp}
        error_file = failure.error_file
        if error_file and os.path.isfile(error_file):
            entry["error_file"] = error_file
            entry["message"] = error_text(failure.message)
        failures.append(entry)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"time": time.time(), "failures": failures}))
