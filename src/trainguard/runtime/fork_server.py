"""The fork server the ranks are forked from: a copy of the agent taken while it still had one thread.

Forking the ranks from the agent itself (torch's ``start_method="fork"``) forks a process with threads
(the rendezvous store's server, the agent's control server): a lock one of them holds at that instant
stays locked for ever in the child, and rarely a rank hung single-threaded in a futex inside
``init_process_group`` (``_create_c10d_store``) right after being forked. Python's own fork server
forks from a process with one thread, but it starts as a new interpreter that imports torch and the
trainer again, seconds per incarnation: the cost that forking was chosen to avoid. This server is the
same loop (``multiprocessing.forkserver.main``), run in a fork of the agent made after its imports
and before its first thread, so a rank costs one fork of a one-thread process and no imports.

Two differences from the standard one: its socket is a file in a directory only this user can enter
(the standard one is an abstract socket any local user may connect to, on Python < 3.13), and it
keeps SIGTERM blocked, so that a SIGTERM sent to every process of a job (Slurm's ``scancel``) cannot
end it while its ranks save (the agent would read their exit codes as 255); a rank unblocks it first
thing (``run_rank``), receiving a SIGTERM that arrived in between.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Any

from trainguard.checkpoint.writer_process import start_writer_fork_server
from trainguard.forking import thread_count
from trainguard.run_secret import require_owner_only

START_METHOD = "forkserver"  # multiprocessing's name for "ask the fork server"


def _python_threads() -> str:
    import threading

    return ", ".join(thread.name for thread in threading.enumerate())


def start_fork_server() -> None:
    """Forks the fork server from this process, which must have one thread, and makes it the one that
    multiprocessing's ``forkserver`` start method asks for new processes."""
    threads = thread_count()
    if threads != 1:
        raise RuntimeError(f"the fork server must be forked from a process with one thread, this one has {threads} "
                           f"(Python's: {_python_threads()})")
    resource_tracker.ensure_running()  # started here, once: the server's children share it
    directory = tempfile.mkdtemp(prefix="trainguard-forkserver-")  # mode 0700: only this user connects
    require_owner_only(Path(directory), "the fork server's directory")
    address = os.path.join(directory, "socket")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)  # closed twice: a socket made under a permissive umask is writable by all
    require_owner_only(Path(address), "the fork server's socket")
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server exits when every holder of alive_w (agent, ranks) is gone
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            forkserver.main(listener.fileno(), alive_r, preload=[])
        except SystemExit:
            pass
        finally:
            shutil.rmtree(directory, ignore_errors=True)
            os._exit(0)
    listener.close()
    os.close(alive_r)
    # multiprocessing keeps its fork server's address in this module-level object and starts a new
    # interpreter only when it has none running: handing it ours is the whole of the hook
    server = forkserver._forkserver
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def run_rank(entrypoint: Callable[[list[str]], Any], argv: list[str]) -> Any:
    """A rank's first code: forks the server of its checkpoint writer processes while it still has one
    thread (``writer_process.start_writer_fork_server``), takes SIGTERM back from the server's mask, then
    runs ``entrypoint(argv)``."""
    start_writer_fork_server()  # forked only if this rank has one thread yet (not spawned by a launcher with threads)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    return entrypoint(argv)
