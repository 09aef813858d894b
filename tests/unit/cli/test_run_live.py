"""``trainguard run``'s live path (``--nproc N --config FILE [--set ...] -- COMMAND``): what does not apply
to a live run is one line on stderr and exit 2, before any process starts or any directory is made.
The run itself, a user's script started this way through a SIGKILL drill, is
tests/integration/test_live_user_loop.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.runs import make_checkpoint
from trainguard.cli import main
from trainguard.live.launcher import LiveRun, resume_point

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "tests" / "helpers" / "live_loop.yaml"


def run_argv(run_dir: Path, *options: str) -> list[str]:
    return ["run", "--run-dir", str(run_dir), *options, "--", sys.executable, str(ROOT / "tests" / "helpers" / "live_loop.py")]


@pytest.mark.parametrize("options, line", [
    (("--nproc", "4", "--config", str(CONFIG), "--max-restarts", "3"),
     "--max-restarts: a supervisor option; with fault_tolerance.live: true the live launcher starts and replaces "
     "the ranks instead"),
    (("--nproc", "4", "--config", str(CONFIG), "--hang-timeout", "5"), "--hang-timeout: a supervisor option"),
    (("--nproc", "4", "--config", str(CONFIG), "--kill-switch", "stop"), "--kill-switch: a supervisor option"),
    (("--config", str(CONFIG),), "--nproc is required with fault_tolerance.live: true, ≥ 1"),
    (("--nproc", "4", "--set", "parallel.dp_replicate=2", "--set", "train.micro_batches=8"),
     "--set: --nproc, --config, --set and --resume start a live run, and config key 'fault_tolerance.live' is not "
     "true"),
    (("--resume", "auto"), "--set: --nproc, --config, --set and --resume start a live run"),
    (("--nproc", "4", "--config", str(CONFIG), "--set", "parallel.dp_replicate=1"),
     f"{CONFIG}: config key 'parallel.dp_replicate' must be ≥ 2 for a live run"),
    (("--nproc", "4", "--config", str(CONFIG), "--set", "faults=wipe:node=0,step=3"),
     "config key 'faults': bad fault 'wipe:node=0,step=3': the local tier is off (set checkpoint.local_interval)"),
    # --launcher hosts: where the ranks run, taken; what it needs, checked before anything starts
    (("--nproc", "4", "--config", str(CONFIG), "--launcher", "hosts", "--hosts", "n1=127.0.0.1"),
     "--launcher hosts needs --hosts NAME=ADDRESS,... and --node-command TEMPLATE"),
    (("--nproc", "4", "--config", str(CONFIG), "--launcher", "hosts", "--hosts", "n1=127.0.0.1",
      "--node-command", "env"),
     "--hosts 'n1=127.0.0.1': 1 host(s) for 2 replica groups: one host per replica group, then the spare nodes "
     "(parallel.dp_replicate = 2)"),
    (("--nproc", "4", "--config", str(CONFIG), "--launcher", "hosts", "--hosts", "n1=127.0.0.1,n1=127.0.0.2",
      "--node-command", "env"), "--hosts 'n1=127.0.0.1,n1=127.0.0.2': expected NAME=ADDRESS,... with distinct names"),
    (("--nproc", "4", "--config", str(CONFIG), "--launcher", "hosts", "--hosts", "n1=127.0.0.1,n2=127.0.0.1",
      "--node-command", "no-such-command-here {node}"), "--node-command 'no-such-command-here {node}': command not found"),
    (("--nproc", "4", "--config", str(CONFIG), "--hosts", "n1=127.0.0.1,n2=127.0.0.1"),
     "--hosts and --node-command need --launcher hosts (not local)"),
    (("--nproc", "4", "--config", str(CONFIG), "--launcher", "hosts", "--hosts", "n1=127.0.0.1,n2=127.0.0.1",
      "--node-command", "env", "--node-timeout", "5"), "--node-timeout: a supervisor option"),
    (("--nproc", "4", "--config", str(CONFIG), "--launcher", "slurm"),
     "--launcher slurm: SLURM_JOB_NODELIST is not set (not inside a Slurm allocation)"),
])
def test_what_does_not_apply_to_a_live_run_is_one_line_and_exit_2(tmp_path, capsys, options, line):
    assert main(run_argv(tmp_path / "run", *options)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainguard: error: {line}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_live_run_whose_checkpoints_all_fail_verification_is_one_line_and_exit_4(tmp_path, capsys):
    """``--resume auto`` (the default) as in restart mode: committed checkpoints, none usable, is exit 4
    before any rank starts; the run never starts again from step 0 over them."""
    bad = make_checkpoint(tmp_path / "run" / "checkpoints", 10, world_size=4)
    (bad / "__0_0.distcp").write_bytes(b"flipped")
    assert main(run_argv(tmp_path / "run", "--nproc", "4", "--config", str(CONFIG))) == 4
    err = capsys.readouterr().err
    assert err.startswith("trainguard: error: no usable checkpoint in ") and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no rank started


def test_resume_path_that_fails_verification_is_one_line_and_exit_4(tmp_path, capsys):
    bad = make_checkpoint(tmp_path / "elsewhere" / "checkpoints", 10, world_size=4)
    (bad / "__1_0.distcp").write_bytes(b"flipped")
    assert main(run_argv(tmp_path / "run", "--nproc", "4", "--config", str(CONFIG), "--resume", str(bad))) == 4
    err = capsys.readouterr().err
    assert err.startswith(f"trainguard: error: --resume {bad}: {bad / '__1_0.distcp'}: ") and err.count("\n") == 1, err


def test_a_live_run_resumes_from_the_newest_verified_checkpoint_or_as_told(tmp_path):
    root = tmp_path / "checkpoints"
    older, newer = make_checkpoint(root, 5, world_size=4), make_checkpoint(root, 10, world_size=4)
    (newer / "__1_0.distcp").write_bytes(b"truncated")
    assert resume_point(LiveRun(), tmp_path) == older  # auto: the newest that verifies
    assert resume_point(LiveRun(resume="disable"), tmp_path) is None
    assert resume_point(LiveRun(resume=str(older)), tmp_path) == older
