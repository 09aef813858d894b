"""examples/hf_trainer.py as the tests run it: the command (under torchrun), a run of it in a session of its
own, and the Trainer's logs it appends (``--log-file``), split by process start and keyed by step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.runs import assert_same_tensors, events, finish_session, worker_env

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


def run_killed_after_the_save_of_step_50(run_dir: Path, steps: int, *extra: str, nproc: int = 2,
                                         script: Path = EXAMPLE) -> subprocess.CompletedProcess:
    """As docs/library.md runs it: ``trainguard run --max-restarts 3 -- torchrun ... examples/hf_trainer.py``,
    its last rank SIGKILLed at step 55. Steps take ~20 ms on CPU and the async save of step 50 ~0.15 s: a
    bare kill at step 55 can land before that save commits (then the rerun rightly starts from step 0). The
    rank first stands still 2 s at step 55, so the background save finishes, then dies: the kill these
    tests are about, after a committed save."""
    command = [sys.executable, "-m", "trainguard", "run", "--max-restarts", "3", "--",
               *example_command(run_dir, steps, *extra, nproc=nproc, script=script)]
    rank = nproc - 1
    return run(command, faults=f"hang:rank={rank},step=55,seconds=2;kill:rank={rank},step=55")


def assert_resumed_from_50_bitwise(straight: Path, killed: Path, steps: int) -> list[dict]:
    """The killed run restarted from ``global_step_50`` and ended with the final checkpoint's tensors
    equal to the straight run's; its first start logged up to step 54, its second steps 51 to ``steps``
    (the first loss after the resume: step 51's). Returns the second start's log entries."""
    (started,) = [e for e in events(killed, "run_started") if e.get("resumed_from")]
    assert started["resumed_from"].endswith("global_step_50")
    final = f"global_step_{steps}"
    assert assert_same_tensors(straight / "checkpoints" / final, killed / "checkpoints" / final) > 0
    first, resumed = incarnations(logs(killed))
    assert max(step_logs(first)) == 54
    assert sorted(step_logs(resumed)) == list(range(51, steps + 1))
    return resumed
