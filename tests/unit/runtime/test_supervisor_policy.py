"""The supervisor's pure decisions: classification from exit records, hang suspects, restart policy."""

from __future__ import annotations

import subprocess
import sys

from trainguard.runtime.hang import suspect_ranks
from trainguard.runtime.heartbeat import Heartbeat
from trainguard.runtime.policy import (
    NEVER_RESTART,
    Action,
    Ended,
    Exclusion,
    ExclusionReason,
    Outcome,
    RestartPolicy,
    backoff_seconds,
    classify,
    first_rank_with,
    outcome_of,
    stop_explanation,
)


def beat(rank: int, phase: str, step: int, node: str = "n0", exit_code: int | None = None) -> Heartbeat:
    return Heartbeat(rank=rank, node=node, pid=1000 + rank, incarnation=0, phase=phase, step=step, time=float(rank),
                     longest_gap=0.0, started=0.0, exit_code=exit_code, marks={})


def test_classify_prefers_meaningful_codes():
    assert classify([0, 0], {}) == 0
    assert classify([-9, 1], {}) == 1
    assert classify([1, 17], {}) == 17
    assert classify([16, 0], {}) == 16


def test_classify_reads_the_ranks_exit_records_through_a_launcher_that_flattens_codes():
    # torchrun turns every rank's code into 1; an agent killed by SIGTERM after its ranks saved gives -15
    assert classify([1], {0: 3, 1: 3}) == 3
    assert classify([1], {0: 16, 1: 16}) == 16
    assert classify([-15], {0: 16, 1: 16}) == 16
    assert classify([1, 0], {2: 17, 0: 1}) == 17
    assert classify([1], {0: 1}) == 1
    assert classify([0], {0: 16}) == 0  # every agent succeeded: nothing to explain


def test_outcomes_are_typed_and_a_stop_is_not_a_failure():
    assert outcome_of(0) is Outcome.FINISHED
    assert outcome_of(16) is Outcome.STOPPED
    assert outcome_of(3) is Outcome.FAILED and outcome_of(1) is Outcome.FAILED


def test_the_failing_rank_is_the_first_to_record_the_code():
    assert first_rank_with(17, {0: 1, 1: 17, 2: 17}, {1: 5.0, 2: 4.0}) == 2
    assert first_rank_with(3, {0: 1}, {0: 1.0}) is None


def test_hang_suspect_from_heartbeats_behind_or_in_a_local_phase():
    assert suspect_ranks({0: beat(0, "step", 5), 1: beat(1, "step", 4), 2: beat(2, "step", 5)}, {}) == [1]
    assert suspect_ranks({0: beat(0, "step", 5), 1: beat(1, "save", 5)}, {}) == [1]
    assert suspect_ranks({0: beat(0, "save", 5), 1: beat(1, "save", 5)}, {}) == []


def test_level_heartbeats_fall_back_to_the_dumps_of_any_script():
    def dump(top: str) -> str:
        return f"Thread 0x1 (most recent call first):\n  File \"{top}\", line 1 in f\n  File \"/u/my_loop.py\", line 9 in main\n"

    beats = {rank: beat(rank, "step", 5) for rank in range(3)}
    dumps = {0: dump("/x/torch/distributed/distributed_c10d.py"), 1: dump("/u/my_loop.py"),
             2: dump("/x/torch/distributed/distributed_c10d.py")}
    assert suspect_ranks(beats, dumps) == [1]
    assert suspect_ranks(beats, {0: dumps[0], 2: dumps[2]}) == []


def test_backoff_doubles_without_progress_and_is_capped():
    assert [backoff_seconds(1.0, 5.0, n) for n in (0, 1, 2, 3, 4)] == [1.0, 1.0, 2.0, 4.0, 5.0]


def policy(**kw) -> RestartPolicy:
    return RestartPolicy(**{"max_restarts": 3, "crash_loop": 2, "backoff": 1.0, "backoff_max": 8.0,
                            "node_failures": 2, "several_nodes": True, **kw})


def test_never_restarted_codes_and_a_requested_stop_finish_the_run():
    for code, outcome in ((0, Outcome.FINISHED), (3, Outcome.FAILED), (4, Outcome.FAILED), (16, Outcome.STOPPED)):
        decision = policy().observe(Ended(outcome, code, 5), stop_requested=False)
        assert decision.action is Action.FINISH and decision.exit_code == code
    assert policy().observe(Ended(Outcome.FAILED, 1, 5), stop_requested=True).action is Action.FINISH


