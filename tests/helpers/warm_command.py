"""``python -m trainguard ...`` forked from a warm interpreter instead of started cold.

Most of a tiny test run's CPU time is the new interpreter's imports (torch, torch.distributed,
transformers: about 3.5 s of a 1-step 2-rank run's 4 s on two cores), paid again by each of the
suite's ~150 runs. The product avoids the same cost for its own processes by forking them from a
process that has imported the trainer (the supervisor forks its node agents, an agent forks its
ranks from ``runtime/fork_server.py``). Here a server process imports what ``trainguard train`` needs
once, keeps one thread, and forks one child per command; the child becomes what ``python -m
trainguard`` is (its own session, the caller's environment, working directory, stdout and stderr,
``trainguard.__main__``'s ending) and runs the real command. The server sends the child's pid, then
its exit status, back to the caller, which sees a ``Popen``-like object.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainguard.forking import end_as_interpreter

# what ``trainguard train`` imports on its way to the supervisor, an agent and a rank (imported once
# in the server; a rank forked from it, or from its children, finds them loaded)
PRELOAD = ("trainguard.cli", "trainguard.cli.train", "trainguard.cli.run", "trainguard.runtime.supervisor",
           "trainguard.runtime.launcher", "trainguard.trainer.entry", "trainguard.trainer.loop")


# ----------------------------------------------------------------------------------- server side
def _child(argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> None:
    """In the forked child: become ``python -m trainguard ARGV`` and never return."""

    def command() -> int:
        os.setsid()  # as Popen(start_new_session=True): a timeout kills the whole session
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (stdin, *fds):
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [sys.argv[0], *argv]
        from trainguard.cli import main

        return main(argv)

    end_as_interpreter(command)


def serve(address: str) -> None:
    """The server: preloads, then forks a child per request until its parent (the test process) is gone."""
    import importlib

    from trainguard.forking import thread_count

    for module in PRELOAD:
        importlib.import_module(module)
    threads = thread_count()
    if threads != 1:  # some builds of torch start a thread at import (seen with CUDA builds): no safe fork
        print(f"the warm server must have one thread to fork from, it has {threads}: commands start cold",
              file=sys.stderr)
        os._exit(COLD)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    waiting: dict[int, socket.socket] = {}  # child pid -> the caller's connection
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _child(request["argv"], request["env"], request["cwd"], fds)
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # a caller that is gone does not end the server
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


# ----------------------------------------------------------------------------------- caller side
class WarmProcess:
    """The part of ``subprocess.Popen`` that ``helpers.runs.finish_session`` uses."""

    def __init__(self, args: list[str], conn: socket.socket, stdout: int, stderr: int):
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._reply = conn.makefile("r")
        self.pid = int(self._reply.readline())
        self._chunks: dict[int, list[bytes]] = {stdout: [], stderr: []}
        self._readers = [threading.Thread(target=self._drain, args=(fd,), daemon=True) for fd in (stdout, stderr)]
        self._readers.append(threading.Thread(target=self._wait, daemon=True))
        for reader in self._readers:
            reader.start()
        self._fds = (stdout, stderr)

    def _drain(self, fd: int) -> None:
        while chunk := os.read(fd, 1 << 16):
            self._chunks[fd].append(chunk)
        os.close(fd)

    def _wait(self) -> None:
        line = self._reply.readline()
        self.returncode = int(line) if line else -1
        self._reply.close()
        self._conn.close()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Until the command has exited and closed its output (its stdout and stderr are kept)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out, err = (b"".join(self._chunks[fd]).decode(errors="replace") for fd in self._fds)
        return out, err


COLD = 3
"""The server's exit code when it cannot fork safely: every command then starts a fresh interpreter."""


class WarmServer:
    def __init__(self) -> None:
        self._directory = tempfile.mkdtemp(prefix="trainguard-warm-")
        self.address = os.path.join(self._directory, "socket")
        helpers = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [helpers, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
        env.pop("TRAINGUARD_FAULTS", None)
        # ``-c``: no main module for multiprocessing to re-import in the ranks (as with ``-m trainguard``)
        self._proc = subprocess.Popen([sys.executable, "-c", "import sys; from helpers.warm_command import serve; "
                                       "serve(sys.argv[1])", self.address], env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        self.cold = False
        while not os.path.exists(self.address):
            if self._proc.poll() == COLD:
                self.cold = True
                return
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm command server did not start (exit {self._proc.poll()})")
            time.sleep(0.05)

    def start(self, args: list[str], env: dict[str, str]) -> WarmProcess | subprocess.Popen:
        if self.cold:
            return subprocess.Popen([sys.executable, "-m", "trainguard", *args], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.connect(self.address)
            request = json.dumps({"argv": list(args), "env": env, "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [request], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        return WarmProcess([sys.executable, "-m", "trainguard", *args], conn, out_r, err_r)

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait()
        import shutil

        shutil.rmtree(self._directory, ignore_errors=True)


_server: WarmServer | None = None


def warm_server() -> WarmServer:
    """The session's server, started at the first call and stopped when the test process exits."""
    global _server
    if _server is None:
        import atexit

        _server = WarmServer()
        atexit.register(_server.stop)
    return _server
