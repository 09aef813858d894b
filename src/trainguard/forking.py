"""A process's helpers forked from a one-thread copy of it, instead of started as new interpreters.

A new interpreter imports torch and trainguard again: seconds of CPU per process on a busy machine,
paid by every checkpoint writer process (per rank, tier and incarnation) and every live-recovery
rank. A process that has imported them already can fork its helpers for the price of a fork, but
only while it has one thread: forked from a process with threads (gloo's, a TCPStore's, an async
save's), a child finds a lock one of them held at that instant locked for ever. So the process forks
a ``ForkServer`` while it still has one thread (``start_server`` checks it: ``thread_count``);
the server forks a child per request, which runs ``child(message, fds)``, and tells the caller the
child's pid and, later, its exit status: ``ForkedProcess`` is the part of ``subprocess.Popen`` that
its users need (pid, poll, wait, kill, returncode). Work that would leave threads behind before such a
fork (an object store client's event loop) runs in a child of its own (``call_in_fork``).

The server ignores the stop signals (they reach every process of a job step; its owner decides what
they mean), and ends when its owner does: at the end of its socket, or within ``PARENT_POLL_S`` of
seeing another parent process id. A child starts with the signal dispositions of a new interpreter
and the environment the request gives; its exit code is ``child``'s return value (None: 0), a
``SystemExit``'s code, or 1 after an uncaught exception's traceback, as a new interpreter's would be.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

PARENT_POLL_S = 0.05
"""How often the server checks that its owner is still there."""

MAX_MESSAGE = 1 << 20
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

Child = Callable[[bytes, list[int]], "int | None"]
T = TypeVar("T")
RETURNED, RAISED = "return", "raise"  # the kinds of a forked call's outcome (``pickled_outcome``)


BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def import_numpy_with_one_thread() -> None:
    """Imports numpy (torch imports it) with OpenBLAS at one thread, in a process that forks its helpers:
    OpenBLAS starts its thread pool (a thread per core but one) when numpy is imported, and a process with
    threads cannot fork safely (``single_threaded``). Without it, wherever the user had not set
    ``OMP_NUM_THREADS`` (a shell, an sbatch script), the live launcher ran unsupervised, with a warning.
    The variable is put back as it was, so the processes this one starts see the user's environment."""
    if "numpy" in sys.modules:
        return
    before = os.environ.get(BLAS_THREADS)
    os.environ[BLAS_THREADS] = "1"
    try:
        import numpy  # noqa: F401
    except ImportError:  # torch runs without numpy: no pool to keep out
        pass
    finally:
        if before is None:
            os.environ.pop(BLAS_THREADS, None)
        else:
            os.environ[BLAS_THREADS] = before


def thread_count() -> int:
    """Threads of this process, C++ ones included (``threading`` sees only Python's)."""
    return len(os.listdir("/proc/self/task"))


