"""Async saves written by a writer process (``checkpoint.writer: process``): what it writes is what the
training process writes itself, byte for byte, and resumes bitwise; a writer killed in the middle of
a save commits nothing, and the training process gets one clear error, not a hang."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers.processes import alive, parent_of
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.discovery import list_checkpoints, read_latest
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import read_manifest, verify_checkpoint
from trainguard.checkpoint.writer_process import WriterProcess, WriterProcessDied


def _training(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 128)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _manager(root: Path, model, optimizer, writer: str) -> CheckpointManager:
    config = CheckpointConfig(save_interval=0, keep_last=5, async_save=True, writer=writer)
    return CheckpointManager(root, model, optimizer, config=config)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        flat.update({f"optim.{index}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return flat


def test_a_save_through_the_writer_process_is_the_same_checkpoint_and_resumes_bitwise(tmp_path: Path) -> None:
    model, optimizer = _training()
    through_process = _manager(tmp_path / "process", model, optimizer, "process")
    in_thread = _manager(tmp_path / "thread", model, optimizer, "thread")
    for step in (1, 2, 3):
        _step(model, optimizer)
        torch.manual_seed(step)  # the RNG state in the extra state: the same for both saves
        through_process.save_durable(step)
        torch.manual_seed(step)
        in_thread.save_durable(step)
        through_process.wait_for_staging()
        in_thread.wait_for_staging()
        through_process.close()
        in_thread.close()
    writer = through_process.durable.files
    assert isinstance(writer, WriterProcess) and writer.pid not in (None, os.getpid())
    saved = _state(model, optimizer)
    ours, theirs = tmp_path / "process/checkpoints/global_step_3", tmp_path / "thread/checkpoints/global_step_3"
    assert verify_checkpoint(ours) == []
    # the same files, checksums and sizes as the training process writes itself (DCP's .metadata
    # holds the checkpoint's path and a random id)
    def entries(directory: Path) -> list:
        return [entry for entry in read_manifest(directory).files if entry.path != ".metadata"]

    assert entries(ours) == entries(theirs) and len(entries(ours)) == 2
    for name in ("__0_0.distcp", "extra_state_world_size_1_rank_0.pt"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name

    model2, optimizer2 = _training(seed=1)
    resumed = _manager(tmp_path / "process", model2, optimizer2, "process")
    assert resumed.resume() == 3
    restored = _state(model2, optimizer2)
    assert saved.keys() == restored.keys()
    for key, value in saved.items():
        assert torch.equal(value, restored[key]), key
    torch.manual_seed(7)
    _step(model, optimizer)
    torch.manual_seed(7)
    _step(model2, optimizer2)
    for key, value in _state(model, optimizer).items():
        assert torch.equal(value, _state(model2, optimizer2)[key]), key


def _writer_is_serving_a_request() -> bool:
    """Whether a thread of this process waits for the writer process's answer (its request sent)."""
    run = WriterProcess.run.__code__
    for frame in sys._current_frames().values():
        names, inside_run = [], False
        while frame is not None:
            names.append(frame.f_code.co_name)
            inside_run = inside_run or frame.f_code is run
            frame = frame.f_back
        if inside_run and "recv_bytes" in names:
            return True
    return False


def _within(seconds: float, action) -> BaseException | None:
    """Runs ``action`` in a thread; returns what it raised; fails the test if it is still running after
    ``seconds`` (a hang)."""
    raised: list[BaseException] = []

    def call() -> None:
        try:
            action()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a dead writer must not hang the save"
    return raised[0] if raised else None


def test_a_writer_process_killed_mid_save_commits_nothing_and_the_save_fails_clearly(tmp_path: Path) -> None:
    model, optimizer = _training()
    manager = _manager(tmp_path, model, optimizer, "process")
    _step(model, optimizer)
    manager.save_durable(1)
    manager.close()
    writer = manager.durable.files
    assert isinstance(writer, WriterProcess)
    first_pid = writer.pid
    assert first_pid is not None

    _step(model, optimizer)
    os.kill(first_pid, signal.SIGSTOP)  # it holds the request of step 2 unread until it is killed
    try:
        manager.save_durable(2)
        deadline = time.monotonic() + 60
        while not _writer_is_serving_a_request():
            assert time.monotonic() < deadline, "the save never sent its request to the writer"
            time.sleep(0.01)
    finally:
        os.kill(first_pid, signal.SIGKILL)
    error = _within(60, manager.close)
    assert isinstance(error, WriterProcessDied), repr(error)
    assert f"pid {first_pid}" in str(error) and "SIGKILL" in str(error) and "not committed" in str(error)

    root = tmp_path / "checkpoints"
    assert [info.step for info in list_checkpoints(root) if info.committed] == [1]
    assert not (root / "global_step_2").exists() and read_latest(root) == 1
    # the error is raised once; the next save starts a new writer and commits
    _step(model, optimizer)
    manager.save_durable(3)
    assert _within(120, manager.close) is None
    assert writer.pid not in (None, first_pid)
    assert verify_checkpoint(root / "global_step_3") == []
    assert read_latest(root) == 3


