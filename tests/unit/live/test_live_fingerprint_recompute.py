"""``live/fingerprint.LiveFingerprints``' recompute decision on a real one-rank gloo group: a rank with no
replica whose state changed at rest since its own update (nothing can repair it) asks for a recompute, as
the closure mode's state check does; once the worker went back for it (``recomputing_from``) the same
mismatch found again at the check step the recompute reached is left as it is (no second recompute, the
closure mode's rule), and a later one asks again; with no healthy checkpoint the closure mode's line is
written and nothing is recomputed. The digests of the durable saves that ``restored_agrees`` compares a
restore with are kept for the checkpoints a restore can still load, with a real ``LiveCheckpoints``."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.events.log import EventLog, read_events
from trainguard.guards.fingerprint import FingerprintConfig
from trainguard.live.fingerprint import LiveFingerprints
from trainguard.live.quorum import Quorum

STEP = 4  # the check before it is due (interval 2)


@pytest.fixture
def alone(tmp_path):
    """A model and its Adam state, the fingerprints of its only rank, the quorum, its one-rank gloo group."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    group = dist.ProcessGroupGloo(dist.PrefixStore("fp", dist.HashStore()), 0, 1, timedelta(seconds=20))
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    # no replica: no state is ever repaired from one (``state``, what a repair loads, is not needed)
    fingerprints = LiveFingerprints(FingerprintConfig(interval=2), model, optimizer, None, 0, 1,
                                    logging.getLogger("test_live_fingerprint_recompute"), events, lambda: True)
    return fingerprints, model, Quorum(epoch=0, members=[0], start_step=0, reason="test"), group, tmp_path


def _flip_then_check(fingerprints: LiveFingerprints, model: torch.nn.Module, quorum: Quorum,
                     group: dist.ProcessGroup) -> bool:
    """The state hashed after an update, a bit flipped at rest, the check before ``STEP``: its recompute."""
    fingerprints.remember(STEP)
    with torch.no_grad():
        model.weight.view(torch.int32)[0, 0] ^= 1 << 20
    verdict = fingerprints.check(group, quorum, STEP, lambda work: work.wait())
    assert [(m.faulty, m.source, m.how) for m in verdict.mismatches] == [((0,), None, "at_rest")]
    return fingerprints.recompute


def test_what_no_replica_repairs_is_recomputed_once_at_a_check_step(alone, caplog):
    fingerprints, model, quorum, group, run_dir = alone
    assert _flip_then_check(fingerprints, model, quorum, group)
    with caplog.at_level(logging.WARNING):
        fingerprints.recomputing_from(STEP, 2)
    assert f"fingerprint mismatch at step {STEP} that no replica can repair: recomputing from global_step_2, " \
           "the last agreeing state" in caplog.text
    assert [(e["step"], e["to_step"]) for e in read_events(run_dir / "events.jsonl")
            if e["kind"] == "fingerprint_recompute"] == [(STEP, 2)]
    assert not fingerprints.recompute
    assert not _flip_then_check(fingerprints, model, quorum, group)  # found again where the recompute went back to
    assert _flip_then_check(fingerprints, model, quorum, group)  # a new one, later: recomputed again


def test_with_no_healthy_checkpoint_the_mismatch_stays_and_is_said(alone, caplog):
    fingerprints, model, quorum, group, run_dir = alone
    assert _flip_then_check(fingerprints, model, quorum, group)
    with caplog.at_level(logging.ERROR):
        fingerprints.recomputing_from(STEP, None)
    assert f"fingerprint mismatch at step {STEP}: no healthy checkpoint to recompute from; the mismatch stays " \
           "unattributed and the next save is marked unhealthy" in caplog.text
    assert not [e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "fingerprint_recompute"]
    assert _flip_then_check(fingerprints, model, quorum, group)  # nothing went back: the next check asks again


def test_the_saves_digests_are_kept_for_the_checkpoints_a_restore_can_still_load(alone, make_checkpoints):
    """Retention (``checkpoint.keep_last``, 3) deletes the oldest save and a roll back the newer ones: their
    digests go with them, the restored one's stays and agrees."""
    _, _, quorum, group, run_dir = alone
    model = torch.nn.Linear(2, 1)
    # with a state to save (momentum): plain SGD's empty one fails a second save (checkpoint/state_capture.py)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    checkpoints = make_checkpoints(model, optimizer)
    fingerprints = LiveFingerprints(FingerprintConfig(interval=2), model, optimizer, None, 0, 1,
                                    logging.getLogger("test_live_fingerprint_recompute"), EventLog(None), lambda: True)
    wait = lambda work: work.wait()  # noqa: E731
    for step in (5, 10, 15, 20):
        with torch.no_grad():
            model.weight.add_(1.0)  # each save holds another state
        fingerprints.before_save(group, quorum, step, wait, None)
        assert checkpoints.save(quorum, step, last_step=False, stopping=False)
        fingerprints.keep_saved(checkpoints.restorable())
    checkpoints.settle(quorum)  # the last save, async, committed: retention has deleted global_step_5
    on_disk = sorted(info.step for info in list_checkpoints(run_dir / "checkpoints") if info.committed)
    assert on_disk == [10, 15, 20]
    fingerprints.keep_saved(checkpoints.restorable())
    assert sorted(fingerprints.saved) == on_disk
    assert checkpoints.roll_back(Quorum(1, [0], 0, "restore"), 16) == 15  # global_step_20 deleted
    fingerprints.keep_saved(checkpoints.restorable())
    assert sorted(fingerprints.saved) == [10, 15]
    assert fingerprints.restored_agrees(group, quorum, 15, wait)
