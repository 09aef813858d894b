"""Live recovery (issue 23): 4 gloo ranks in 2 replica groups x 2, one SIGKILLed mid-run; the others
keep their processes, the replacement rejoins, and the end state is bitwise the fault-free run's."""

from __future__ import annotations

import pytest

from trainguard.events.log import read_events
from trainguard.live.compare import bitwise_differences, load_final
from trainguard.live.files import events_path, final_path
from trainguard.live.launcher import LiveRun, launch
from trainguard.live.samples import sample_problems
from trainguard.live.workload import Workload
from trainguard.report import write_report

RUN = LiveRun(groups=2, group_size=2, steps=40, micro_batch_s=0.02)
KILLED = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    clean = launch(root / "clean", RUN)
    failed = launch(root / "failed", LiveRun(**{**RUN.__dict__, "kill_rank": KILLED, "kill_at_step": 10}))
    return root, clean, failed


def _events(run_dir):
    return list(read_events(events_path(run_dir)))


def test_survivors_keep_their_processes_and_the_replacement_is_new(runs):
    _, _, failed = runs
    assert failed.killed_at is not None
    for rank in range(RUN.world):
        if rank == KILLED:
            assert failed.last_pids[rank] != failed.first_pids[rank]
        else:
            assert failed.last_pids[rank] == failed.first_pids[rank]
    assert set(failed.exit_codes.values()) == {0}


def test_quorum_shrinks_to_the_intact_group_then_the_broken_group_rejoins(runs):
    root, _, _ = runs
    events = _events(root / "failed")
    quorums = [e for e in events if e["kind"] == "live_quorum"]
    assert [q["members"] for q in quorums] == [[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]]
    assert quorums[1]["left"] == [2, 3] and quorums[2]["joining"] == [2, 3]
    joined = {e["rank"]: e for e in events if e["kind"] == "live_joined"}
    assert sorted(joined) == [2, 3] and {e["epoch"] for e in joined.values()} == {2}
    # the survivors stepped on their own, computing the missing group's micro-batches
    degraded = [e for e in events if e["kind"] == "live_step" and e["members"] == 2]
    assert degraded and {e["rank"] for e in degraded} == {0, 1}
    assert all(len(e["samples"]) == Workload().micro_batches // 2 for e in degraded)


def test_final_parameters_and_optimizer_state_are_bitwise_the_fault_free_ones(runs):
    root, _, _ = runs
    reference = load_final(final_path(root / "clean", 0))
    for rank in range(RUN.world):
        assert bitwise_differences(load_final(final_path(root / "clean", rank)), reference) == []
        assert bitwise_differences(load_final(final_path(root / "failed", rank)), reference) == [], rank
    assert reference["optimizer"]["state"][0]["step"].item() == RUN.steps


def test_no_sample_lost_or_repeated(runs):
    root, _, _ = runs
    per_step = Workload().samples_per_step
    for name in ("clean", "failed"):
        assert sample_problems(_events(root / name), RUN.steps, per_step) == [], name


def test_the_sample_check_sees_a_lost_and_a_repeated_micro_batch(runs):
    root, _, _ = runs
    events = [e for e in _events(root / "failed") if e["kind"] == "live_step"]
    per_step = Workload().samples_per_step
    lost = [e for e in events if not (e["step"] == 12 and e["rank"] == 0)]
    assert any("lost" in p for p in sample_problems(lost, RUN.steps, per_step))
    repeated = events + [next(e for e in events if e["step"] == 12)]
    assert any("repeated" in p for p in sample_problems(repeated, RUN.steps, per_step))


def test_the_report_shows_the_quorum_changes_and_their_costs(runs):
    root, _, _ = runs
    path, facts = write_report(root / "failed", root / "report.html")
    shrink, join = facts.quorum_changes[1:]
    assert shrink.left == [2, 3] and shrink.step == 10 and shrink.survivors_lost_s is not None
    assert join.joining == [2, 3] and join.step is not None and join.step > 10
    assert join.rejoin_s is not None and join.rejoin_s > 0
    page = path.read_text()
    assert "Live recovery: quorum changes" in page and "replica group 1 rejoins" in page
