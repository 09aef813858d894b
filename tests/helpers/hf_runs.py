"""examples/hf_trainer.py as the tests run it: the command (under torchrun), a run of it in a session of its
own, and the Trainer's logs it appends (``--log-file``), split by process start and keyed by step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.runs import finish_session, worker_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
TIMEOUT_S = 600


def example_command(run_dir: Path, steps: int, *extra: str, nproc: int = 2, script: Path = EXAMPLE) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(script), "--run-dir", str(run_dir), "--steps", str(steps), "--log-file", str(run_dir / "logs.jsonl"),
            *extra]


def run(command: list[str], faults: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(TRAINGUARD_FAULTS=faults), start_new_session=True)
    return finish_session(proc, TIMEOUT_S, "the fine-tune")


def logs(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs.jsonl").read_text().splitlines()]


def incarnations(entries: list[dict]) -> list[list[dict]]:
    """The log entries split where the step goes back: one list per process start."""
    parts: list[list[dict]] = [[]]
    for entry in entries:
        if parts[-1] and entry["step"] < parts[-1][-1]["step"]:
            parts.append([])
        parts[-1].append(entry)
    return parts


def step_logs(entries: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in entries if "loss" in e}
