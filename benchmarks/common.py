"""Pieces every benchmark shares: starting itself under torchrun, the ABBA schedule, ratios."""

from __future__ import annotations

import logging
import os
import statistics
import sys


def relaunch_under_torchrun(nproc: int, script: str) -> None:
    """Replaces this process with ``torchrun --standalone`` running ``script`` on ``nproc`` ranks."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(script), *sys.argv[1:]]
    os.execve(sys.executable, cmd, env)


def abba_quad(cycle: int, baseline: str = "off", mode: str = "on") -> list[str]:
    """Cycle ``cycle``'s four blocks: ``baseline mode mode baseline``, then ``mode baseline baseline mode``
    in the next cycle, so that drift weighs on both sides of each quad's ratio alike."""
    a, b = (baseline, mode) if cycle % 2 == 0 else (mode, baseline)
    return [a, b, b, a]


def schedule(cycles: int) -> list[str]:
    """Block modes in ABBA order, the starting mode alternating per cycle, so drift cancels out."""
    return [block for cycle in range(cycles) for block in abba_quad(cycle)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rel(new: float, base: float) -> float:
    return (new - base) / base


def silence_console(logger_name: str = "trainguard") -> None:
    """Drops the trainer's console handlers (its per-rank log files stay) so the table stays readable."""
    logger = logging.getLogger(logger_name)
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)


def print_result(figure: str, trainguard: float, baseline: float, target: str, met: bool, **extra) -> None:
    """The machine-readable line ``benchmarks/run_all`` collects (one per figure); ratio = trainguard / baseline."""
    import json
    import math

    ratio = trainguard / baseline if baseline else float("nan")
    record = {"figure": figure, "trainguard": trainguard, "baseline": baseline, "ratio": ratio, "target": target,
              "met": bool(met), **extra}
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    print("RESULT " + json.dumps(clean), flush=True)