def test_a_periodic_saver_starts_its_writer_process_when_built_so_the_first_save_waits_for_no_start(
        tmp_path: Path) -> None:
    model, optimizer = _training()
    config = CheckpointConfig(save_interval=1, keep_last=2, async_save=True, writer="process")
    manager = CheckpointManager(tmp_path, model, optimizer, config=config)
    writer = manager.durable.files
    assert isinstance(writer, WriterProcess)
    started = writer.pid
    assert started not in (None, os.getpid()), "no writer process was started when the manager was built"
    assert writer.ready_at_first_request is None
    assert writer.ready(timeout=120), "the writer process never said it was ready"  # the training starts meanwhile
    _step(model, optimizer)
    manager.save(1)
    manager.close()
    assert writer.pid == started and writer.ready_at_first_request is True
    assert verify_checkpoint(tmp_path / "checkpoints/global_step_1") == []

    # a manager that saves only when asked starts its writer at the first save, which then waits for it
    lazy = _manager(tmp_path / "lazy", model, optimizer, "process")
    assert lazy.durable.files.pid is None
    lazy.save_durable(1)
    lazy.close()
    assert lazy.durable.files.ready_at_first_request is False
    assert verify_checkpoint(tmp_path / "lazy/checkpoints/global_step_1") == []


@pytest.mark.parametrize("value", ["processes", ""])
def test_an_unknown_writer_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    model, optimizer = _training()
    with pytest.raises(Exception, match="checkpoint.writer"):
        _manager(tmp_path, model, optimizer, value)


_PARENT = """
import os, sys, time
from trainguard.checkpoint.writer_process import WriterProcess, start_writer_fork_server
if sys.argv[1] == "forked":
    start_writer_fork_server()  # what a rank forked from the agent's fork server does first (run_rank)
writer = WriterProcess("test")
print(writer.run(os.getpid), writer.run(os.getppid), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("start", ["cold", "forked"])
def test_the_writer_ignores_stop_signals_and_ends_with_its_training_process(start: str) -> None:
    """Cold: a new interpreter, the training process's child. Forked: from the training process's
    writer fork server (no imports), the server's child, which ends with the training process too."""
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, start], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        writer_pid, writer_parent = map(int, parent.stdout.readline().split())
        assert (writer_parent == parent.pid) == (start == "cold"), (writer_parent, parent.pid)
        if start == "forked":  # its parent is the server, a fork of the training process
            assert parent_of(writer_parent) == parent.pid
        for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            os.kill(writer_pid, number)  # what a job step's stop reaches every process with
            if start == "forked":
                os.kill(writer_parent, number)  # the server too
        time.sleep(0.5)
        assert alive(writer_pid), "a stop signal ended the writer"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while alive(writer_pid) or (start == "forked" and alive(writer_parent)):
        assert time.monotonic() < deadline, "the writer (or its server) outlived its training process"
        time.sleep(0.05)


def test_a_forked_writer_killed_is_seen_dead_and_the_next_request_forks_another() -> None:
    """The ``subprocess.Popen`` part ``WriterProcess`` uses, for a writer the server forked."""
    code = """
import os, signal, sys, time
from trainguard.checkpoint.writer_process import WriterProcess, WriterProcessDied, start_writer_fork_server
start_writer_fork_server()
writer = WriterProcess("test")
first = writer.run(os.getpid)
os.kill(first, signal.SIGKILL)
try:
    writer.run(os.getpid)
    died = "no error"
except WriterProcessDied as error:
    died = str(error)
second = writer.run(os.getpid)
print(first, second, died, flush=True)
"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    first, second, message = done.stdout.split(" ", 2)
    assert first != second
    assert f"(pid {first}) ended (killed by signal SIGKILL)" in message, message
