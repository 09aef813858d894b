"""The live launcher (store, lighthouse, the ranks' starts) in a child process, started again when it dies.

The launcher is the one process every rank of a live run depends on: it serves the store the quorum
lives on and runs the lighthouse. Its death used to end the run. Here the command's own process
(``trainguard run``/``train``) only supervises: it forks the launcher (``launch``) and waits. When the
launcher dies without a result (killed, crashed), every rank finds the store gone at its next contact
(at most a heartbeat, 50 ms, away), says so in one line and exits ``STORE_LOST_EXIT``; this process,
the ranks' subreaper while it supervises, reaps them (or SIGKILLs those still there after ``REAP_S``), then forks a new
launcher that resumes from the newest verified durable checkpoint (``checkpoint.resume: auto``), with
a new store, port and run secret (a stale rank cannot reach the new run). So the death costs the
steps since that checkpoint and a restart of every rank, never the run; at most ``RESTARTS`` times.

Signals: SIGTERM and SIGUSR1 to this process are passed on to the launcher (its stop: save and exit
16); the launcher dies with this process (``PR_SET_PDEATHSIG``), so killing the command still ends
the job as before. Where this process already has threads (a fork could inherit a lock held for
ever), the launcher runs in it, unsupervised, as before, with a warning line.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import signal
import sys
import time
from pathlib import Path

from trainguard.events import EventLog
from trainguard.forking import RAISED, pickled_outcome, single_threaded
from trainguard.live.files import events_path
from trainguard.live.launcher import LiveResult, LiveRun, launch, resume_point
from trainguard.runtime.lifecycle import ENV_JOB_START, STOP_SIGNALS, job_start_time
from trainguard.runtime.nodes import descendants, kill_tree

RESTARTS = 3  # launcher deaths a run outlives; the next one ends it (exit 1, one line)
REAP_S = 60.0  # seconds the ranks of a dead launcher get to end by themselves before they are SIGKILLed
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def supervise(run_dir: Path, run: LiveRun) -> LiveResult:
    """``launch(run_dir, run)`` in a child process, forked again (resuming from the newest durable
    checkpoint) each time it dies without a result, at most ``RESTARTS`` times; its result, or its
    exception raised here."""
    if not single_threaded():  # the resume point's verification has just joined its threads
        print("trainguard: warning: the live launcher runs unsupervised (this process has threads): its death "
              "ends the run", file=sys.stderr, flush=True)
        return launch(run_dir, run)
    # the time limit counts from the first start, a restarted launcher's ranks' too
    run = dataclasses.replace(run, rank_env=(*run.rank_env, (ENV_JOB_START, str(job_start_time()))))
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # the ranks of a dead launcher become this process's children
    try:
        return _supervised(run_dir, run)
    finally:  # a caller that goes on (a test, a library user) adopts no orphan of anything else
        _prctl(_PR_SET_CHILD_SUBREAPER, 0)


def _supervised(run_dir: Path, run: LiveRun) -> LiveResult:
    restarts = 0
    while True:
        outcome, code, lost_at = _launch_in_child(run_dir, run)
        if outcome is not None:
            kind, value = outcome
            if kind == RAISED:
                raise value
            return value
        if restarts == RESTARTS:
            raise RuntimeError(f"the live launcher died {RESTARTS + 1} times (exit {code}); the newest durable "
                               f"checkpoint stays the resume point (--resume auto)")
        restarts += 1
        ranks = _reap_orphans()
        run = dataclasses.replace(run, resume="auto")  # the newest checkpoint this run committed
        resume = resume_point(run, run_dir)
        events = EventLog(events_path(run_dir), rank=-1)
        events.emit("live_launcher_lost", step=None, exit_code=code, rank_exit_codes=ranks,
                    reaped_s=round(time.time() - lost_at, 3), resume=str(resume) if resume else None)
        events.close()
        print(f"trainguard: the live launcher (store, lighthouse) died (exit {code}); its processes ended "
              f"(exit codes {sorted(set(ranks.values()))}); restarting the run from {resume or 'step 0'}", flush=True)


def _launch_in_child(run_dir: Path, run: LiveRun) -> tuple[tuple[str, object] | None, int, float]:
    """Forks ``launch`` and waits: (("return", result) or ("raise", error), exit code, time) when it ended
    with one, (None, exit code, when it was seen dead) when it died without one."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:  # the supervisor died before the line above took effect
            os._exit(1)
        with os.fdopen(write_end, "wb") as pipe:  # a pipe between this process and its own fork
            pipe.write(pickled_outcome(lambda: launch(run_dir, run)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write_end)
    def pass_on(signum: int, frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(pid, signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in STOP_SIGNALS}
    try:
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()  # until the launcher wrote its outcome and exited, or died
        _, status = os.waitpid(pid, 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = os.waitstatus_to_exitcode(status)
    return (pickle.loads(data) if data else None), code, time.time()


def _reap_orphans() -> dict[int, int]:
    """Waits for this process's children (the dead launcher's ranks and their node commands, reparented
    here) to end, SIGKILLing what is left after ``REAP_S``; their exit codes by pid."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + REAP_S
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return codes
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            continue
        if time.monotonic() > deadline:
            for child in set(descendants(os.getpid())) - {os.getpid()}:
                kill_tree(child)
        time.sleep(0.02)
