"""The ranks' fork server: a rank is forked from a one-thread copy of the agent, so a lock an agent
thread holds when the rank starts does not block the rank (forking from the agent itself does: the
cause of ranks hanging in init_process_group); SIGTERM to every process spares the server, not a rank.

Each case runs in a new interpreter (the server must be forked from a process with one thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[3] / "src")

AGENT = r"""
import json, multiprocessing as mp, os, signal, sys, threading, time
from trainguard.forking import thread_count
from trainguard.runtime.fork_server import run_rank, start_fork_server

lock = threading.Lock()  # made before any fork: a rank gets its own copy

def take_lock(_argv):
    return lock.acquire(timeout=2)  # False: the copy was locked for ever, as a futex in c10d was

def report(queue):
    queue.put({"parent": os.getppid(), "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
               "lock_free": run_rank(take_lock, [])})

def sleep_forever():
    run_rank(time.sleep, 60)

method = sys.argv[1]
if method == "server":
    start_fork_server()
holding = threading.Event()
def hold():  # an agent thread (the rendezvous store's, say) inside its lock while the ranks start
    with lock:
        holding.set()
        time.sleep(30)
threading.Thread(target=hold, daemon=True).start()
holding.wait()
ctx = mp.get_context("forkserver" if method == "server" else "fork")
queue = ctx.SimpleQueue()
rank = ctx.Process(target=report, args=(queue,))
rank.start()
result = queue.get()
rank.join()
result.update(agent=os.getpid(), agent_threads=thread_count())
if method == "server":
    server = result["parent"]
    os.kill(server, signal.SIGTERM)  # scancel: SIGTERM to every process of the job
    sleeper = ctx.Process(target=sleep_forever)
    sleeper.start()  # the server still forks after it
    time.sleep(0.5)
    os.kill(sleeper.pid, signal.SIGTERM)
    sleeper.join(10)
    result["rank_sigterm_exit"] = sleeper.exitcode
print(json.dumps(result), flush=True)
"""


def run_agent(method: str) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", AGENT, method], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_rank_is_forked_from_a_one_thread_server_and_an_agent_threads_lock_does_not_block_it():
    result = run_agent("server")
    assert result["agent_threads"] >= 2  # the agent has a thread holding the lock...
    assert result["parent"] != result["agent"] and result["parent_threads"] == 1  # ...the rank's parent has none
    assert result["lock_free"] is True
    # a SIGTERM to the server is held back; the rank takes it as a rank without a handler does
    assert result["rank_sigterm_exit"] == -15


def test_the_same_rank_forked_from_the_agent_finds_the_lock_held_for_ever():
    """The failure the server removes, shown with a Python lock (the real one was in c10d's C++)."""
    result = run_agent("fork")
    assert result["parent"] == result["agent"]
    assert result["lock_free"] is False


THREADED_AGENT = r"""
import json, multiprocessing as mp, os, sys, threading, time
from trainguard.runtime.launcher import start_rank_server

def report(queue):
    queue.put({"parent": os.getppid(), "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
               "preloaded": "colorsys" in sys.modules})

if __name__ == "__main__":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread before the server
    start_rank_server(preload=("colorsys",))
    ctx = mp.get_context("forkserver")
    queue = ctx.SimpleQueue()
    rank = ctx.Process(target=report, args=(queue,))
    rank.start()
    result = queue.get()
    rank.join()
    result["agent"] = os.getpid()
    print(json.dumps(result), flush=True)
"""


def test_an_agent_that_already_has_a_thread_starts_its_ranks_from_pythons_own_fork_server(tmp_path):
    """Not a refusal (every run with an s3 mirror failed so once: its client's event-loop thread): a
    warning, and the ranks come from a new one-thread interpreter that imported the preload."""
    script = tmp_path / "agent.py"
    script.write_text(THREADED_AGENT)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "its ranks start from Python's own fork server" in proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["parent"] != result["agent"] and result["parent_threads"] == 1 and result["preloaded"]


OWNER_ONLY_AGENT = r"""
import json, os, socket, stat, subprocess, sys
from multiprocessing import forkserver
from trainguard.runtime.fork_server import start_fork_server

os.umask(0)  # the most permissive umask: what the server makes must be closed anyway
start_fork_server()
address = forkserver._forkserver._forkserver_address
result = {"socket": stat.S_IMODE(os.stat(address).st_mode), "dir": stat.S_IMODE(os.stat(os.path.dirname(address)).st_mode)}
if os.geteuid() == 0:  # another user's process tries to connect
    probe = "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)"
    result["other_user"] = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                           "-c", probe, address], capture_output=True, text=True).stdout.strip()
print(json.dumps(result), flush=True)
"""


def test_the_fork_servers_socket_is_owner_only_whatever_the_umask():
    """Issue 40: the server's socket is a file in a 0700 directory and itself 0600, checked at start, so
    no other user can ask it for a process (Python's own is an abstract socket anyone may connect to)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", OWNER_ONLY_AGENT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["dir"], result["socket"]) == (0o700, 0o600)
    if "other_user" in result:
        assert result["other_user"] == "PermissionError"
