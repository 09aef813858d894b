"""The writer of async saves: a persistent process per rank and tier, or the training process itself.

An async save's background thread shares the training process's GIL with the training loop: the
serialisation (``torch.save`` records, pickles), the hashing and the file writes of a save all take it,
for stretches long enough to stall the loop's Python (PyTorch moved its async save into another
process for the same reason). With ``checkpoint.writer: process`` (the default), each tier that writes
in the background (the durable tier's async saves, the memory tier) has a writer process of its own:

- the staging buffers are in shared memory (``shared_buffers``): the training process copies the
  state into them (the lazy snapshot), the writer reads them where they are, no byte goes through a
  pipe;
- a save sends the writer a function of the checkpoint writers (``write_records`` for a DCP shard or
  the extra-state file, ``save_rank_step`` for a memory-tier step) with its arguments, tensors in the
  buffers named by position (``ArenaRef``), and waits for the result: the same functions that write
  in the training process with ``checkpoint.writer: thread``, so files, checksums and manifests are
  the same byte for byte. Everything else (DCP's planning and collectives, the commit, retention,
  events) stays in the training process's background thread;
- the writer is started when its tier is built if the tier will save (``start``: its interpreter and
  imports, about 1.6 s of CPU, then run beside the training's own start, not on the first save's path),
  else at the first save; it says it is ready once its imports are done, and ``ready_at_first_request``
  records whether the first request found it ready or had to wait for it. It serves until the
  training process goes (it sees the end of its socket, or another parent process id, and exits at
  once); it ignores the stop signals, which
  the training process acts on. If it dies, the save it was writing fails with ``WriterProcessDied`` and
  nothing of it is committed (the durable commit follows the writes, in the training process; a
  memory-tier step is committed by its rank manifest, the last file its writer writes), and the
  next save starts a new writer.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from trainguard.checkpoint.config import WRITERS
from trainguard.checkpoint.shared_buffers import ArenaRef, SharedArena, allocate_shared, tensor_in
from trainguard.checkpoint.staging import allocate_each
from trainguard.errors import CheckpointError, ConfigError
from trainguard.forking import PARENT_POLL_S, STOP_SIGNALS, ForkedProcess, ForkServer, start_server

Result = TypeVar("Result")
Value = TypeVar("Value")


READY = b"ready"
"""The writer process's first message: its imports are done and it reads requests."""

_fork_server: ForkServer | None = None
"""Where this process forks its writer processes from (``start_writer_fork_server``); None: cold starts."""


def start_writer_fork_server() -> None:
    """Makes this process fork its writer processes from a copy of itself taken now if it has one thread
    (a rank's first code calls it, ``runtime.fork_server.run_rank``): each is then one fork, without the
    1.6 s of CPU of a new interpreter's imports (``trainguard.forking``); otherwise they start cold."""
    global _fork_server
    _fork_server = start_server(_forked_writer)


def _forked_writer(_message: bytes, fds: list[int]) -> None:
    serve(fds[0])


class WriterProcessDied(CheckpointError):
    """The writer process ended while it was writing a save (that save is not committed)."""


class Writer(Protocol):
    def start(self) -> None: ...

    def run(self, function: Callable[..., Result], *args: Any, **kwargs: Any) -> Result: ...

    def received(self, value: Value) -> Value: ...


