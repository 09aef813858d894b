"""Typed run configuration, loaded from YAML with ``--set`` overrides and validated at load."""

from trainguard.config.load import config_to_dict, load_config, with_overrides
from trainguard.config.schema import (
    CheckpointConfig,
    DataConfig,
    FaultToleranceConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "FaultToleranceConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "config_to_dict",
    "load_config",
    "with_overrides",
]
