"""A rank of ``live_loop.py`` that fails before its first step, for the live launcher's start-up tests
(test_live_start_failures.py). ``LIVE_EARLY_EXIT`` says where, and the rank's exit code ``LIVE_EARLY_EXIT_CODE``
(1 unless given):

- ``import``: at import, a line on standard error, before the store is reached (a broken environment);
- ``sigkill``: SIGKILLed at import, before the store is reached (the OOM killer, a node's cgroup);
- ``stop-once:RANK``: that rank's first process stops itself (SIGSTOP) at import, before the store is reached
  (a hang at start: imports on a stuck file system); its replacement trains;
- ``begin:RANKS``: the ranks listed (``0,1``) right after reaching the store, before epoch 0's process
  group is built; ``begin-once:RANKS``: the same, the first process of each of those ranks only (a marker
  file in the run directory), so that its replacement trains; ``begin-on:NODE``: the same, any rank whose
  node (``LIVE_NODE``, set by the test's node command) is NODE (a data file missing on that node);
- ``resumed``: every rank after ``guard.resume()`` (the store reached, epoch 0's group built), before its
  first step.

A process of a rank that joins (``--rejoin``: a replacement) fails the same way, as a deterministic
failure does."""

import os
import signal
import sys
from pathlib import Path

WHERE = os.environ.get("LIVE_EARLY_EXIT", "")
CODE = int(os.environ.get("LIVE_EARLY_EXIT_CODE", "1"))


def rank_of(argv: list[str]) -> int:
    return int(argv[argv.index("--rank") + 1]) if "--rank" in argv else -1


def fail(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    os._exit(CODE)


if WHERE == "import":
    fail(f"ModuleNotFoundError: No module named 'missing_dependency' (rank {rank_of(sys.argv)})")
if WHERE == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if WHERE.startswith("stop-once:") and rank_of(sys.argv) == int(WHERE.split(":")[1]):
    stopped = Path(sys.argv[sys.argv.index("--run-dir") + 1]) / f"early_stop_rank_{rank_of(sys.argv)}"
    if not stopped.exists():
        stopped.touch()
        os.kill(os.getpid(), signal.SIGSTOP)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import live_loop  # noqa: E402  (after the failures that come before any import)
import trainguard  # noqa: E402
from trainguard.live.worker import LiveWorker  # noqa: E402

if WHERE.startswith("begin-on:"):
    failing = WHERE.split(":")[1] == os.environ.get("LIVE_NODE")
elif WHERE.split(":")[0] in ("begin", "begin-once"):
    failing = rank_of(sys.argv) in {int(r) for r in WHERE.split(":")[1].split(",")}
else:
    failing = False
if failing:
    begin = LiveWorker.begin
    marker = Path(sys.argv[sys.argv.index("--run-dir") + 1]) / f"early_exit_rank_{rank_of(sys.argv)}"

    def fail_at_begin(self, rejoin: bool) -> None:
        if WHERE.startswith("begin-once") and marker.exists():
            return begin(self, rejoin)
        marker.touch()
        if WHERE.startswith("begin-on:"):
            fail(f"FileNotFoundError: [Errno 2] No such file or directory: '/data/{os.environ['LIVE_NODE']}/shard-0'")
        fail(f"RuntimeError: injected failure of rank {self.rank} before epoch 0's group")

    LiveWorker.begin = fail_at_begin

if WHERE == "resumed":
    resume = trainguard.Guard.resume

    def fail_after_resume(self):
        resume(self)
        fail(f"RuntimeError: injected failure of rank {self.rank} after resume, before the first step")

    trainguard.Guard.resume = fail_after_resume

if __name__ == "__main__":
    live_loop.rank_main(sys.argv[1:])
