"""Python logging with rank prefixes: rank 0 talks on stdout, every rank keeps its own file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAME = "trainguard"


def setup_logging(rank: int, log_dir: Path | None) -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s - %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(fmt)
    logger.addHandler(console)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_dir / f"rank_{rank}.log")
        file_handler.setFormatter(fmt)
        logger.addHandler(file_handler)
    return logger
