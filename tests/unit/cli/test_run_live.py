"""``trainguard run``'s live path (``--nproc N --config FILE [--set ...] -- COMMAND``): what does not apply
to a live run is one line on stderr and exit 2, before any process starts or any directory is made.
The run itself, a user's script started this way through a SIGKILL drill, is
tests/integration/test_live_user_loop.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainguard.cli import main

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples" / "user_loop_live.yaml"


def run_argv(run_dir: Path, *options: str) -> list[str]:
    return ["run", "--run-dir", str(run_dir), *options, "--", sys.executable, str(ROOT / "examples" / "user_loop_live.py")]


@pytest.mark.parametrize("options, line", [
    (("--nproc", "4", "--config", str(CONFIG), "--max-restarts", "3"),
     "--max-restarts: a supervisor option; with fault_tolerance.live: true the live launcher starts and replaces "
     "the ranks instead"),
    (("--nproc", "4", "--config", str(CONFIG), "--hang-timeout", "5"), "--hang-timeout: a supervisor option"),
    (("--nproc", "4", "--config", str(CONFIG), "--kill-switch", "stop"), "--kill-switch: a supervisor option"),
    (("--config", str(CONFIG),), "--nproc is required with fault_tolerance.live: true, ≥ 1"),
    (("--nproc", "4", "--set", "parallel.dp_replicate=2", "--set", "train.micro_batches=8"),
     "--set: --nproc, --config and --set start a live run, and config key 'fault_tolerance.live' is not true"),
    (("--nproc", "4", "--config", str(CONFIG), "--set", "parallel.dp_replicate=1"),
     f"{CONFIG}: config key 'parallel.dp_replicate' must be ≥ 2 for a live run"),
    (("--nproc", "4", "--config", str(CONFIG), "--set", "guards.skip.enabled=true"),
     f"{CONFIG}: config key 'guards.skip.enabled' is not used with fault_tolerance.live: true"),
    (("--nproc", "4", "--config", str(CONFIG), "--set", "faults=spike:step=3"),
     "config key 'faults': fault 'spike:step=3': a live run drills 'kill:rank=R,step=S' only"),
])
def test_what_does_not_apply_to_a_live_run_is_one_line_and_exit_2(tmp_path, capsys, options, line):
    assert main(run_argv(tmp_path / "run", *options)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainguard: error: {line}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
