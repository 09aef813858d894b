"""A live run whose ranks fail before its first step ends at once, never hangs (issue 35, items 4 and 5).

``trainguard run`` of ``tests/helpers/live_loop.py`` (2 replica groups x 1, 4 steps) through
``helpers/live_early_exit.py``, which makes its ranks fail where ``LIVE_EARLY_EXIT`` says. When every rank
ends before the run's first step, a replacement would fail the same way: the launcher ends the run, exit 1,
with one line naming each rank, its exit code (or signal), its node and its last line of standard error
where it relays it (``live/start_failure.py``), instead of replacing ranks until
``LiveRun.max_replacements``. A rank's exit 0 is the run's end only once it wrote its final state or the
quorum recorded its stop; so is its exit 3, 16 or 19 (the quorum's abort, stop, failed step) only once the quorum
recorded it. Before the fix:

- every rank dying after the store was reached (on two loopback "hosts" behind an ``sh`` wrapper standing in
  for ssh) or SIGKILLed at import ended with the lighthouse's ``no replica group is left intact after ranks
  [0, 1] died``, naming neither the codes, nor the nodes, nor the errors;
- every rank exiting 0 before its first step was reported as ``live run finished: 4 steps``, exit 0; so was
  every rank exiting 16 (a stop's code), and every rank exiting 3 as ``live run aborted by the data-skip guard``;
- one rank exiting 0 before epoch 0's group was built was never replaced: its peer waited for it, then for
  ever for a replacement to rejoin (the run sat until its timeout, SIGTERM unanswered);
- one rank stopped at import, before it ever beat, was never judged hung (only a rank that had beaten was):
  its peer waited for its report for ever. Now it is hung after ``LiveRun.startup_s`` (600 s, restart mode's
  ``--startup-timeout``; 10 s here), killed and replaced;
- one rank failing the same way at every start while the other trains (a file missing on its node) was
  replaced on that node until ``max_replacements`` (16), then the run ended, exit 1. Now after
  ``fault_tolerance.max_start_failures`` (3) failed starts in a row it moves to a spare node (its node lost,
  reason ``start_failed``) and trains there; with no spare node left it is given up and the run finishes
  without it (one line, ``live_rank_given_up``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import trainguard, worker_env
from trainguard.events.log import read_events
from trainguard.live.files import events_path
from trainguard.live.launcher import LiveRun, launch
from trainguard.live.samples import sample_problems

ROOT = Path(__file__).resolve().parents[2]
RANK = ROOT / "tests" / "helpers" / "live_early_exit.py"
STEPS = 4
CONFIG = f"parallel: {{dp_replicate: 2}}\ntrain: {{steps: {STEPS}, micro_batches: 2}}\nfault_tolerance: {{live: true}}\n"
# ssh's stand-in on loopback "hosts": runs the command it is given, as ssh does on the node
SH_NODE = "sh -c 'exec \"$@\"' {node}"
# ... telling the rank its node's name (LIVE_NODE), for a failure on one node
SH_NODE_NAMED = "sh -c 'export LIVE_NODE=$0; exec \"$@\"' {node}"
LINE = "trainguard: error: live run: every rank ended before the first step (a failure at start, not retried): "


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("live_start") / "live.yaml"
    path.write_text(CONFIG)
    return path


def _run(config: Path, run_dir: Path, where: str, code: int = 1, *options: str):
    return trainguard("run", *options, "--nproc", "2", "--config", str(config), "--run-dir", str(run_dir), "--",
                      sys.executable, str(RANK), "--config", str(config),
                      env=worker_env(LIVE_EARLY_EXIT=where, LIVE_EARLY_EXIT_CODE=str(code)), timeout=150)


def _one_error(done) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert len(errors) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    return errors[0]


def _replacements(run_dir: Path) -> list[int]:
    return [e["target"] for e in read_events(events_path(run_dir)) if e["kind"] == "live_replacement"]


def test_every_rank_dead_after_resume_on_hosts_ends_naming_ranks_codes_nodes_and_their_last_error(config, tmp_path):
    run_dir = tmp_path / "hosts"
    done = _run(config, run_dir, "resumed", 1, "--launcher", "hosts", "--hosts", "a=127.0.0.1,b=127.0.0.2",
                "--node-command", SH_NODE)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert _one_error(done) == LINE + "; ".join(
        f"rank {rank} exited 1 on node {node}: RuntimeError: injected failure of rank {rank} after resume, before "
        "the first step" for rank, node in ((0, "a"), (1, "b")))
    events = list(read_events(events_path(run_dir)))
    [failed] = [e for e in events if e["kind"] == "live_start_failed"]
    assert [(e["rank"], e["code"], e["node"]) for e in failed["exits"]] == [(0, 1, "a"), (1, 1, "b")]
    assert not [e for e in events if e["kind"] == "live_step"]


def test_every_rank_sigkilled_before_the_store_ends_at_once_naming_the_signal(config, tmp_path):
    done = _run(config, tmp_path / "killed", "sigkill")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert _one_error(done) == LINE + "rank 0 was killed by SIGKILL; rank 1 was killed by SIGKILL"


@pytest.mark.parametrize("code", [0, 3, 16])
def test_every_rank_exiting_0_3_or_16_before_the_first_step_is_a_failure_not_the_runs_end(config, tmp_path, code):
    """And the codes of the quorum's other agreed ends (3: a data-skip abort, 16: a stop), which a script can
    exit with of its own: the run's failure at start, not "aborted by the data-skip guard" or "finished"."""
    done = _run(config, tmp_path / "early", "import", code)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "live run finished" not in done.stdout and "aborted" not in done.stdout
    assert _one_error(done) == LINE + f"rank 0 exited {code}; rank 1 exited {code}"


