"""The supervisor's ``torchrun`` without its traceback on a planned stop (issue 38 item 11)."""

import os
import signal
import sys
from pathlib import Path

from trainguard.errors import EXIT_CRASH, EXIT_DATA_SKIP_ABORT, EXIT_RESUMABLE_STOP, EXIT_USAGE
from trainguard.runtime.quiet_torchrun import interpreter_of, planned_stop_code, quiet


def script(tmp_path: Path, name: str, first_line: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(first_line + b"\nimport sys\n")
    path.chmod(0o755)
    return path


def test_a_first_failure_with_a_chosen_code_is_a_planned_stop():
    assert planned_stop_code(EXIT_RESUMABLE_STOP, [EXIT_RESUMABLE_STOP]) == EXIT_RESUMABLE_STOP
    assert planned_stop_code(EXIT_RESUMABLE_STOP, [EXIT_USAGE]) == EXIT_USAGE  # the stronger explanation
    assert planned_stop_code(EXIT_USAGE, [-signal.SIGTERM]) == EXIT_USAGE  # the peer torchrun ended after it
    assert planned_stop_code(EXIT_DATA_SKIP_ABORT, []) == EXIT_DATA_SKIP_ABORT


def test_a_crash_or_a_kill_among_the_failures_keeps_torchruns_report():
    assert planned_stop_code(EXIT_CRASH, []) is None
    assert planned_stop_code(-signal.SIGTERM, [EXIT_RESUMABLE_STOP]) is None
    assert planned_stop_code(EXIT_RESUMABLE_STOP, [EXIT_CRASH]) is None
    assert planned_stop_code(EXIT_RESUMABLE_STOP, [-signal.SIGKILL]) is None


def test_the_torchrun_this_interpreter_runs_is_replaced(tmp_path, monkeypatch):
    here = Path(sys.executable).absolute()
    script(tmp_path, "torchrun", b"#!" + str(here).encode())
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert interpreter_of(tmp_path / "torchrun") == here
    assert quiet(["torchrun", "--nproc-per-node", "2", "train.py"]) == [
        sys.executable, "-m", "trainguard.runtime.quiet_torchrun", "--nproc-per-node", "2", "train.py"]


def test_another_installations_torchrun_and_other_commands_are_left_alone(tmp_path, monkeypatch):
    script(tmp_path, "torchrun", b"#!/opt/elsewhere/bin/python")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert quiet(["torchrun", "train.py"]) == ["torchrun", "train.py"]
    assert quiet(["python", "train.py"]) == ["python", "train.py"]
    assert quiet([]) == []
    binary = tmp_path / "blob"
    binary.write_bytes(b"\x7fELF")
    assert interpreter_of(binary) is None
    assert interpreter_of(tmp_path / "missing") is None
