"""The drill's table says how each fault was detected: a SIGKILLed rank is named with its signal, not with
the exit code of its incarnation (the agents' 1), which the table once printed as "rank 3 died (exit 1)"."""

from __future__ import annotations

from trainguard.demo.drill import judge_outcomes, plan

# the events of `trainguard demo --quick`'s SIGKILL of rank 3 at step 8, as its supervisor wrote them
KILL_EVENTS = [
    {"time": 10.0, "kind": "fault_injected", "step": 8, "rank": 3, "fault": "kill", "fault_index": 2,
     "spec": "kill:rank=3,step=8", "action": "SIGKILL"},
    {"time": 11.0, "kind": "restart", "step": 7, "rank": -1, "incarnation": 1, "reason": "failed", "exit_code": 1,
     "failing_rank": 3, "failing_node": "node1", "detail": "rank 3 on node1 failed (signal SIGKILL)",
     "backoff": 0.5, "restarts": 1},
    {"time": 17.0, "kind": "recovered", "step": 6, "rank": -1, "incarnation": 1, "reason": "failed",
     "failing_rank": 3, "failing_node": "node1", "steps_redone": 1, "seconds": 6.6},
]


def test_a_killed_rank_is_reported_with_its_signal_not_its_incarnations_exit_code():
    quick = plan(quick=True)
    killed = [o for o in judge_outcomes(quick, KILL_EVENTS, final_step=15) if o.fault.spec.startswith("kill:")]
    assert len(killed) == 1
    assert killed[0].ok and killed[0].step == 8
    assert killed[0].detected == "rank 3 on node1 failed (signal SIGKILL)"
    assert "exit 1" not in killed[0].detected