class InProcess:
    """Runs the writing functions in the calling thread: sync saves, and ``checkpoint.writer: thread``."""

    def start(self) -> None:
        """Nothing to start."""

    def run(self, function: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
        return function(*args, **kwargs)

    def received(self, value: Value) -> Value:
        """``value`` as a function ``run`` here gets it: itself."""
        return value


IN_PROCESS = InProcess()


class WriterProcess:
    def __init__(self, name: str):
        """``name`` says which tier it writes for, in errors."""
        self.name = name
        self._arena: SharedArena | None = None
        self._process: subprocess.Popen | ForkedProcess | None = None
        self._connection: Connection | None = None
        self._ready = False
        self._lock = threading.Lock()
        self.ready_at_first_request: bool | None = None
        """None until the first request; then whether the writer process had started and finished its
        imports before that request was made (False: the request waited for the start)."""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def allocate(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """Staging buffers like ``sources`` in shared memory (a ``ReusableStager``'s allocator); they
        replace the previous set, whose save must be written already."""
        self._arena, buffers = allocate_shared(sources)
        return buffers

    def start(self) -> None:
        """Starts the writer process unless it runs; returns at once (it becomes ready meanwhile)."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()

    def received(self, value: Value) -> Value:
        """``value`` as a function ``run`` in the writer process gets it (passed by value): a pickled
        copy. Serialising it gives the writer's bytes, which serialising ``value`` itself may not:
        pickle refers back to an object seen before (an interned string such as a mesh's ``"cpu"``,
        also torch's storage location tag) where the copy has an equal object of its own."""
        return pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def run(self, function: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
        """``function(*args, **kwargs)`` in the writer process (a module-level function); tensors in
        the staging buffers are passed by position, any other by value."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            assert self._process is not None and self._connection is not None
            if self.ready_at_first_request is None:
                self.ready_at_first_request = self._ready or self._connection.poll(0)
            if not self._ready:
                self._read_ready(function.__name__)
            arena = self._arena
            header = (os.getpid(), arena.token, arena.fd, arena.nbytes) if arena is not None else None
            message = pickle.dumps((header, function, _by_position(args, arena), _by_position(kwargs, arena)),
                                   protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self._connection.send_bytes(message)
                status, value = pickle.loads(self._connection.recv_bytes())
            except (EOFError, OSError):
                raise self._died(function.__name__) from None
        if status == "error":
            raise value
        return value

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        source_root = str(Path(__file__).resolve().parents[2])  # the directory holding the trainguard package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (source_root, os.environ.get("PYTHONPATH")))))
        try:  # forked, without imports, where this process started a writer fork server
            forked = _fork_server.fork(b"writer", [theirs.fileno()]) if _fork_server is not None else None
            self._process = forked or subprocess.Popen(
                [sys.executable, "-m", "trainguard.checkpoint.writer_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._connection = Connection(ours.detach())
        self._ready = False
        weakref.finalize(self, _stop, self._connection, self._process)

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether the writer process runs and has said it is ready, waiting up to ``timeout`` seconds
        for it (it is not started here); raises ``WriterProcessDied`` when it ended first."""
        with self._lock:
            if self._ready or self._connection is None:
                return self._ready
            if self._connection.poll(timeout):
                self._read_ready("its start")
            return self._ready

    def _read_ready(self, during: str) -> None:
        assert self._connection is not None
        try:
            message = self._connection.recv_bytes()
        except (EOFError, OSError):
            raise self._died(during) from None
        if message != READY:
            raise CheckpointError(f"the {self.name} checkpoint writer process sent {message[:40]!r} before "
                                  "saying it was ready")
        self._ready = True

    def _died(self, during: str) -> WriterProcessDied:
        process, connection = self._process, self._connection
        self._process = self._connection = None
        self._ready = False
        assert process is not None and connection is not None
        connection.close()
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # alive but its socket broke: it is of no use any more
            process.kill()
            code = process.wait()
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return WriterProcessDied(f"the {self.name} checkpoint writer process (pid {process.pid}) ended ({how}) "
                                 f"during {during}: the checkpoint it was writing is not committed")


def make_writer(kind: str, name: str) -> InProcess | WriterProcess:
    """The writer ``checkpoint.writer`` names (``"process"`` or ``"thread"``) for the tier ``name``."""
    if kind not in WRITERS:
        raise ConfigError(f"config key 'checkpoint.writer' must be one of {', '.join(WRITERS)}, got {kind!r}")
    return WriterProcess(name) if kind == "process" else IN_PROCESS


def allocator_for(writer: InProcess | WriterProcess) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """How to allocate staging buffers the writer can read: in shared memory for a writer process."""
    return writer.allocate if isinstance(writer, WriterProcess) else allocate_each


def writer_died(error: BaseException) -> WriterProcessDied | None:
    """The ``WriterProcessDied`` behind ``error`` (itself, or a rank's failure inside DCP's
    ``CheckpointException``), None when there is none."""
    if isinstance(error, WriterProcessDied):
        return error
    for failure in (getattr(error, "failures", None) or {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, WriterProcessDied):
            return cause
    return None


def _stop(connection: Connection, process: subprocess.Popen | ForkedProcess) -> None:
    """At exit (or when the writer is dropped): closing the socket ends the writer's loop."""
    connection.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def _by_position(value: Any, arena: SharedArena | None) -> Any:
    if isinstance(value, torch.Tensor):
        ref = arena.ref(value) if arena is not None else None
        return ref if ref is not None else value
    if isinstance(value, dict):
        return {key: _by_position(item, arena) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_by_position(item, arena) for item in value)
    return value


def _rebuilt(value: Any, mappings: dict[str, Any]) -> Any:
    if isinstance(value, ArenaRef):
        return tensor_in(mappings[value.arena], value)
    if isinstance(value, dict):
        return {key: _rebuilt(item, mappings) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_rebuilt(item, mappings) for item in value)
    return value


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def serve(fd: int) -> None:
    """The writer process's loop: one request at a time, until the training process closes its end."""
    import mmap

    # The stop signals reach every process of a job step (Slurm's --signal, Ctrl-C): the training
    # process acts on them and may save once more, so the writer lives on; it ends with the training
    # process instead, and at once, so that it never commits a step after the process that asked for
    # it is gone (and a new incarnation may be recovering).
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True, name="trainguard-writer-watch").start()
    torch.set_num_threads(1)
    connection = Connection(fd)
    try:
        connection.send_bytes(READY)
    except OSError:  # the training process ended before this one was ready (a run that failed at its start)
        return
    mappings: dict[str, mmap.mmap] = {}
    while True:
        try:
            request = connection.recv_bytes()
        except (EOFError, OSError):
            return
        header, function, args, kwargs = pickle.loads(request)
        try:
            if header is not None and header[1] not in mappings:
                pid, token, arena_fd, nbytes = header
                with open(f"/proc/{pid}/fd/{arena_fd}", "r+b") as file:
                    mappings = {token: mmap.mmap(file.fileno(), nbytes)}  # the previous arena is done with
            reply = ("ok", function(*_rebuilt(args, mappings), **_rebuilt(kwargs, mappings)))
        except BaseException as exc:  # the save's error, raised in the training process
            reply = ("error", exc)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an error that does not pickle: its text
            data = pickle.dumps(("error", CheckpointError(f"{function.__name__}: {reply[1]!r}")))
        connection.send_bytes(data)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
