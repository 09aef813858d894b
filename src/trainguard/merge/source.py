"""Opening a checkpoint of any supported kind, chosen by ``--backend`` or detected (``auto``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainguard.errors import ConfigError
from trainguard.merge.pieces import CheckpointContents
from trainguard.merge.read_ranks import find_rank_files, open_rank_checkpoint

BACKENDS = ("fsdp", "dcp", "auto")


def detect_backend(directory: Path) -> str:
    has_dcp = (directory / ".metadata").is_file()  # DCP's metadata file
    has_ranks = any(directory.glob("model_world_size_*_rank_*.pt"))
    if has_dcp and has_ranks:
        raise ConfigError(f"{directory}: holds both a DCP checkpoint (.metadata) and per-rank model files; "
                          "name the one to read with --backend dcp or --backend fsdp")
    if has_dcp:
        return "dcp"
    if has_ranks:
        return "fsdp"
    raise ConfigError(f"{directory}: not a checkpoint (neither a DCP .metadata nor model_world_size_W_rank_R.pt files)")


def open_checkpoint(directory: Path, backend: str = "auto", include_optimizer: bool = False,
                    param_order: Callable[[], list[str]] | None = None) -> CheckpointContents:
    """``param_order``: the model's parameter names in order, for verl's index-keyed optimizer files."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: no such checkpoint directory")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    found = detect_backend(directory)
    if backend != "auto" and backend != found:
        what = "a DCP checkpoint (.metadata)" if found == "dcp" else "a per-rank (fsdp) checkpoint"
        raise ConfigError(f"--backend {backend}: {directory} is {what}; use --backend {found} or auto")
    if found == "dcp":
        from trainguard.merge.read_dcp import open_dcp  # torch.distributed.checkpoint: only when needed

        return open_dcp(directory)
    find_rank_files(directory)  # the one clear error for a missing rank or mixed world sizes, before any load
    return open_rank_checkpoint(directory, include_optimizer=include_optimizer, param_order=param_order)