def single_threaded(wait_s: float = 1.0) -> bool:
    """Whether this process has one thread, waiting up to ``wait_s`` for the others to end: a thread that
    was joined (a ``ThreadPoolExecutor``'s, after a checkpoint's verification) leaves Python's view before
    the OS has ended it, so a count taken at once still sees it (seen: 13 of 30 verifications)."""
    deadline = time.monotonic() + wait_s
    while thread_count() != 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def call_in_fork(function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` run in a child forked for it, its result returned (or its exception raised) here,
    so that the threads it starts (an S3 client's event loop) end with the child and this process keeps one
    thread for the forks it makes later (``start_server``, the live launcher's supervisor). A process that
    has threads already runs ``function`` itself: a child forked from it could find a lock held for ever."""
    if thread_count() != 1:
        return function(*args)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(pickled_outcome(lambda: function(*args)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the process forked to run {function.__name__} ended without a result "
                           f"(exit {os.waitstatus_to_exitcode(status)})")
    kind, value = pickle.loads(data)  # written by this process's own fork
    if kind == RAISED:
        raise value
    return value


def pickled_outcome(call: Callable[[], object]) -> bytes:
    """``call()``'s outcome for the process that forked this one: ``(RETURNED, its result)`` or ``(RAISED, its
    exception)`` pickled; an exception whose arguments do not rebuild it goes as a ``RuntimeError`` of its
    text."""
    try:
        outcome: tuple[str, object] = (RETURNED, call())
    except BaseException as error:  # handed to the parent, which raises it as its own
        outcome = (RAISED, error)
    try:
        data = pickle.dumps(outcome)
        pickle.loads(data)
    except Exception:
        data = pickle.dumps((RAISED, RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]}")))
    return data


def start_server(child: Child) -> ForkServer | None:
    """A ``ForkServer(child)`` forked now, or None when this process has threads already (a child forked
    from it could find a lock held for ever) or the system has no process or socket to spare (EAGAIN,
    ENOMEM): the caller then starts its processes as new interpreters."""
    if thread_count() != 1:
        return None
    try:
        return ForkServer(child)
    except OSError:
        return None


class ForkServer:
    """The owner's side; ``ForkServer(child)`` forks the server from this process (one thread only)."""

    def __init__(self, child: Child):
        ours, theirs = socket.socketpair()
        self.owner = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            try:
                _serve(theirs, self.owner, child)
            finally:
                os._exit(0)
        theirs.close()
        self.pid = pid
        self._control = ours
        self._buffer = b""
        self._lock = threading.Lock()
        self._ended: dict[int, int] = {}  # child pid -> its exit code

    def fork(self, message: bytes, fds: Sequence[int] = ()) -> ForkedProcess | None:
        """A child running ``child(message, fds)`` (the fds are the child's copies; the caller keeps its
        own); None when this process is not the server's owner (a child of it inherited this object) or
        the server is gone: the caller starts the process another way."""
        if os.getpid() != self.owner:
            return None
        with self._lock:
            try:
                socket.send_fds(self._control, [message], list(fds))
                while True:
                    word, *numbers = self._read_line(None).split()
                    if word == b"started":
                        return ForkedProcess(self, int(numbers[0]))
                    self._ended[int(numbers[0])] = int(numbers[1])
            except (OSError, ValueError, IndexError):
                return None

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code, waiting up to ``timeout`` seconds for it (None: for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._ended:
                try:
                    line = self._read_line(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except OSError:  # the server is gone: its children learn it from their parent's death
                    return -signal.SIGKILL
                if line is None:
                    return None
                _, pid_text, code = line.split()
                self._ended[int(pid_text)] = int(code)
            return self._ended[pid]

    def _read_line(self, timeout: float | None) -> bytes | None:
        """The server's next line; None when none came within ``timeout`` seconds (None: for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._control], [], [], left)[0]:
                return None
            chunk = self._control.recv(4096)
            if not chunk:
                raise OSError("the fork server ended")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


class ForkedProcess:
    """A child the server forked (the part of ``subprocess.Popen`` its users need)."""

    def __init__(self, server: ForkServer, pid: int):
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # an ended child's pid may be another process's by now
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ----------------------------------------------------------------------------------- server side
def _serve(control: socket.socket, owner: int, child: Child) -> None:
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # the owner may have held some back
    atexit._clear()  # the owner's exit handlers are not the children's
    for finalizer in list(weakref.finalize._registry):  # nor are its objects' finalizers
        finalizer.detach()
    weakref.finalize._registered_with_atexit = False  # a child's own finalizers run at its exit
    while os.getppid() == owner:
        readable, _, _ = select.select([control], [], [], PARENT_POLL_S)
        if readable:
            message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 16)
            if not message:  # the owner closed its end: it is gone
                return
            pid = os.fork()
            if pid == 0:
                control.close()
                _run_child(child, message, fds)
            for fd in fds:
                os.close(fd)
            control.sendall(b"started %d\n" % pid)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            control.sendall(b"ended %d %d\n" % (pid, os.waitstatus_to_exitcode(status)))


def _run_child(child: Child, message: bytes, fds: list[int]) -> None:
    """In the forked child: a new interpreter's signal dispositions, then ``child``, then the end."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in STOP_SIGNALS[1:]:
        signal.signal(number, signal.SIG_DFL)
    end_as_interpreter(lambda: child(message, fds))


def end_as_interpreter(main: Callable[[], int | None]) -> NoReturn:
    """Runs ``main`` in a forked process and ends the process as a new interpreter running it would:
    exit code ``main``'s return value (None: 0), a ``SystemExit``'s code (its text on stderr and 1 if
    not a number), or 1 after an uncaught exception's traceback; exit handlers and logging's shutdown
    run first, the ones registered since the fork (a fork server clears its owner's)."""
    code = 1
    try:
        try:
            code = main() or 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        atexit._run_exitfuncs()
        logging.shutdown()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