def test_crash_loop_and_restart_budget():
    p = policy()
    assert p.observe(Ended(Outcome.FAILED, 1, 4), False) is None
    first = p.next_attempt(Ended(Outcome.FAILED, 1, 4))
    assert first.action is Action.RESTART and first.delay == 1.0
    assert p.observe(Ended(Outcome.FAILED, 1, 4), False) is None  # no new step
    second = p.next_attempt(Ended(Outcome.FAILED, 1, 4))
    assert second.action is Action.RESTART and second.delay == 1.0
    assert p.observe(Ended(Outcome.FAILED, 1, 4), False) is None
    gave_up = p.next_attempt(Ended(Outcome.FAILED, 1, 4))
    assert gave_up.action is Action.GIVE_UP and "crash loop" in gave_up.reason
    budget = policy(max_restarts=0)
    budget.observe(Ended(Outcome.FAILED, 1, 4), False)
    assert "--max-restarts 0" in budget.next_attempt(Ended(Outcome.FAILED, 1, 4)).reason


def test_node_exclusion_rules():
    p = policy()
    faulty = Ended(Outcome.FAILED, 17, 3, failing_rank=1, failing_node="n1")
    # issue 38 item 11: the event's reason says why the node went, not the incarnation's outcome ("failed")
    assert p.node_to_exclude(faulty, ["n0", "n1"]) == Exclusion("n1", ExclusionReason.FAULTY_HARDWARE)
    assert p.node_to_exclude(faulty, ["n0", "n2"]) is None  # not holding a slot any more
    killed = Ended(Outcome.FAILED, 1, 3, failing_rank=0, failing_node="n0")
    assert p.node_to_exclude(killed, ["n0", "n1"]) is None
    # node_failures=2
    assert p.node_to_exclude(killed, ["n0", "n1"]) == Exclusion("n0", ExclusionReason.REPEATED_FAILURES)
    assert policy(several_nodes=False).node_to_exclude(killed, ["n0"]) is None
    lost = Ended(Outcome.NODE_LOST, 1, 3, failing_node="n1")
    assert p.node_to_exclude(lost, ["n0", "n1"]) == Exclusion("n1", ExclusionReason.NODE_LOST)
    assert [reason.value for reason in ExclusionReason] == ["faulty_hardware", "node_lost", "repeated_failures"]


def test_the_supervisors_exit_path_imports_no_torch():
    code = ("import sys; from trainguard.runtime import supervisor; from trainguard.runtime.policy import classify;"
            "classify([1], {0: 16}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_exit_records_and_an_array_already_finished(tmp_path):
    from trainguard.events import EventLog
    from trainguard.runtime.supervisor import finished_in_array, rank_exit_records

    exits, times = rank_exit_records({0: beat(0, "exit", 4, exit_code=16), 1: beat(1, "step", 4)})
    assert exits == {0: 16} and times == {0: 0.0}
    assert not finished_in_array(tmp_path, "7")
    log = EventLog(tmp_path / "events.jsonl", rank=-1, host="h")
    log.emit("supervisor_finished", exit_code=16, array_job="7")
    log.emit("supervisor_finished", exit_code=0, array_job="6")
    log.close()
    assert not finished_in_array(tmp_path, "7")  # stopped, or finished by another array
    log = EventLog(tmp_path / "events.jsonl", rank=-1, host="h")
    log.emit("supervisor_finished", exit_code=0, array_job="7")
    log.close()
    assert finished_in_array(tmp_path, "7")


def test_a_code_never_restarted_is_explained_in_one_line():
    """Issue 38 items 7 and 11: the supervisor says why it stops and why it does not restart."""
    usage = stop_explanation(2, 0, "rank 0 on node0 exited 2 (its exit record)", None)
    assert usage == ("stopped at step 0: exit 2, a configuration or usage error; rank 0 on node0 exited 2 (its exit "
                     "record); not restarted: a restart would fail the same way; fix it and run the command again")
    assert "guards.max_consecutive_skips" in stop_explanation(3, 5, None, None)  # exit 3 is any skip streak's
    assert all(stop_explanation(code, 1, None, None) for code in NEVER_RESTART if code != 0)  # each explained
    assert stop_explanation(16, 7, None, "SIGTERM").startswith("stopped at step 7: exit 16, received SIGTERM")
    assert "time limit" in stop_explanation(16, 7, None, None) and "\n" not in stop_explanation(16, 7, None, None)
    assert [stop_explanation(code, 3, None, None) for code in (0, 1, 17)] == [None, None, None]  # finished, restarted
