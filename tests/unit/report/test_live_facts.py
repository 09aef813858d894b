"""What ``report`` and ``status`` read from a live-recovery run's events (issue 35's defects): the
survivors' lost time of a shrink is how long they went without a step, not the ``stalled_s`` of their
``live_resumed`` (which starts when a rank learns of the failure, after it was already waiting); and a
live run that every rank finished is "finished", with its last step shown. The events are written here
as the ranks and the launcher write them (``events.jsonl``, one JSON object a line)."""

from __future__ import annotations

import json

import pytest

from trainguard.report import read_run
from trainguard.report.summary import status_rows

T0 = 1_800_000_000.0


def _event(t: float, kind: str, rank: int, **fields) -> dict:
    return {"time": T0 + t, "kind": kind, "rank": rank, "host": "vm", **fields}


def _live_run(steps: int = 6) -> list[dict]:
    """2 replica groups of 1 rank; rank 1 dies after step 2 (0-based) and rejoins at step 4. Rank 0's steps
    take 0.1 s; it commits step 2 at 0.3 s and step 3 at 2.0 s: 1.7 s without a step, of which its
    ``live_resumed`` counts 0.44 s."""
    events = [_event(0.0, "live_quorum", -1, step=0, epoch=0, members=[0, 1], joining=[], left=[], reason="start")]
    for step in range(3):
        events += [_event(0.1 * (step + 1), "live_step", rank, step=step, epoch=0, members=2, micro_batches=[rank])
                   for rank in (0, 1)]
    events += [
        _event(1.2, "live_quorum", -1, step=3, epoch=1, members=[0], joining=[], left=[1], reason="ranks [1] died"),
        _event(1.6, "live_resumed", 0, step=3, epoch=1, stalled_s=0.44),
        _event(2.0, "live_step", 0, step=3, epoch=1, members=1, micro_batches=[0, 1]),
        _event(2.5, "live_quorum", -1, step=None, epoch=2, members=[0, 1], joining=[1], left=[], reason="rejoin"),
        _event(2.6, "live_switch", 0, step=4, epoch=2, state_bytes=100, paused_s=0.05),
        _event(2.6, "live_joined", 1, step=4, epoch=2, state_bytes=100, waited_s=1.0),
    ]
    for step in range(4, steps):
        events += [_event(2.6 + 0.1 * (step - 3), "live_step", rank, step=step, epoch=2, members=2,
                          micro_batches=[rank]) for rank in (0, 1)]
    return events


def _write(run_dir, events):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_the_survivors_lost_time_is_their_time_without_a_step(tmp_path):
    _write(tmp_path, _live_run())
    shrink, join = read_run(tmp_path, now=T0 + 10).quorum_changes[1:]
    assert shrink.left == [1] and shrink.survivors_lost_s == pytest.approx(1.7)
    assert join.survivors_lost_s == pytest.approx(0.05)  # a join: the survivors' pause for the transfer


def test_a_finished_live_run_is_finished_at_its_last_step(tmp_path):
    done = [_event(3.0, "live_done", rank, step=6, epoch=2) for rank in (0, 1)]
    _write(tmp_path, _live_run() + done)
    facts = read_run(tmp_path, now=T0 + 3600)  # an hour later: not live any more
    rows = dict(status_rows(facts))
    assert (rows["state"], rows["step"]) == ("finished", "6")


def test_a_live_run_one_rank_did_not_finish_is_not_finished(tmp_path):
    _write(tmp_path, _live_run() + [_event(3.0, "live_done", 0, step=6, epoch=2)])
    rows = dict(status_rows(read_run(tmp_path, now=T0 + 3600)))
    assert rows["state"].startswith("stopped") and rows["step"] == "6"
