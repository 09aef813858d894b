"""``LiveRank``: one rank of a live-recovery run, training a user's model, optimizer and micro-batch loss.

``trainguard.Guard`` in live mode (``fault_tolerance.live: true``) is the public face of it: a script
that builds its model and optimizer and hands them, with the loss of one micro-batch by index, to
``Guard(...).steps(loss_of)`` (then ``close()``) is a rank of a live-recovery run. Started by
``trainguard.live.launcher.launch`` (``LiveRun.entry`` names the script), it does the per-micro-batch
backward, the order-fixed sum over the current quorum, the optimizer step, the membership changes and
the rejoin of ``worker.LiveWorker`` (docs/live_recovery.md). What makes the result independent of the
failures is the user's part of the contract: the loss of micro-batch ``m`` of step ``t`` is a pure
function of ``(t, m)``, the parameters and its random draws (the data position is the step); the
library makes the draws (dropout's) a function of ``(seed, t, m)`` too (``live/rng.py``). The drill's
``workload`` uses this class directly (it sits on this floor, below ``Guard``).
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.events import EventLog
from trainguard.events.rank_logging import setup_logging
from trainguard.guards.sdc import FaultyDeviceError
from trainguard.guards.skip import DataSkipAbort
from trainguard.live.files import events_path
from trainguard.live.quorum import spare_failed_key, spare_key, spare_ready_key, wait_for
from trainguard.live.signed_store import SignedStore
from trainguard.live.spare_check import check_spare
from trainguard.live.worker import (DEFAULT_RULES, FENCED_EXIT, WAIT_S, Fenced, LiveArgs, LiveRules, LiveWorker,
                                    MicroBatchLoss, SampleRange, micro_batch_grad)
from trainguard.runtime.lifecycle import Lifecycle
from trainguard.run_secret import load_secret

SPARE_UNHEALTHY_EXIT = 5  # a spare that failed its self-test ends with this code, unused
# the run's store (its launcher) is gone: this rank ends, and the supervising command starts the run again
# from its newest durable checkpoint (``live.supervise``)
STORE_LOST_EXIT = 18
SPARE_WAIT_S = 24 * 3600.0  # a spare waits as long as a run lasts; the launcher ends it if unused


class LiveRank:
    """One rank's side of a live run, placed by the launcher's flags (``LiveArgs.parse``).
    ``total_steps`` and ``micro_batches`` (the global batch of every step, whatever the number of live
    ranks) are the launcher's; ``rules`` the configuration's (clipping, guards, gradient faults, stops)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: LiveArgs,
                 scheduler: LambdaLR | None = None, *, seed: int, checkpoint: CheckpointConfig | None = None,
                 rules: LiveRules = DEFAULT_RULES):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.checkpoint = checkpoint  # the durable tier's section (None: no durable tier, the drill's workload)
        self.seed = seed  # the run's seed, the same on every rank: each micro-batch's draws derive from it
        self.rules = rules
        self.args = args
        self.total_steps, self.micro_batches = self.args.steps, self.args.micro_batches
        self.exit_code = 0

    def steps(self, loss_of: MicroBatchLoss, sample_range: SampleRange | None = None) -> Iterator[int]:
        """Trains the launcher's ``steps``, yielding each step's index as it is committed (a redone step
        again); the contract is documented where users meet it, ``Guard.steps``."""
        args = self.args
        host, port = args.store.rsplit(":", 1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # what this rank writes to the store is sealed with the run secret its launcher handed down (in the
        # environment); what it reads back unsealed is foreign and ignored (live/signed_store.py)
        store = SignedStore(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=WAIT_S)),
                            load_secret(args.run_dir))
        rank, rejoin = args.rank, args.rejoin
        if args.spare is not None:
            if args.doctor and not self.spare_is_healthy(store):
                return
            # warm: torch loads parts of itself at the first optimizer and the first backward (seconds on a
            # loaded machine), so a spare goes through both once, on a copy, before it says it is ready;
            # copied together, so the copied optimizer steps the copied parameters
            model, optimizer = copy.deepcopy((self.model, self.optimizer))
            micro_batch_grad(model, loss_of, 0, 0, args.micro_batches, self.seed)
            optimizer.step()
            store.set(spare_ready_key(args.spare), "1")
            rank, rejoin = int(wait_for(store, spare_key(args.spare), SPARE_WAIT_S, beat=lambda: None)), True
        setup_logging(rank, args.run_dir / "logs")  # the guards' and the stops' lines, as in the closure mode
        # SIGTERM/SIGUSR1 to this rank (the whole job's, from Slurm) asks the quorum to stop, as the
        # launcher's does, and so do the kill switch and the time limit; a second signal, 2 s or more
        # later, ends this process at once (exit 16)
        lifecycle = Lifecycle(self.rules.lifecycle)
        worker = LiveWorker(store, args, rank, self.model, self.optimizer, loss_of, sample_range, self.scheduler,
                            seed=self.seed, checkpoint=self.checkpoint, lifecycle=lifecycle, rules=self.rules)
        try:
            yield from worker.train(rejoin)
        except Fenced as fenced:
            print(f"live recovery: {fenced}; exiting", file=sys.stderr)
            self.exit_code = FENCED_EXIT
            return
        except dist.DistNetworkError as lost:  # the store's server, the launcher, is gone: nothing to step with
            print(f"live recovery: rank {rank} lost the run's store at {args.store} ({str(lost).splitlines()[0]}); "
                  f"exiting {STORE_LOST_EXIT}: the run restarts from its newest durable checkpoint", file=sys.stderr,
                  flush=True)
            self.exit_code = STORE_LOST_EXIT
            return
        except FaultyDeviceError as faulty:  # this rank alone: the others go on, its group leaves (live/sdc.py)
            print(f"trainguard: error: [rank {rank}] {faulty}", file=sys.stderr, flush=True)
            self.exit_code = faulty.exit_code
            return
        except DataSkipAbort as abort:  # every member judged the same sum: all abort at this step
            if worker.reports() or not abort.every_rank_raises:
                print(f"trainguard: error: [rank {rank}] {abort}", file=sys.stderr, flush=True)
            self.exit_code = abort.exit_code
            return
        if worker.stop is not None:  # the quorum stopped at a boundary, saved: the job resumes from it
            self.exit_code = worker.stop.exit_code

    def spare_is_healthy(self, store: SignedStore) -> bool:
        """The spare's self-test; a failure is an event, a store key the launcher reads, and this
        process's exit code (``SPARE_UNHEALTHY_EXIT``)."""
        args = self.args
        report = check_spare(args.run_dir, args.spare, args.doctor_faults)
        events = EventLog(events_path(args.run_dir), rank=None)
        events.emit("live_spare_checked", spare=args.spare, pid=os.getpid(), healthy=report.healthy,
                    reason=report.reason, checks=[check.check for check in report.checks],
                    seconds=sum(check.seconds for check in report.checks))
        events.close()
        if not report.healthy:
            store.set(spare_failed_key(args.spare), report.reason)
            print(f"live recovery: spare {args.spare} failed its self-test: {report.reason}", file=sys.stderr)
            self.exit_code = SPARE_UNHEALTHY_EXIT
        return report.healthy

    def close(self) -> NoReturn:
        """Ends this process: 0, ``EXIT_RESUMABLE_STOP`` after a stop (a signal to the launcher or a rank), or
        ``FENCED_EXIT`` for a stale process of a rank that was replaced."""
        # Everything is written (events unbuffered, the final state fsynced). A normal exit would destroy
        # the retired groups, whose threads wait for their abandoned operation's timeout (collective.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)