@pytest.mark.parametrize("code", [0, 16])
def test_a_rank_exiting_0_or_16_before_epoch_0_is_replaced_and_the_run_finishes(config, tmp_path, code):
    run_dir = tmp_path / "early_once"
    done = _run(config, run_dir, "begin-once:1", code)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"live run finished: {STEPS} steps in " in done.stdout and "ranks replaced: [1]" in done.stdout
    assert _replacements(run_dir) == [1]


def test_a_rank_stopped_before_it_ever_beats_is_hung_after_the_startup_bound_and_replaced(config, tmp_path, monkeypatch):
    monkeypatch.setenv("LIVE_EARLY_EXIT", "stop-once:1")
    run = LiveRun(groups=2, group_size=1, steps=STEPS, micro_batches=2, micro_batch_s=0.0, checkpoint_every=0,
                  startup_s=10.0, timeout_s=120.0, entry=(str(RANK), "--config", str(config)))
    result = launch(tmp_path / "stopped", run)
    assert sorted(result.replaced_at) == [1] and result.exit_codes == {0: 0, 1: 0}, dataclasses.asdict(result)
    events = list(read_events(events_path(tmp_path / "stopped")))
    assert [e["target"] for e in events if e["kind"] == "live_hung"] == [1]
    assert [(e["target"], e["code"]) for e in events if e["kind"] == "live_exit"] == [(1, -9)]


def test_a_rank_failing_at_every_start_on_its_node_moves_to_the_spare_node_at_the_limit_and_trains(config, tmp_path):
    run_dir = tmp_path / "moved"
    # the limit at 2 (3 by default): one cold start less on the loaded machine
    done = _run(config, run_dir, "begin-on:b", 1, "--launcher", "hosts", "--hosts",
                "a=127.0.0.1,b=127.0.0.2,c=127.0.0.3", "--node-command", SH_NODE_NAMED,
                "--set", "fault_tolerance.max_start_failures=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"live run finished: {STEPS} steps in " in done.stdout and "ranks replaced: [1]" in done.stdout
    events = list(read_events(events_path(run_dir)))
    # its first start and its replacement failed on b, the next replacement trained on the spare node c
    assert [(e["target"], e["node"]) for e in events if e["kind"] == "live_replacement"] == [(1, "b"), (1, "c")]
    assert [(e["node"], e["reason"], e["target"], e["failures"]) for e in events if e["kind"] == "live_node_lost"] == [
        ("b", "start_failed", 1, 2)]
    assert [e["code"] for e in events if e["kind"] == "live_exit"] == [1, 1]
    assert sample_problems(events, STEPS, 2 * 8) == []


def test_a_rank_failing_at_every_start_is_given_up_after_3_and_the_run_finishes_without_it(config, tmp_path):
    run_dir = tmp_path / "given_up"
    done = _run(config, run_dir, "begin:1", 1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (f"live run finished: {STEPS} steps in " in done.stdout
            and "ranks replaced: [1], ranks given up: [1]" in done.stdout), done.stdout[-3000:]
    [line] = [line for line in done.stderr.splitlines() if "not started again" in line]
    assert line == ("trainguard: live run: rank 1 failed at start 3 times in a row (fault_tolerance.max_start_failures), "
                    "last: rank 1 exited 1; not started again: the run goes on without its replica group until its "
                    "next start")
    events = list(read_events(events_path(run_dir)))
    assert _replacements(run_dir) == [1, 1]
    [given_up] = [e for e in events if e["kind"] == "live_rank_given_up"]
    assert (given_up["target"], given_up["code"], given_up["failures"]) == (1, 1, 3)
    assert sample_problems(events, STEPS, 2 * 8) == []


# a rank script that says whether it was forked from the launcher's warm rank server (torch already imported)
# and which OPENBLAS_NUM_THREADS it sees, then fails at start
WARM_PROBE = """import os, sys
print(f"rank probe: torch {'torch' in sys.modules}, OPENBLAS_NUM_THREADS {os.environ.get('OPENBLAS_NUM_THREADS')}",
      file=sys.stderr, flush=True)
raise SystemExit(1)
"""


def test_a_start_from_a_plain_shell_supervises_the_launcher_and_forks_the_ranks_warm(config, tmp_path):
    """``trainguard run`` started cold as a user does, ``OMP_NUM_THREADS`` unset: numpy's OpenBLAS pool (a
    thread per core but one, started at numpy's import under torch) left the command with threads, so the live
    launcher ran unsupervised ("runs unsupervised" warning: its death ended the run) and every rank started as
    a new interpreter. The suite's own runs never saw it: they set OMP_NUM_THREADS=1. The ranks still see the
    user's environment."""
    probe = tmp_path / "probe.py"
    probe.write_text(WARM_PROBE)
    env = {key: value for key, value in worker_env().items() if key not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-m", "trainguard", "run", "--nproc", "2", "--config", str(config),
                           "--run-dir", str(tmp_path / "run"), "--", sys.executable, str(probe)],
                          env=env, capture_output=True, text=True, timeout=150, start_new_session=True)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "runs unsupervised" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("rank probe: torch True, OPENBLAS_NUM_THREADS None") == 2, done.stderr[-3000:]
    assert _one_error(done) == LINE + "rank 0 exited 1; rank 1 exited 1"
