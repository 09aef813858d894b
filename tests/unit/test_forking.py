"""``trainguard.forking``: a child forked by the server ends as a new interpreter would (its return
value, a ``SystemExit``'s code, 1 after a traceback), with a new interpreter's signal dispositions,
gets the fds sent with its request, is waited for, polled and killed as with ``subprocess.Popen`` (a
child that ended is not signalled: its pid may be reused); the server ignores the stop signals and ends
with its owner.

The owner runs in a new interpreter (the server must be forked from a process with one thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.processes import alive

SRC = str(Path(__file__).resolve().parents[2] / "src")

OWNER = r"""
import json, os, signal, subprocess, sys, time
from trainguard.forking import ForkServer

def child(message, fds):
    kind = message.decode()
    if kind == "return":
        return 3
    if kind == "exit":
        sys.exit(5)
    if kind == "raise":
        raise ValueError("raised in the child")
    if kind == "signals":  # a new interpreter's, not the owner's handler nor the server's SIG_IGN
        fresh = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
                 and all(signal.getsignal(s) == signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGUSR1)))
        return 0 if fresh else 9
    if kind == "write":
        os.write(fds[0], b"through the fd it was sent")
        return 0
    time.sleep(60)

signal.signal(signal.SIGTERM, lambda *_: None)  # the owner's own handler
server = ForkServer(child)
result = {kind: server.fork(kind.encode()).wait(30) for kind in ("return", "exit", "raise", "signals")}
read, write = os.pipe()
writer = server.fork(b"write", [write])
os.close(write)
result["write"] = [writer.wait(30), os.read(read, 100).decode()]
sleeper = server.fork(b"sleep")
result["sleeping"] = sleeper.poll()
try:
    sleeper.wait(0.2)
except subprocess.TimeoutExpired:
    result["timed_out"] = True
ended = server.fork(b"return")
while os.path.exists(f"/proc/{ended.pid}"):  # reaped by the server; nothing asked about it on this side
    time.sleep(0.01)
sent = []
real_kill, os.kill = os.kill, lambda pid, number: sent.append(pid)
deadline = time.monotonic() + 10
while ended.returncode is None and time.monotonic() < deadline:  # until kill() learns the end itself
    sent.clear()  # signals sent before the server's "ended" line came are no fault
    ended.kill()
    time.sleep(0.01)
os.kill = real_kill
result["ended_then_killed"] = [sent, ended.returncode]  # the kill that learned it: no signal
os.kill(server.pid, signal.SIGTERM)  # a job step's stop reaches the server too
sleeper.kill()
result["killed"] = sleeper.wait(30)
result["server"], result["server_parent"] = server.pid, int(open(f"/proc/{server.pid}/stat").read().split(")")[1].split()[1])
result["owner"] = os.getpid()
print(json.dumps(result), flush=True)
"""


def test_children_end_and_are_waited_for_as_new_interpreters_and_the_server_ends_with_its_owner():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", OWNER], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["return"], result["exit"], result["raise"], result["signals"]) == (3, 5, 1, 0), result
    assert "ValueError: raised in the child" in done.stderr  # the traceback a new interpreter prints
    assert result["write"] == [0, "through the fd it was sent"]
    assert result["sleeping"] is None and result["timed_out"] is True
    assert result["killed"] == -9  # SIGKILL, as Popen.wait reports it; the server outlived its SIGTERM
    assert result["ended_then_killed"] == [[], 3]
    assert result["server_parent"] == result["owner"]
    deadline = time.monotonic() + 10
    while alive(result["server"]):
        assert time.monotonic() < deadline, "the fork server outlived its owner"
        time.sleep(0.05)


FINALIZERS = r"""
import os, sys, weakref
from pathlib import Path
from trainguard.forking import ForkServer

class Thing:
    pass

out = Path(sys.argv[1])
owners = Thing()  # alive in the owner, and in every child as a copy: the child must not finalize it
weakref.finalize(owners, lambda: (out / f"owner-{os.getpid()}").write_text("finalized"))

def child(message, fds):
    global kept  # alive until the child's end: only its exit runs the finalizer
    kept = Thing()
    weakref.finalize(kept, (out / "child").write_text, "finalized")

server = ForkServer(child)
sys.exit(server.fork(b"go").wait(30))
"""


def test_a_childs_own_finalizers_run_at_its_exit_and_the_owners_do_not(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", FINALIZERS, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "child").read_text() == "finalized"
    assert len(list(tmp_path.glob("owner-*"))) == 1  # at the owner's exit only, not at the child's


CALL_IN_FORK = r"""
import json, sys, threading
from trainguard.errors import NoCheckpointError
from trainguard.forking import call_in_fork, thread_count

def leaves_a_thread(value):
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # as an S3 client's event loop
    return value * 2

def refuses(path):
    raise NoCheckpointError(f"{path}: no complete global_step_7 in the mirror")

result = {"value": call_in_fork(leaves_a_thread, 21), "threads": thread_count()}
try:
    call_in_fork(refuses, "s3://b/p")
except NoCheckpointError as error:
    result["error"] = [type(error).__name__, str(error), error.exit_code]
print(json.dumps(result))
"""


def test_call_in_fork_returns_the_childs_result_raises_its_error_and_keeps_this_process_one_thread():
    """``call_in_fork`` (the live launcher's restore from a mirror): a thread the function leaves behind ends
    with its child, so the caller can still fork its launcher; the child's exception, its exit code kept, is
    raised in the caller."""
    done = subprocess.run([sys.executable, "-c", CALL_IN_FORK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"value": 42, "threads": 1,
                                       "error": ["NoCheckpointError", "s3://b/p: no complete global_step_7 in the mirror", 4]}


NUMPY_PROBE = r"""
import json, os, sys
from trainguard.forking import import_numpy_with_one_thread, thread_count
import_numpy_with_one_thread()
print(json.dumps({"numpy": "numpy" in sys.modules, "threads": thread_count(),
                  "variable": os.environ.get("OPENBLAS_NUM_THREADS")}))
"""


def test_numpy_imported_with_one_thread_and_the_users_blas_variable_put_back():
    """Without it numpy's OpenBLAS starts a thread per core but one at import (OMP_NUM_THREADS unset, as in a
    user's shell); the process this runs in (the CLI that forks the live launcher) keeps one thread, and the
    variable its children inherit is the user's: unset, or the user's own value."""
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env["PYTHONPATH"] = SRC
    for users, expected in ((None, None), ("3", "3")):
        probe_env = env if users is None else {**env, "OPENBLAS_NUM_THREADS": users}
        out = subprocess.run([sys.executable, "-c", NUMPY_PROBE], env=probe_env, capture_output=True, text=True,
                             check=True, timeout=120).stdout
        assert json.loads(out) == {"numpy": True, "threads": 1, "variable": expected}
