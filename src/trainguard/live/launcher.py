"""Starts a live-recovery run's ranks, hosts its store and lighthouse, kills a rank on request, and
recovers either live (the replacement alone is started; the others keep their processes) or as today
(every rank is killed and started again from the newest checkpoint), for the benchmark's comparison.

A job's start resumes from the durable checkpoint ``LiveRun.resume`` chooses (``checkpoint.resume``:
the newest verified one for ``auto``), chosen here, before any rank starts, and handed to every rank
(``--resume PATH``). SIGTERM or SIGUSR1 to the launcher (or to the ranks: the whole job, as Slurm
signals it) asks the quorum to stop: it saves at its next step boundary and every member exits
``EXIT_RESUMABLE_STOP``; ``launch`` returns then (``stopped``). A second signal, 2 s or more after the
first, ends every rank at once (restart mode's ``StopSignals``: nothing more is saved). The quorum's
other agreed ends are read the same way: every member exits 0 (the end, the kill switch,
``train.exit_at_step``), 3 (a data-skip abort), 16 (a stop to resume from) or 19 (a step that failed
``fault_tolerance.max_step_failures`` times in a row), and the launcher ends with them (``LiveResult.exit_code``) instead of replacing them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from trainguard.backup.restore import restore_for_resume
from trainguard.backup.url import is_url
from trainguard.checkpoint.manifest import read_manifest
from trainguard.checkpoint.resume import choose_resume_checkpoint
from trainguard.checkpoint.writer_process import start_writer_fork_server
from trainguard.config.schema import RunConfig
from trainguard.errors import (EXIT_DATA_SKIP_ABORT, EXIT_OK, EXIT_RESUMABLE_STOP, EXIT_STEP_FAILED, EXIT_USAGE,
                               ConfigError)
from trainguard.events import EventLog
from trainguard.forking import ForkedProcess, ForkServer, call_in_fork, start_server, thread_count
from trainguard.live import lifeline
from trainguard.live.drill import live_drill, local_tier_nodes
from trainguard.live.dying import killed_by
from trainguard.live.files import events_path, newest_checkpoint
from trainguard.live.group_reduce import SlotLayout
from trainguard.live.lighthouse import STARTUP_S, Lighthouse
from trainguard.live.node_watch import NodeCommandFailed, NodeWatch
from trainguard.live.placement import replacement_node
from trainguard.live.quorum import (GIVEN_UP, MAX_STEP, STOP, STOPPED, beat_key, done_key, progress_key,
                                    spare_failed_key, spare_key, spare_ready_key, spare_started_key, started_key)
from trainguard.live.signed_store import SignedStore, serve_store
from trainguard.live.spare_choice import spare_for
from trainguard.live.stall import saving
from trainguard.live.stop_deadline import StopDeadline, stop_bound_s
from trainguard.live.start_failure import EarlyExit, StartFailures, cannot_start, given_up_line, start_failure_line
from trainguard.run_secret import ENV_SECRET, create_secret
from trainguard.runtime.heartbeat import ENV_NODE
from trainguard.runtime.hosts import on_node
from trainguard.runtime.lifecycle import (ENV_JOB_START, KILL_SWITCH, REASON_NAMES, STOP_SIGNALS, StopSignals,
                                          job_start_time)
from trainguard.runtime.outcome import RunOutcome

LIVE, RESTART = "live", "restart"
# the exit codes the quorum agrees on in a step's all-reduce, so that every member ends with one of them:
# the run's end (or a stop that needs no resume: the kill switch, train.exit_at_step), a data-skip abort,
# a stop to resume from (a signal, the time limit), a step that failed too often in a row (step_failures.py);
# and a configuration error every rank makes alike in the loop (``LiveRank.end_with_config_error``)
AGREED_EXITS = (EXIT_OK, EXIT_DATA_SKIP_ABORT, EXIT_RESUMABLE_STOP, EXIT_STEP_FAILED, EXIT_USAGE)
# A member's agreed exit but the configuration error's is the quorum's end only once the rank wrote its final
# state (``quorum.done_key``) or the quorum recorded how it ended (``quorum.STOPPED``: its stop, abort or failed
# step, written by its first member just after the others may have exited): until then it is judged again at
# each look, and a death after this long. A process that exits with one of these codes before it trained (a
# script that returns early or exits 3, 16 or 19 of its own, a node command that never ran it) is no end of the
# run: taken for one, the launcher reported a run that never trained as finished (exit 0 after a rank's 16) or
# aborted by the data-skip guard (3), or waited for ever on its peers.
EXPLAINED_EXITS = (EXIT_OK, EXIT_DATA_SKIP_ABORT, EXIT_RESUMABLE_STOP, EXIT_STEP_FAILED)
UNEXPLAINED_EXIT_GRACE_S = 5.0
# the loop answers reports and sees exits every 5 ms, but looks for hangs, stalls and groups ready to
# rejoin (bounds of seconds) at this pace: each look reads every member's keys from the store, and at
# every pass the launcher and its store thread took about 12 % of a core (benchmarks/live_steady_sections.py)
WATCH_EVERY_S = 0.05


@dataclass(frozen=True)
class LiveRun:
    groups: int = 2  # replica groups (HSDP's replicate dimension)
    group_size: int = 2  # ranks per group (its shard dimension × its tensor-parallel one)
    tp: int = 1  # tensor parallel inside each group: its ranks are (dp_shard, tp) row-major, tp fastest
    steps: int = 30
    micro_batches: int = 8
    micro_batch_s: float = 0.01  # simulated compute per micro-batch, so survivors pay for extra ones
    checkpoint_every: int = 10
    collective_timeout_s: float = 30.0
    kill_ranks: tuple[int, ...] = ()  # hit these ranks (one, or a whole node's) together once the
    kill_at_step: int = 0  # first of them has committed this many steps
    fault: str = "kill"  # "kill": SIGKILL; "stop": SIGSTOP (a hang, or a cut link: alive, silent)
    hang_s: float = 10.0  # a member silent this long is hung (the lighthouse's heartbeat timeout)
    startup_s: float = STARTUP_S  # ... and one that has never beaten, since its start (fault_tolerance.startup_s)
    # an all-reduce entered and not left for max(stall_s, stall_steps × the median step time) is stalled
    # (a partial cut: peers unreachable, store reachable; live/stall.py)
    stall_s: float = 5.0
    stall_steps: float = 10.0
    # (rank, step): that rank's all-reduce of that step fails after the others' succeeded (a transient
    # error, no death): the others committed the step, it did not; they undo it and all redo it
    transient: tuple[int, int] | None = None
    kill_joiner: bool = False  # drill: SIGKILL the first killed rank's replacement too, once it is let in (a
    # second failure during the join)
    # drill: SIGKILL this rank too the moment the lighthouse publishes the epoch after the first kill: a
    # member of it while its gloo group is being built, or a rank of the group it left out (a second failure
    # during the shrink)
    kill_during_shrink: int | None = None
    max_replacements: int = 16  # a run whose ranks died more often than this ends (something is wrong with it)
    # a rank whose processes ended this many times in a row before they committed a step is moved off its
    # node once (a spare node left), then given up: the run goes on without it (live/start_failure.py)
    max_start_failures: int = 3
    # (rank, step): that rank stays out of that step's all-reduce, alive and beating, until the epoch
    # ends (a peer that never takes part: a partial cut, from the others' side)
    stall_collective: tuple[int, int] | None = None
    stall_cut: bool = False  # ... marked as in the all-reduce, its probe socket closed (a cut inside it)
    spares: int = 0  # warm spare processes (torch imported, waiting) that replace dead ranks first
    doctor_spares: bool = True  # each spare self-tests first (``spare_check``); one that fails is passed over
    spare_faults: str = ""  # drill: ``miscompute`` entries for the spares' self-tests (``live.drill``)
    recovery: str = LIVE  # or RESTART: today's recovery, every rank started again
    timeout_s: float = 240.0
    # separate nodes: the node of each replica group, then of each spare (``live.placement.place``); a
    # rank's command is started behind ``node_command`` with {node} and {address} filled in (``ip netns exec
    # NS-{node}``, ``ssh {address}``), its launcher-given environment on the command line (``env K=V``), and
    # reaches the store at ``store_host``. The launcher's signals do not reach a node's processes: it kills
    # one through its stdin (``live.lifeline``), but a hung one (maybe behind a cut link, where nothing
    # reaches it) is fenced by epoch alone, and its node is lost: replacements start on ``spare_nodes`` (nodes
    # holding no group at the start) or another live node (``live.placement.replacement_node``). Empty:
    # every rank is a local process, which the launcher also SIGKILLs when hung.
    nodes: tuple[str, ...] = ()
    spare_nodes: tuple[str, ...] = ()
    node_addresses: tuple[tuple[str, str], ...] = ()  # (node, address) for {address}; a node's name otherwise
    node_command: str = ""
    store_host: str = "127.0.0.1"
    # what each rank runs, the launcher's flags appended: ``executable`` (this interpreter, or the first
    # word of a user's command under ``trainguard run``), then ``entry``: the drill's workload, or a user's
    # script that trains through ``Guard`` in live mode (with its own flags, e.g. ("examples/user_loop.py",))
    entry: tuple[str, ...] = ("-m", "trainguard.live.workload")
    executable: str = sys.executable
    # where the job resumes (``checkpoint.resume``): "auto" (the newest verified durable checkpoint of the
    # run directory, or a fresh start when it has none), "disable", a ``global_step_N`` directory, or a mirror
    # URL (``resume_point`` restores from it first)
    resume: str = "auto"
    mirror_endpoint: str | None = None  # checkpoint.mirror.endpoint_url: the S3 endpoint of a mirror URL in ``resume``
    # (NAME, VALUE) pairs added to each rank's environment (``trainguard run``'s ``--set`` items for the
    # ranks' ``Guard``), never to the launcher's own
    rank_env: tuple[tuple[str, str], ...] = ()
    # lifecycle.kill_switch_path: present when the job starts, no rank is started (the ranks watch it after)
    kill_switch: str | None = None
    # fault_tolerance.fsdp: each rank's ``data_parallel_mesh()`` is its replica group's mesh (``--fsdp``)
    fsdp: bool = False

    def __post_init__(self) -> None:
        if self.nodes and len(self.nodes) != self.groups + self.spares:
            raise ValueError(f"LiveRun.nodes={self.nodes!r}: expected one node per replica group and per spare "
                             f"({self.groups + self.spares})")
        if self.spare_nodes and not self.nodes:
            raise ValueError(f"LiveRun.spare_nodes={self.spare_nodes!r}: spare nodes need the groups' LiveRun.nodes")
        if self.fault not in ("kill", "stop"):
            raise ValueError(f"LiveRun.fault={self.fault!r}: expected 'kill' or 'stop'")
        if self.recovery not in (LIVE, RESTART):
            raise ValueError(f"LiveRun.recovery={self.recovery!r}: expected {LIVE!r} or {RESTART!r}")

    @property
    def world(self) -> int:
        return self.groups * self.group_size

    @classmethod
    def from_config(cls, config: RunConfig, source: str = "<config>", **drill: object) -> LiveRun:
        """The run a configuration describes: its replica groups (``parallel.dp_replicate``) of
        ``parallel.dp_shard`` ranks, ``train.steps`` steps of ``train.micro_batches`` micro-batches, and
        the ``fault_tolerance`` keys, and the kill drill of the faults in force (``trainguard.live.drill``);
        ``drill`` sets the other fields (``entry``, a fault to inject, ...). A layout live recovery cannot
        run, or a fault it does not drill, is a ``ConfigError`` naming the key or the entry."""
        parallel, tolerance = config.parallel, config.fault_tolerance
        if not tolerance.live:
            raise ConfigError(f"{source}: config key 'fault_tolerance.live' must be true to start a live run")
        if parallel.dp_replicate is None or parallel.dp_replicate < 2:
            raise ConfigError(f"{source}: config key 'parallel.dp_replicate' must be ≥ 2 for a live run (the "
                              f"replica groups that outlive each other's failures), got {parallel.dp_replicate}")
        if parallel.pp not in (None, 1):
            raise ConfigError(f"{source}: config key 'parallel.pp' must be 1 for a live run (it trains replica "
                              f"groups, data-parallel and tensor-parallel only), got {parallel.pp}")
        tp, shards = parallel.tp or 1, parallel.dp_shard or 1
        if tp > 1 and not tolerance.fsdp:
            raise ConfigError(f"{source}: config key 'parallel.tp' ({tp}) needs 'fault_tolerance.fsdp: true' in a live "
                              "run: the script applies parallelize_module over trainguard.device_mesh(tp)['tp'] and "
                              "fully_shard over its 'dp_shard' dimension")
        groups, group_size = parallel.dp_replicate, shards * tp
        slots = groups * shards  # a group's tp peers read the same micro-batches: one slot per dp_shard position
        if config.train.micro_batches < slots:  # every slot computes at least one of them
            raise ConfigError(f"{source}: config key 'train.micro_batches' must be ≥ the ranks of the live run "
                              f"(parallel.dp_replicate × dp_shard = {slots}), got {config.train.micro_batches}")
        if group_size > 1:  # the parameters are sharded in each group and reduced by the fixed tree
            try:
                SlotLayout(groups, shards, config.train.micro_batches).check()
            except ValueError as error:
                raise ConfigError(f"{source}: config keys 'parallel.dp_replicate', 'parallel.dp_shard', "
                                  f"'train.micro_batches': {error}") from None
        if tolerance.fsdp and group_size == 1:
            raise ConfigError(f"{source}: config key 'fault_tolerance.fsdp' needs 'parallel.dp_shard' > 1 or "
                              "'parallel.tp' > 1 (FSDP2 shards the parameters inside each replica group), got 1")
        if tolerance.fsdp and tolerance.spares % group_size:
            raise ConfigError(f"{source}: config key 'fault_tolerance.spares' must be a multiple of the ranks of a "
                              f"replica group (parallel.dp_shard × tp = {group_size}) with fault_tolerance.fsdp: the "
                              f"spares make replica groups' meshes as they start, and a lost group is replaced whole; "
                              f"got {tolerance.spares}")
        faults = live_drill(config.faults, groups * group_size, config.train.steps, tolerance.spares,
                            local_nodes=local_tier_nodes(config.checkpoint.local_interval, parallel.ranks_per_node,
                                                         groups * group_size))
        return cls(groups=groups, group_size=group_size, tp=tp, steps=config.train.steps,
                   micro_batches=config.train.micro_batches, spares=tolerance.spares, hang_s=tolerance.hang_s,
                   startup_s=tolerance.startup_s, stall_s=tolerance.stall_s, stall_steps=tolerance.stall_steps,
                   collective_timeout_s=tolerance.collective_timeout_s, doctor_spares=tolerance.doctor_spares,
                   max_start_failures=tolerance.max_start_failures,
                   resume=config.checkpoint.resume, mirror_endpoint=config.checkpoint.mirror.endpoint_url,
                   kill_switch=config.lifecycle.kill_switch_path, fsdp=tolerance.fsdp,
                   **{**faults, **drill})


@dataclass
class LiveResult:
    wall_s: float
    first_pids: dict[int, int]  # rank -> pid of its first process
    last_pids: dict[int, int]  # rank -> pid of the process that finished it
    killed_at: float | None = None  # time.time() of the SIGKILL
    replaced_at: dict[int, float] = field(default_factory=dict)  # rank -> time.time() of its newest start
    replacements: dict[int, int] = field(default_factory=dict)  # rank -> how many times it was replaced
    joiner_killed_at: float | None = None  # the kill_joiner drill's SIGKILL
    shrink_killed_at: float | None = None  # the kill_during_shrink drill's SIGKILL
    exit_codes: dict[int, int] = field(default_factory=dict)
    fenced_exit_codes: dict[int, int | None] = field(default_factory=dict)  # pid of a fenced process ->
    # its exit code (None: still silent at the end, killed then)
    resumed_from: Path | None = None  # the durable checkpoint the job started from
    # the code every member of the quorum ended with (``AGREED_EXITS``): 0 at the end or a stop that needs
    # no resume, EXIT_DATA_SKIP_ABORT, EXIT_RESUMABLE_STOP after a stop (the quorum saved a step); None: none yet
    exit_code: int | None = None
    stop: dict | None = None  # the quorum's stop at a boundary (``quorum.STOPPED``): step, reason, message
    given_up: list[int] = field(default_factory=list)  # ranks not started again after failed starts (StartFailures)
    # asked to stop by a signal, the quorum had not stopped within this bound (``stop_deadline``): every rank
    # ended, nothing more saved, exit_code EXIT_RESUMABLE_STOP
    stop_overdue_s: float | None = None

    @property
    def stopped(self) -> bool:
        """Asked to stop (a signal, the time limit): the quorum saved a step and exited EXIT_RESUMABLE_STOP."""
        return self.exit_code == EXIT_RESUMABLE_STOP


def resume_point(run: LiveRun, run_dir: Path) -> Path | None:
    """The durable checkpoint the job starts from (``run.resume``), verified; a ``NoCheckpointError``
    (exit 4) when committed checkpoints exist and none qualifies, as in restart mode. A mirror URL
    (``s3://bucket/prefix[/global_step_N]``) is restored into the run directory first, as restart mode's
    ``--resume URL`` (``backup.restore.restore_for_resume``: the mirror's newest healthy full checkpoint, a
    newer local one still winning, or the step the URL names)."""
    mode = run.resume
    if is_url(mode):  # in a child: the S3 client's threads would keep the launcher from being supervised
        mode = call_in_fork(restore_for_resume, mode, run_dir / "checkpoints", run.mirror_endpoint)
    return choose_resume_checkpoint(mode, run_dir / "checkpoints", warn=logging.getLogger("trainguard").warning)


def _spawn(run: LiveRun, rank: int, store: SignedStore, run_dir: Path, rejoin: bool, node: str | None,
           spare: int | None = None, resume: Path | None = None,
           watch: NodeWatch | None = None) -> subprocess.Popen | ForkedProcess:
    """Starts a rank (or spare ``spare``) here, or on ``node`` through ``run.node_command`` (watched by
    ``watch``, which tells the node command's own failure from the rank's death)."""
    role = ["--rank", str(rank)] if spare is None else ["--spare", str(spare)]
    command = [run.executable, *run.entry, "--store", f"{run.store_host}:{store.port}",
               *role, "--world", str(run.world), "--group-size", str(run.group_size), "--steps", str(run.steps),
               "--run-dir", str(run_dir),
               "--micro-batches", str(run.micro_batches), "--micro-batch-s", str(run.micro_batch_s),
               "--checkpoint-every", str(run.checkpoint_every),
               "--collective-timeout-s", str(run.collective_timeout_s)] + (["--rejoin"] if rejoin else [])
    if node is not None:  # out of the launcher's signals: it ends the rank through its stdin (lifeline.py)
        command.append("--lifeline")
    if run.fsdp:
        command += ["--fsdp", "--tp", str(run.tp)]
    if resume is not None:
        command += ["--resume", str(resume)]
    if spare is not None and run.doctor_spares:
        command += ["--doctor"] + (["--doctor-faults", run.spare_faults] if run.spare_faults else [])
    if run.transient is not None and run.transient[0] == rank and not rejoin:
        command += ["--fail-after-reduce", str(run.transient[1])]
    if run.stall_collective is not None and run.stall_collective[0] == rank and not rejoin:
        command += ["--stall-collective", str(run.stall_collective[1])] + (["--stall-cut"] if run.stall_cut else [])
    launcher_env = {"OMP_NUM_THREADS": "1", **dict(run.rank_env)}
    if node is not None:  # the rank names its node as the launcher does (``live_start``, a fault's ``node=``)
        launcher_env[ENV_NODE] = node
    # the run secret in the environment, never on the command line (which any local user reads): a node
    # command that does not pass the environment on (ssh) leaves the rank to read it from the run
    # directory's owner-only file (``run_secret.load_secret``)
    env = dict(os.environ, **launcher_env, **{ENV_SECRET: store.secret.hex()})
    if node is not None:
        address = dict(run.node_addresses).get(node, node)
        on_the_node = on_node(shlex.split(run.node_command), node, address, command, launcher_env)
        started = started_key(rank) if spare is None else spare_started_key(spare)
        return watch.start(node, on_the_node, started, lambda stderr: subprocess.Popen(
            on_the_node, env=env, stdin=subprocess.PIPE, stderr=stderr),
            beat_key=beat_key(rank) if spare is None else None)
    if _rank_server is not None and is_this_interpreter(run.executable) and runs_a_file_or_module(run.entry):
        # this interpreter's command, started here: forked without imports (``start_live_rank_server``)
        request = json.dumps({"argv": command[1:], "env": env, "cwd": os.getcwd()}).encode()
        forked = _rank_server.fork(request, [0, 1, 2])
        if forked is not None:
            return forked
    return subprocess.Popen(command, env=env)


def is_this_interpreter(executable: str) -> bool:
    """Whether ``executable`` (a path, or a name found on ``PATH`` as a shell finds it: the documented
    ``-- python script.py``) starts this interpreter in this environment: the same file, reached from
    the same directory (a virtual environment's ``python`` and its base interpreter are one file, but
    not one environment: that one starts cold)."""
    found = shutil.which(executable)
    if found is None:
        return False
    found_path, this = Path(found).absolute(), Path(sys.executable).absolute()
    return found_path.parent == this.parent and os.path.samefile(found_path, this)


def runs_a_file_or_module(entry: tuple[str, ...]) -> bool:
    """Whether the interpreter's arguments ``entry`` run a script or ``-m MODULE``, as the fork server runs
    them; any other option first (``-c CODE``, ``-u``, ``-X``...) starts a new interpreter."""
    return bool(entry) and (entry[0] == "-m" or not entry[0].startswith("-"))


_rank_server: ForkServer | None = None
"""The ranks' fork server of this process, forked at its first ``launch`` if it had one thread then."""

RANK_PRELOAD = ("trainguard.live.rank",)
"""Imported before the rank server is forked: the engine of the drill's rank and of a script's ``Guard``
in live mode."""


def start_live_rank_server() -> None:
    """Forks the ranks' fork server unless this process has one or has threads (a rank would be forked
    from a process with threads: its ranks start as new interpreters then). ``launch`` calls it; a
    caller that starts a thread before (a progress spinner) calls it first. A rank started as this
    interpreter (``python -m MODULE`` or ``python SCRIPT``) is then one fork of a one-thread process
    that imported torch and the live rank already, not a new interpreter's seconds of imports, paid by
    every rank, spare and replacement (``trainguard.forking``)."""
    global _rank_server
    if _rank_server is not None or thread_count() != 1:
        return
    for module in RANK_PRELOAD:
        importlib.import_module(module)
    _rank_server = start_server(_forked_rank)  # None if an import started a thread (some torch builds do)


def _forked_rank(message: bytes, fds: list[int]) -> None:
    """In a rank forked by the server: becomes ``python ARGV`` with the launcher's environment, working
    directory, stdin, stdout and stderr, as ``subprocess.Popen`` would have started it."""
    request = json.loads(message)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__  # not a caller's redirection
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if "OMP_NUM_THREADS" in os.environ:  # read by torch at its import, in the launcher's environment
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for handler in logging.root.handlers[:]:  # a new interpreter's logging: none of the launcher's handlers
        logging.root.removeHandler(handler)
    # its checkpoint writer processes (async durable saves, the memory tier) forked from this one-thread
    # copy, without a new interpreter's imports, as a torchrun rank's (``runtime.fork_server.run_rank``)
    start_writer_fork_server()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path.insert(0, os.getcwd())
        sys.modules.pop(argv[1], None)  # run as __main__ only, as in a new interpreter (imported here, maybe)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def launch(run_dir: Path, run: LiveRun) -> LiveResult:
    """Runs to the end. In live recovery every rank that dies (the drill's or not) is replaced while
    the others keep stepping, up to ``run.max_replacements``; in restart mode only the drill's kill is
    recovered. Raises RuntimeError otherwise, or when the run outlasts ``run.timeout_s``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "final").mkdir(exist_ok=True)
    resume = resume_point(run, run_dir)
    if run.kill_switch is not None and Path(run.kill_switch).exists():  # as the closure mode's start: nothing loaded
        return _not_started(run_dir, run.kill_switch, read_manifest(resume).step if resume is not None else 0)
    if run.kill_ranks and resume is not None and read_manifest(resume).step >= run.kill_at_step:
        run = dataclasses.replace(run, kill_ranks=())  # the drill's step is behind the job's start: it happened
    # the time limit counts from the job's start for every rank, a replacement's too (as the supervisor's)
    if ENV_JOB_START not in dict(run.rank_env):  # a launcher started again keeps the job's first start
        run = dataclasses.replace(run, rank_env=(*run.rank_env, (ENV_JOB_START, str(job_start_time()))))
    start_live_rank_server()  # before the store's threads
    # every value the run writes to its store is sealed with this launch's secret, and a value read back
    # that is not is ignored (live/signed_store.py); the store listens on the ranks' address alone
    store = SignedStore(serve_store(run.store_host, timedelta(seconds=60)), create_secret(run_dir))
    events = EventLog(events_path(run_dir), rank=-1)
    events.emit("live_store", step=None, host=run.store_host, port=store.port, pid=os.getpid())
    if resume is not None:
        events.emit("live_resume", step=read_manifest(resume).step, path=str(resume))
    began = watched_at = time.monotonic()
    # where each rank and spare runs (None: here), and the nodes lost (their ranks found hung)
    rank_node = {rank: run.nodes[rank // run.group_size] if run.nodes else None for rank in range(run.world)}
    spare_node = {i: run.nodes[run.groups + i] if run.nodes else None for i in range(run.spares)}
    lost: set[str] = set()
    spares_used: dict[int, int] = {}  # each spare that replaced a rank: that rank
    failed: dict[str, NodeCommandFailed] = {}  # lost nodes whose node command failed: nothing starts there
    watch = NodeWatch(store, run_dir / "logs" / "node_commands") if run.nodes else None
    procs = {rank: _spawn(run, rank, store, run_dir, rejoin=False, node=rank_node[rank], resume=resume, watch=watch)
             for rank in range(run.world)}
    spares = [(i, _spawn(run, -1, store, run_dir, rejoin=True, node=spare_node[i], spare=i, watch=watch))
              for i in range(run.spares)]
    if run.kill_ranks and spares:
        # the drill's kill is meant for warm spares (one still starting or self-testing is a cold one): the
        # ranks wait for epoch 0 until every spare is ready or found unhealthy, so that a short run cannot
        # finish before its drill
        _await_spares(store, spares, began + run.timeout_s)
    lighthouse = Lighthouse(store, run.world, run.group_size, events, run.hang_s, run.stall_s, run.stall_steps,
                            startup_s=run.startup_s)
    result = LiveResult(0.0, {r: p.pid for r, p in procs.items()}, {}, resumed_from=resume)
    fenced: list[subprocess.Popen | ForkedProcess] = []  # hung processes behind a cut link, left to stop
    # ranks whose node command dropped while they ran on (``NodeWatch.dropped``): members still, out of the
    # launcher's reach, watched by their heartbeats alone (hung: their node is lost, as behind a cut link)
    detached: set[int] = set()
    judged: set[int] = set()  # ranks whose node command exited 255, until their heartbeat tells (``dropped``)
    # ranks that exited with one of EXPLAINED_EXITS, not yet explained (UNEXPLAINED_EXIT_GRACE_S): since when
    unexplained: dict[int, float] = {}
    early: dict[int, EarlyExit] = {}  # ranks whose process ended before the run's first step (start_failure.py)
    start_failures = StartFailures(run.max_start_failures)
    # each rank's committed steps (``progress_key``) when its newest process started: one that ends with no more
    # failed its start (a resumed first process writes the checkpoint's step before its first step)
    started_at = dict.fromkeys(range(run.world), read_manifest(resume).step if resume is not None else 0)
    on_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers can be set there only
    previous_handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if on_main_thread else {}
    # a second signal: every rank ends at once (``procs`` as it is then: the cell, not today's dict)
    signals = StopSignals(on_second=lambda: [lifeline.kill(proc) for proc in procs.values()]) if on_main_thread else None

    def lose(node: str, reason: str, **detail: object) -> None:
        if node not in lost:
            lost.add(node)
            events.emit("live_node_lost", step=None, node=node, reason=reason, **detail)

    def node_command_failed(failure: NodeCommandFailed, **target: int) -> None:
        failed.setdefault(failure.node, failure)
        lose(failure.node, "node_command_failed", command=failure.command, exit_code=failure.exit_code,
             error=failure.error, **target)

    def replace(rank: int) -> None:
        detached.discard(rank)
        started_at[rank] = _progress(store, rank)
        result.replaced_at[rank] = time.time()
        result.replacements[rank] = result.replacements.get(rank, 0) + 1
        lighthouse.died(rank)
        while spares and (store.check([spare_failed_key(spares[0][0])]) or spare_node[spares[0][0]] in lost
                          or spares[0][1].poll() is not None):
            index, spare = spares.pop(0)  # failed its self-test, on a lost node, or ended: never used
            failure = watch.failure(spare) if watch is not None else None
            if failure is not None:  # seen here before the loop's look at the spares
                node_command_failed(failure, spare=index)
            if spare_node[index] in lost:
                reason = "its node is lost"
            elif store.check([spare_failed_key(index)]):
                reason = store.get(spare_failed_key(index)).decode()
            else:
                reason = f"it exited with code {spare.poll()}"
            events.emit("live_spare_excluded", spare=index, reason=reason)
        chosen = spare_for(rank, [index for index, _ in spares], spares_used, run.group_size, run.fsdp)
        if chosen is not None:
            index, procs[rank] = spares.pop([index for index, _ in spares].index(chosen))
            spares_used[index] = rank
            rank_node[rank] = spare_node[index]
            store.set(spare_key(index), str(rank))
        else:
            home = run.nodes[rank // run.group_size] if run.nodes else None
            if home is not None:
                node = replacement_node(home, lost, run.spare_nodes, {r: n for r, n in rank_node.items() if r != rank},
                                        frozenset(failed))
                if node is None:
                    raise RuntimeError(f"live run: no node left to start rank {rank} on: the node command failed on "
                                       + ", ".join(f"{n} ({f.describe()})" for n, f in failed.items()))
                rank_node[rank] = node
            # the survivors' next epoch before the replacement's start, which they need not wait for (their
            # reports are often in already); after the node's choice, whose failure is the run's line
            lighthouse.poll(watch=False)
            procs[rank] = _spawn(run, rank, store, run_dir, rejoin=True, node=rank_node[rank], watch=watch)
            events.emit("live_replacement", step=None, target=rank, pid=procs[rank].pid, node=rank_node[rank])

    def moved_off_its_node(rank: int) -> bool:
        """At the start-failure limit, a rank on a node moves to a spare node not lost, its node lost (what
        failed may be the node's: a file missing there); False when no such spare node is left."""
        node = rank_node[rank]
        if node is None or not any(spare not in lost and spare != node for spare in run.spare_nodes):
            return False
        lose(node, "start_failed", target=rank, failures=run.max_start_failures)
        start_failures.moved(rank)
        return True

    def give_up(ended: EarlyExit) -> None:
        lighthouse.died(ended.rank)
        result.given_up.append(ended.rank)
        store.set(GIVEN_UP, json.dumps(result.given_up))  # the quorum's end waits no more for its group
        events.emit("live_rank_given_up", step=None, target=ended.rank, node=ended.node, code=ended.code,
                    error=ended.error, failures=run.max_start_failures)
        print(given_up_line(ended, run.max_start_failures), file=sys.stderr, flush=True)

    def detached_running() -> bool:
        """A detached rank has not written its final state, and the quorum has not ended otherwise."""
        return result.exit_code in (None, EXIT_OK) and any(not store.check([done_key(rank)]) for rank in detached)

    stop_deadline: StopDeadline | None = None  # set when the launcher asks the quorum to stop (a signal)
    try:
        while any(p.returncode is None for p in procs.values()) or judged or unexplained or detached_running():
            if time.monotonic() - began > run.timeout_s:
                raise RuntimeError(f"live run did not finish within {run.timeout_s:.0f} s")
            if signals is not None and signals.received is not None and not store.check([STOP]):
                store.set(STOP, "1")  # the quorum's next all-reduce carries it: all save and exit together
                events.emit("live_stop", step=None, signal=signals.received)
                stop_deadline = StopDeadline(time.monotonic())
            if result.exit_code is not None and all(procs[m].poll() == result.exit_code
                                                    for m in lighthouse.quorum.members):
                break  # ended together; ranks still out of the quorum (joining) end below
            if run.kill_ranks and result.killed_at is None and _progress(store, run.kill_ranks[0]) >= run.kill_at_step:
                for rank in run.kill_ranks:
                    if run.fault == "kill":
                        lifeline.kill(procs[rank])
                    else:
                        os.kill(procs[rank].pid, signal.SIGSTOP)
                    events.emit("live_kill", step=run.kill_at_step, target=rank, pid=procs[rank].pid,
                                signal=run.fault)
                result.killed_at = time.time()
            joiner = run.kill_ranks[0] if run.kill_joiner and run.kill_ranks else None
            if joiner in lighthouse.quorum.joining and result.joiner_killed_at is None:
                lifeline.kill(procs[joiner])
                events.emit("live_kill", step=None, target=joiner, pid=procs[joiner].pid, signal="kill",
                            during_join=lighthouse.quorum.epoch)
                result.joiner_killed_at = time.time()
            for rank, proc in list(procs.items()):
                if rank in detached or rank in result.given_up:
                    continue
                code = proc.poll()
                if code is None and watch is None:  # a local rank: its pid is the rank's
                    killed = killed_by(proc.pid)  # dying: nobody need wait for its teardown to know
                    code = None if killed is None else -killed
                explained = code not in EXPLAINED_EXITS or _ended_by_quorum(store, rank)
                if not explained:
                    since = unexplained.setdefault(rank, time.monotonic())
                    if time.monotonic() - since <= UNEXPLAINED_EXIT_GRACE_S:
                        continue
                unexplained.pop(rank, None)
                if code in AGREED_EXITS and rank in lighthouse.quorum.members and explained:
                    # the quorum agreed on it in one all-reduce: every member ends so. Read from this same
                    # poll, so a member that exits between two polls is never taken for a death.
                    result.exit_code = code
                if code is None or code == result.exit_code:
                    continue
                if code == EXIT_OK and _ended_by_quorum(store, rank):  # out of the quorum: a joiner at the end
                    continue
                if run.recovery == LIVE:  # any death, the drill's or not: the others keep stepping
                    failure = watch.failure(proc) if watch is not None else None
                    dropped = watch.dropped(proc) if watch is not None and failure is None else False
                    if dropped is None:  # an ssh's 255: the rank's heartbeat tells, within DROP_GRACE_S
                        judged.add(rank)
                        continue
                    judged.discard(rank)
                    if dropped:  # the node command was lost, not the rank: it stays a member
                        detached.add(rank)
                        events.emit("live_node_command_lost", step=None, target=rank, node=rank_node[rank],
                                    pid=proc.pid, code=code, error=watch.output.last_line(proc.pid))
                        continue
                    events.emit("live_exit", step=None, target=rank, pid=proc.pid, code=code)
                    if failure is not None:  # it never ran as the rank: the node cannot start one
                        node_command_failed(failure, target=rank)
                    elif not _stepped(store, run.world):
                        early.setdefault(rank, EarlyExit(rank, code, rank_node[rank],
                                                         watch.output.last_line(proc.pid) if watch is not None else ""))
                        if cannot_start(run.world, early):
                            events.emit("live_start_failed", step=None, exits=[
                                dataclasses.asdict(ended) for _, ended in sorted(early.items())])
                            raise RuntimeError(start_failure_line(early))
                    if (failure is None and start_failures.ended(rank, _progress(store, rank) > started_at[rank])
                            and not moved_off_its_node(rank)):
                        give_up(EarlyExit(rank, code, rank_node[rank],
                                          watch.output.last_line(proc.pid) if watch is not None else ""))
                        continue
                    if sum(result.replacements.values()) >= run.max_replacements:
                        raise RuntimeError(f"live run: rank {rank} exited with {code}, after "
                                           f"{run.max_replacements} replacements (LiveRun.max_replacements)")
                    replace(rank)
                    continue
                if result.killed_at is None or rank not in run.kill_ranks or rank in result.replaced_at:
                    raise RuntimeError(f"live run: rank {rank} exited with {code}")
                # today's recovery: every rank killed and started again, once for all the killed ranks
                for other in procs.values():
                    if other.poll() is None:
                        lifeline.kill(other)
                        other.wait()
                lighthouse.restart(newest_checkpoint(run_dir, run.steps, run.group_size))
                result.replaced_at.update({r: time.time() for r in run.kill_ranks})
                procs = {r: _spawn(run, r, store, run_dir, rejoin=False, node=rank_node[r], watch=watch)
                         for r in range(run.world)}
                break
            if run.recovery == LIVE:
                watch_now = time.monotonic() - watched_at >= WATCH_EVERY_S
                watched_at = time.monotonic() if watch_now else watched_at
                hung = lighthouse.hung() if watch_now else []
                for rank in hung:
                    if run.nodes:  # silent on a node: the node is lost (a cut link, a dead host), replaced elsewhere
                        lose(rank_node[rank], "hung", target=rank)
                for rank in hung:
                    if run.nodes:  # out of reach: fenced by epoch (``died``), it stops if it comes back
                        fenced.append(procs[rank])
                        replace(rank)
                    else:
                        procs[rank].kill()  # SIGKILL reaches a stopped process too; seen as a death next
                lighthouse.poll(watch=watch_now)
                if stop_deadline is not None and watch_now and result.exit_code is None and not store.check([STOPPED]):
                    bound = stop_bound_s(lighthouse.stalls.bound_s(), run.collective_timeout_s, run.hang_s)
                    if stop_deadline.overdue(time.monotonic(), saving(store, lighthouse.quorum), bound):
                        # the ranks have not stopped within the bound (``stop_deadline``): ended below, nothing saved
                        events.emit("live_stop_overdue", step=None, bound_s=round(bound, 1),
                                    members=lighthouse.quorum.members)
                        result.exit_code, result.stop_overdue_s = EXIT_RESUMABLE_STOP, bound
                        break
                if (run.kill_during_shrink is not None and lighthouse.quorum.epoch == 1
                        and result.shrink_killed_at is None):  # at once: before the epoch's group is built
                    target = procs[run.kill_during_shrink]
                    lifeline.kill(target)
                    events.emit("live_kill", step=None, target=run.kill_during_shrink, pid=target.pid, signal="kill",
                                during_shrink=lighthouse.quorum.epoch)
                    result.shrink_killed_at = time.time()
            for index, spare in spares if watch is not None else ():
                failure = watch.failure(spare)
                if failure is not None and failure.node not in failed:  # a spare's node that cannot start one
                    node_command_failed(failure, spare=index)
            time.sleep(0.005)
        if store.check([STOPPED]):
            result.stop = json.loads(store.get(STOPPED))
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        result.fenced_exit_codes = {proc.pid: proc.poll() for proc in fenced}
        for proc in [*procs.values(), *(proc for _, proc in spares), *fenced]:  # unused spares end here
            if proc.poll() is None:
                lifeline.kill(proc)
                proc.wait()
        if watch is not None:
            watch.close()
        events.close()
    result.wall_s = time.monotonic() - began
    result.last_pids = {r: p.pid for r, p in procs.items()}
    result.exit_codes = {r: p.returncode for r, p in procs.items()}
    return result


def _not_started(run_dir: Path, kill_switch: str, step: int) -> LiveResult:
    """The kill switch is there at the job's start: no rank starts, exit 0 (the closure mode's stop at start)."""
    stop = {"step": step, "reason": REASON_NAMES[KILL_SWITCH],
            "message": f"kill switch {kill_switch} exists at start: nothing loaded or trained"}
    events = EventLog(events_path(run_dir), rank=-1)
    events.emit("lifecycle_stop", step=step, reason=stop["reason"], message=stop["message"], exit_code=EXIT_OK,
                last_checkpoint=step or None, outcome=RunOutcome.NOT_STARTED.value)
    events.close()
    return LiveResult(0.0, {}, {}, exit_code=EXIT_OK, stop=stop)


def _await_spares(store: SignedStore, spares: list[tuple[int, subprocess.Popen | ForkedProcess]],
                  deadline: float) -> None:
    def settled(index: int, proc: subprocess.Popen | ForkedProcess) -> bool:
        return (store.check([spare_ready_key(index)]) or store.check([spare_failed_key(index)])
                or proc.poll() is not None)

    while not all(settled(index, proc) for index, proc in spares):
        if time.monotonic() > deadline:
            raise RuntimeError("live run: the warm spares were not ready within LiveRun.timeout_s")
        time.sleep(0.01)


def _ended_by_quorum(store: SignedStore, rank: int) -> bool:
    """``rank`` wrote its final state, or the quorum recorded its agreed stop: an exit 0 of it is the run's end."""
    return store.check([done_key(rank)]) or store.check([STOPPED])


def _stepped(store: SignedStore, world: int) -> bool:
    """Some rank committed a step in this launch (the store is the launch's own)."""
    return any(store.check([progress_key(rank)]) for rank in range(world))


def _progress(store: SignedStore, rank: int) -> int:
    return store.get_int(progress_key(rank), 0, MAX_STEP) or 0
