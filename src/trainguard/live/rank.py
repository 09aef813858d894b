"""``LiveRank``: one rank of a live-recovery run, training a user's model, optimizer and micro-batch loss.

``trainguard.Guard`` in live mode (``fault_tolerance.live: true``) is the public face of it: the loop of
both modes (``guard.resume()``, ``guard.should_stop(step, total)``, ``guard.step(loss_of)`` with the loss
of one micro-batch by index, ``guard.close()``) maps onto ``start``, ``stopping``, ``step`` and ``close``
here. Started by ``trainguard.live.launcher.launch`` (``LiveRun.entry`` names the script), it does the
per-micro-batch backward, the order-fixed sum over the current quorum, the optimizer step, the
membership changes and the rejoin of ``worker.LiveWorker`` (docs/live_recovery.md), driving the worker's
generator (``LiveWorker.train``) one committed step per ``step`` call. What makes the result independent
of the failures is the user's part of the contract: the loss of micro-batch ``m`` of step ``t`` is a pure
function of ``(t, m)``, the parameters and its random draws (the data position is the step); the
library makes the draws (dropout's) a function of ``(seed, t, m)`` too (``live/rng.py``). The drill's
``workload`` uses this class directly (it sits on this floor, below ``Guard``).
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import Stateful
from trainguard.errors import CheckpointError, ConfigError, UnsafeCheckpointError
from trainguard.events import EventLog
from trainguard.events.rank_logging import setup_logging
from trainguard.guards.sdc import FaultyDeviceError
from trainguard.guards.skip import DataSkipAbort
from trainguard.live import lifeline
from trainguard.live.collective import EpochAborted
from trainguard.live.durable import SaveFailed
from trainguard.live.files import events_path
from trainguard.live.fsdp_share import fsdp_modules
from trainguard.live.layout_fsdp import GroupOut
from trainguard.live.micro_batch import MicroBatchLoss, micro_batch_grad
from trainguard.live.quorum import (spare_failed_key, spare_key, spare_ready_key, spare_started_key, started_key,
                                    wait_for)
from trainguard.live.signed_store import SignedStore
from trainguard.live.spare_check import check_spare
from trainguard.live.step_failures import StepFailed
from trainguard.live.worker import (DEFAULT_RULES, FENCED_EXIT, WAIT_S, CommittedStep, Fenced, LiveArgs, LiveRules,
                                    LiveWorker, SampleRange)
from trainguard.runtime.heartbeat import HeartbeatWriter
from trainguard.runtime.lifecycle import Lifecycle
from trainguard.run_secret import load_secret

SPARE_UNHEALTHY_EXIT = 5  # a spare that failed its self-test ends with this code, unused
# the run's store (its launcher) is gone: this rank ends, and the supervising command starts the run again
# from its newest durable checkpoint (``live.supervise``)
STORE_LOST_EXIT = 18
# an FSDP2 replica group left the quorum: its processes end with this code and are started again together
# (``live/replica_mesh.py``)
GROUP_OUT_EXIT = 20
SPARE_WAIT_S = 24 * 3600.0  # a spare waits as long as a run lasts; the launcher ends it if unused


class LiveRank:
    """One rank's side of a live run, placed by the launcher's flags (``LiveArgs.parse``).
    ``total_steps`` and ``micro_batches`` (the global batch of every step, whatever the number of live
    ranks) are the launcher's; ``rules`` the configuration's (clipping, guards, gradient faults, stops);
    ``scheduler`` any LR scheduler stepped without arguments, ``stateful`` the loop's objects
    (``live/state.py``: what travels, what is undone)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: LiveArgs,
                 scheduler: Any = None, *, seed: int, checkpoint: CheckpointConfig | None = None,
                 rules: LiveRules = DEFAULT_RULES, static_files: Callable[[Path], None] | None = None,
                 stateful: Mapping[str, Stateful] | None = None, embedding: torch.nn.Parameter | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.stateful = stateful
        self.embedding = embedding  # the parameter whose gradient norm decides checkpoint health
        self.checkpoint = checkpoint  # the durable tier's section (None: no durable tier, the drill's workload)
        self.static_files = static_files  # writes huggingface/ into each durable checkpoint (hf_config)
        self.seed = seed  # the run's seed, the same on every rank: each micro-batch's draws derive from it
        self.rules = rules
        self.args = args
        self.total_steps, self.micro_batches = self.args.steps, self.args.micro_batches
        self.exit_code = 0
        self.worker: LiveWorker | None = None  # made by ``start``
        self.lifecycle: Lifecycle | None = None  # made by ``start``: the stops, and the heartbeat file
        self.remaining: Iterator[int] | None = None  # the worker's steps still to train (``LiveWorker.train``)
        self.committed_steps = 0  # the steps committed when ``start`` or ``step`` last returned
        # the committed steps at which this process took a rank's place with a live peer's state (a replacement,
        # a warm spare), set by ``start``; None for a fresh or resumed start
        self.joined_at: int | None = None
        self.ended = False  # this process trains no more (``exit_code`` says why)

    def start(self, warm_loss: MicroBatchLoss | None = None) -> int:
        """Takes this rank's place in the run and returns the committed steps it starts at: 0 for a fresh
        job, the launcher's checkpoint's step for a resumed one (``--resume``), the step at which it
        joined for a replacement or a warm spare (which first waits, warmed, to be told which rank it
        replaces). ``warm_loss``: a micro-batch loss the spare warms up with (one backward of micro-batch
        0 of step 0 on a copy of the model); without it the spare warms the autograd engine and the
        optimizer only, and the model's own first forward and backward happen in its first step."""
        args = self.args
        if args.lifeline:  # on another node: the launcher's kill comes through stdin
            lifeline.hold(STORE_LOST_EXIT)
        host, port = args.store.rsplit(":", 1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # what this rank writes to the store is sealed with the run secret its launcher handed down (in the
        # environment); what it reads back unsealed is foreign and ignored (live/signed_store.py)
        store = SignedStore(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=WAIT_S)),
                            load_secret(args.run_dir))
        # here this process runs as the rank (or spare): the launcher no longer takes its end for its node
        # command's failure (``live_node_lost``)
        store.add(started_key(args.rank) if args.spare is None else spare_started_key(args.spare), 1)
        rank, rejoin = args.rank, args.rejoin
        if args.spare is not None:
            if args.doctor and not self.spare_is_healthy(store):
                self.ended = True
                return 0
            self.warm_up(warm_loss)
            store.set(spare_ready_key(args.spare), "1")
            rank, rejoin = int(wait_for(store, spare_key(args.spare), SPARE_WAIT_S, beat=lambda: None)), True
        setup_logging(rank, args.run_dir / "logs")  # the guards' and the stops' lines, as in the closure mode
        # SIGTERM/SIGUSR1 to this rank (the whole job's, from Slurm) asks the quorum to stop, as the
        # launcher's does, and so do the kill switch and the time limit; a second signal, 2 s or more
        # later, ends this process at once (exit 16). ``lifecycle.heartbeats``: the rank's heartbeat file, as in
        # the closure mode (``trainguard status`` and outside watchers read it; the quorum's own liveness is
        # the store's counter, live/lighthouse.py)
        heartbeat = HeartbeatWriter(args.run_dir, rank) if self.rules.lifecycle.heartbeats else None
        self.lifecycle = Lifecycle(self.rules.lifecycle, heartbeat=heartbeat)
        self.worker = LiveWorker(store, args, rank, self.model, self.optimizer, None, None, self.scheduler,
                                 seed=self.seed, checkpoint=self.checkpoint, lifecycle=self.lifecycle,
                                 rules=self.rules, static_files=self.static_files, stateful=self.stateful, embedding=self.embedding)
        try:
            self.worker.begin(rejoin)
        except Fenced as fenced:
            self.fenced(fenced)
            return 0
        except GroupOut as out:
            self.group_out(out)
            return 0
        except dist.DistNetworkError as lost:
            self.store_lost(lost)
            return 0
        except CheckpointError as error:
            if isinstance(error, UnsafeCheckpointError):
                raise
            # the launcher chose it after verifying its files, and DCP raised its failure on every rank
            # alike: it holds another model (a run directory another model's run used). A replacement
            # would fail the same way, so every rank ends with the run's configuration error instead
            self.end_with_config_error(ConfigError(
                f"{error}: the checkpoint does not fit this run's model and optimizer (saved by another "
                "model's run?); use another --run-dir, or --resume disable to start from the seed"))
        self.committed_steps = self.worker.step_index
        self.joined_at = self.committed_steps if rejoin else None
        self.remaining = self.worker.train()
        self.lifecycle.beat("train", self.committed_steps)
        return self.committed_steps

    def warm_up(self, loss_of: MicroBatchLoss | None) -> None:
        """A spare's: torch loads parts of itself at the first optimizer step and the first backward
        (seconds on a loaded machine), so the spare goes through both once, on a copy (copied together, so
        the copied optimizer steps the copied parameters), before it says it is ready. An FSDP2 model
        (``fault_tolerance.fsdp``) cannot be copied (FSDP2 refuses ``deepcopy``): the optimizer's class and
        the autograd engine warm up on a one-parameter stand-in instead, ``loss_of`` unused."""
        if fsdp_modules(self.model):
            stand_in = torch.nn.Parameter(torch.zeros(1))
            accepted = inspect.signature(type(self.optimizer)).parameters
            optimizer = type(self.optimizer)([stand_in], **{key: value for key, value in self.optimizer.defaults.items()
                                                            if key in accepted})
            stand_in.square().sum().backward()
            optimizer.step()
            return
        model, optimizer = copy.deepcopy((self.model, self.optimizer))
        if loss_of is not None:
            micro_batch_grad(model, loss_of, 0, 0, self.args.micro_batches, self.seed)
        else:
            sum(p.square().sum() for p in model.parameters()).backward()
        optimizer.step()

    @property
    def stopping(self) -> bool:
        """No more steps: the last one is committed, the quorum agreed to stop (and saved), or this process
        is ending (an abort, fenced, a spare that failed its self-test)."""
        return self.ended or self.worker.stop is not None or self.worker.step_index >= self.total_steps

    def step(self, loss_of: MicroBatchLoss, sample_range: SampleRange | None = None) -> CommittedStep | None:
        """Trains until the step after the last one returned is committed, with the recoveries, undos
        and redos it takes (a redone step is not returned again), and returns it; None when the run ended
        inside the call instead (a data-skip abort, a faulty device, this process fenced: ``exit_code`` says
        which)."""
        if self.stopping:
            raise RuntimeError("LiveRank.step after the run's last step or its agreed stop")
        self.worker.loss_of, self.worker.sample_range = loss_of, sample_range
        while (index := self.advance()) is not None:
            committed = self.worker.committed
            # a rollback is told with the restored step the loop goes on from (the spike's step was not committed)
            if index >= self.committed_steps or committed.rolled_back:
                self.committed_steps = index + 1
                self.lifecycle.beat("step", self.committed_steps)
                return self.worker.committed
        return None

    def advance(self) -> int | None:
        """The index of the next step the worker commits (a redone one too), or None when it trains no more."""
        if self.ended:
            return None
        try:
            return next(self.remaining)
        except StopIteration:
            if self.worker.stop is not None:  # the quorum stopped at a boundary, saved: the job resumes from it
                self.exit_code = self.worker.stop.exit_code
        except Fenced as fenced:
            self.fenced(fenced)
        except GroupOut as out:
            self.group_out(out)
        except dist.DistNetworkError as lost:
            self.store_lost(lost, save=True)
        except FaultyDeviceError as faulty:  # this rank alone: the others go on, its group leaves (live/sdc.py)
            print(f"trainguard: error: [rank {self.worker.rank}] {faulty}", file=sys.stderr, flush=True)
            self.exit_code = faulty.exit_code
        except (DataSkipAbort, StepFailed) as abort:  # every member judged the same sum: all end at this step
            try:
                self.worker.settle_saves()  # the save in flight is the newest checkpoint the run leaves
            except (SaveFailed, EpochAborted, RuntimeError) as failed:
                print(f"live recovery: [rank {self.worker.rank}] {str(failed).splitlines()[0]}", file=sys.stderr,
                      flush=True)
            if self.worker.reports() or not abort.every_rank_raises:
                print(f"trainguard: error: [rank {self.worker.rank}] {abort}", file=sys.stderr, flush=True)
            self.exit_code = abort.exit_code
        self.ended = True
        return None

    def fenced(self, fenced: Fenced) -> None:
        print(f"live recovery: {fenced}; exiting", file=sys.stderr)
        if self.lifecycle is not None:  # the rank's heartbeat file is its replacement's now
            self.lifecycle.heartbeat = None
        self.exit_code = FENCED_EXIT
        self.ended = True

    def group_out(self, out: GroupOut) -> None:
        print(f"live recovery: {out}; exiting {GROUP_OUT_EXIT}", file=sys.stderr, flush=True)
        self.exit_code = GROUP_OUT_EXIT
        self.ended = True

    def store_lost(self, lost: dist.DistNetworkError, save: bool = False) -> None:
        """The store's server, the launcher, is gone: nothing to step with. With ``save`` (the loss was met
        while training), this rank's state of its committed steps goes to its per-rank tier first, if the
        run has one (``LiveWorker.save_own``)."""
        worker = self.worker
        print(f"live recovery: rank {worker.rank} lost the run's store at {self.args.store} "
              f"({str(lost).splitlines()[0]}); exiting {STORE_LOST_EXIT}: the run restarts from its newest durable "
              "checkpoint", file=sys.stderr, flush=True)
        tier = worker.save_own() if save else None
        if tier is not None:
            print(f"live recovery: rank {worker.rank} saved its state of step {worker.step_index} to its {tier.tier} "
                  f"tier ({tier.dir}) before exiting", file=sys.stderr, flush=True)
        self.exit_code = STORE_LOST_EXIT
        self.ended = True

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

    def end_with_config_error(self, error: ConfigError) -> NoReturn:
        """A configuration mistake every rank makes alike (the loop's ``total_steps`` against the launcher's
        ``train.steps``): the quorum's first rank prints it in one line, and every rank ends with exit 2,
        which the launcher reads as the run's end (it replaces no rank: a replacement would make it again)."""
        if self.worker is None or self.worker.reports():
            print(f"trainguard: error: [rank {self.args.rank if self.worker is None else self.worker.rank}] {error}",
                  file=sys.stderr, flush=True)
        self.exit_code = error.exit_code
        self.ended = True
        self.close()

    def close(self) -> NoReturn:
        """At the last step or the agreed stop, trains what is left (the redo of a step a peer did not
        finish, a replacement's join at the last boundary, the final state file), then ends this process:
        0, ``EXIT_RESUMABLE_STOP`` after a stop (a signal to the launcher or a rank), 3 after a data-skip
        abort, or ``FENCED_EXIT`` for a stale process of a rank that was replaced."""
        if self.remaining is not None and self.stopping:
            while self.advance() is not None:
                pass
        if self.lifecycle is not None:
            self.lifecycle.beat("exit", self.committed_steps, self.exit_code)
        # Everything is written (events unbuffered, the final state fsynced). A normal exit would destroy
        # the retired groups, whose threads wait for their abandoned operation's timeout (collective.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)
