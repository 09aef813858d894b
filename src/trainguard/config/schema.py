"""Typed run configuration. Every key has a default; ``load.py`` validates user input against it."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.guards.fingerprint import FingerprintConfig
from trainguard.guards.health import HealthConfig
from trainguard.guards.rollback import RollbackConfig
from trainguard.guards.sdc.config import SdcConfig
from trainguard.guards.skip import SkipConfig
from trainguard.guards.skip_streak import DEFAULT_MAX_CONSECUTIVE_SKIPS
from trainguard.runtime.lifecycle import LifecycleConfig
from trainguard.topology.layout import ParallelConfig


@dataclass
class ModelConfig:
    preset: str = "llama-tiny"
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    tie_word_embeddings: bool | None = None
    attn_implementation: str = "sdpa"
    init_from: str | None = None  # a local Hugging Face model directory: architecture and initial weights


@dataclass
class DataConfig:
    seq_len: int = 128
    micro_batch_size: int = 4
    seed: int = 1234


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    decay_steps: int | None = None  # cosine horizon; None means train.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batches: int = 1  # gradient accumulation steps per optimizer step
    seed: int = 42
    log_interval: int = 1
    exit_at_step: int | None = None  # save and exit 0 after this step (a planned stop)


@dataclass
class GuardsConfig:
    skip: SkipConfig = field(default_factory=SkipConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    sdc: SdcConfig = field(default_factory=SdcConfig)
    fingerprint: FingerprintConfig = field(default_factory=FingerprintConfig)  # replica state comparison
    monitor: bool = False  # log and record the embedding's local gradient norm every step
    local_norm: bool = False  # compute per-parameter local norms (the reference's runner_wrapper.local_norm)
    check_for_global_norm: bool = False  # rollback on spikes instead of skipping (guards.rollback)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    # this many skipped steps in a row (any cause) end the run with exit 3; 0 = never
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS


@dataclass
class FaultToleranceConfig:
    """Live recovery (docs/live_recovery.md): the surviving replica groups keep stepping through a rank's
    failure and its replacement rejoins, instead of every rank restarting. The other keys are read by
    whoever starts the ranks (``LiveRun.from_config``)."""

    live: bool = False  # Guard's live mode: the same loop, ranks started by the live launcher
    spares: int = 0  # warm spare processes started with the ranks, each replacing a dead rank at once
    hang_s: float = 10.0  # a rank whose heartbeat has not moved this long is declared dead
    # ... and one that has never beaten, this long after the launcher first looked for it: a rank's start
    # (imports, loading a resumed checkpoint) may take minutes on a busy node
    startup_s: float = 600.0
    collective_timeout_s: float = 30.0  # gloo's timeout of one collective of a rank
    doctor_spares: bool = True  # a warm spare self-tests (trainguard doctor's burn-in and storage checks) first
    # a step's all-reduce entered and not left for max(stall_s, stall_steps × the median step time so
    # far) is stalled (a partial cut: the peers unreachable, the store not; live/stall.py)
    stall_s: float = 5.0
    stall_steps: float = 10.0
    # a live step whose computation (the loss, its backward) raised on some rank is tried again; failing
    # this many times in a row, it ends the run with exit 19 (live/step_failures.py)
    max_step_failures: int = 3
    # a rank whose processes ended this many times in a row before they committed a step (a start that
    # fails alike each time) is moved off its node once, then not started again (live/start_failure.py)
    max_start_failures: int = 3
    # FSDP2 inside each replica group: ``trainguard.data_parallel_mesh()`` returns the replica group's mesh,
    # for ``fully_shard`` (live/replica_mesh.py; the reference trainer's live ranks shard with it); off, it
    # returns None and live mode shards by rows itself
    fsdp: bool = False


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    faults: str | None = None  # same grammar as TRAINGUARD_FAULTS; the environment variable wins
