"""The live launcher's supervision (``live.supervise``) with a stand-in for ``launch``, in a fresh
one-thread interpreter (a process with threads runs the launcher unsupervised, and a stand-in that
kills itself would kill the test): a launcher that dies is started again at most ``RESTARTS`` times,
each restart an event and a line; a result or an error of the launcher comes back to the caller; the
time limit's start is the first launch's; the caller is no subreaper afterwards. The real launcher
killed mid-run: tests/integration/test_live_durable.py and test_live_netns.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from trainguard.live.supervise import RESTARTS

SCRIPT = textwrap.dedent("""
    import ctypes, json, os, signal, sys, threading, time
    from pathlib import Path
    import trainguard.live.supervise as supervise
    from trainguard.errors import ConfigError
    from trainguard.live.launcher import LiveRun

    run_dir, mode = Path(sys.argv[1]), sys.argv[2]
    starts = run_dir / "starts"

    def launch(run_dir, run):
        with open(starts, "a") as f:
            f.write(dict(run.rank_env)["TRAINGUARD_JOB_START"] + " " + run.resume + "\\n")
        if mode == "dies" or (mode == "dies-once" and len(starts.read_text().splitlines()) == 1):
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raises":
            raise ConfigError("config key 'x': bad")
        return "result"

    supervise.launch = launch
    if mode.endswith("-after-a-thread"):  # a thread still ending when supervise() starts (a pool just joined)
        threading.Thread(target=time.sleep, args=(0.2,)).start()
        mode = mode.removesuffix("-after-a-thread")
    try:
        outcome = supervise.supervise(run_dir, LiveRun(resume="disable"))
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    flag = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    print(json.dumps({"outcome": outcome, "subreaper": flag.value}))
""")


def _supervise(tmp_path, mode: str) -> tuple[dict, list[list[str]], str]:
    tmp_path.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    starts = [line.split() for line in (tmp_path / "starts").read_text().splitlines()]
    return json.loads(lines[-1]), starts, done.stdout


def test_a_launcher_that_dies_is_started_again_from_the_newest_checkpoint_at_most_restarts_times(tmp_path):
    result, starts, output = _supervise(tmp_path, "dies")
    assert result == {"outcome": f"RuntimeError: the live launcher died {RESTARTS + 1} times (exit -9); the newest "
                                 "durable checkpoint stays the resume point (--resume auto)", "subreaper": 0}
    assert len(starts) == RESTARTS + 1 and len({start for start, _ in starts}) == 1  # one job start for all
    assert [resume for _, resume in starts] == ["disable"] + ["auto"] * RESTARTS
    assert output.count("trainguard: the live launcher (store, lighthouse) died (exit -9)") == RESTARTS
    lost = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["exit_code"], e["resume"]) for e in lost] == [("live_launcher_lost", -9, None)] * RESTARTS


def test_the_launchers_result_or_error_comes_back_after_a_restart_or_none(tmp_path):
    assert _supervise(tmp_path / "a", "dies-once")[0] == {"outcome": "result", "subreaper": 0}
    assert _supervise(tmp_path / "b", "returns")[0] == {"outcome": "result", "subreaper": 0}
    assert _supervise(tmp_path / "c", "raises")[0] == {"outcome": "ConfigError: config key 'x': bad", "subreaper": 0}


def test_a_thread_still_ending_when_the_launcher_starts_does_not_leave_it_unsupervised(tmp_path):
    """A job resumed from a checkpoint: its verification has just joined its pool's threads, which the OS
    ends a moment later (before: the launcher ran unsupervised about once in three starts, and its death
    ended the job; here its death, deterministic, killed the test's process: exit -9)."""
    result, starts, output = _supervise(tmp_path, "dies-once-after-a-thread")
    assert result == {"outcome": "result", "subreaper": 0} and len(starts) == 2, output
    assert "unsupervised" not in output
