"""A live restore's checkpoint that will not load (``live/load_failures.py``): counted, passed over after
``max_load_failures`` failed loads for the next older healthy checkpoint, and with none left ``NothingToRestore``
(exit 19) naming each checkpoint and its error, every checkpoint left on disk as it was.

Real files, a real store and gloo group of one rank, real loads that fail: a checkpoint written by a model of another
shape (DCP refuses the load, as it would a checkpoint of an incompatible model). Each restore runs in an epoch
of its own, as a failed restore ends its epoch in a live run.

Without ``CheckpointManager.roll_back`` loading before it deletes the newer checkpoints, the run with no
checkpoint that loads deletes ``global_step_10`` when it tries ``global_step_5`` (checked once by hand).
"""

from __future__ import annotations

import collections

import pytest
import torch

from trainguard.checkpoint.discovery import list_checkpoints
from trainguard.errors import EXIT_STEP_FAILED, RestoreFailed
from trainguard.events.log import EventLog, read_events
from trainguard.live.load_failures import LoadFailures, NothingToRestore, count_key
from trainguard.live.quorum import Quorum


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(width)
    return torch.nn.Linear(width, 1)


def _steps(root) -> list[int]:
    return [info.step for info in list_checkpoints(root / "checkpoints") if info.committed]


@pytest.fixture
def saved(make_checkpoints, tmp_path):
    """``global_step_5`` of a model of width 2 and ``global_step_10`` of one of width 3, in two epochs."""
    for epoch, (width, step) in enumerate([(2, 5), (3, 10)]):
        writer = make_checkpoints(_model(width))
        assert writer.save(Quorum(epoch, [0], 0, "start"), step, last_step=True, stopping=False)
    assert _steps(tmp_path) == [5, 10]
    return tmp_path


def _restores(checkpoints, before_step: int, first_epoch: int, count: int) -> list[int]:
    """The steps of the checkpoints whose load failed in ``count`` restores, one an epoch."""
    failed = []
    for epoch in range(first_epoch, first_epoch + count):
        with pytest.raises(RestoreFailed) as error:
            checkpoints.roll_back(Quorum(epoch, [0], 0, "restore"), before_step)
        failed.append(error.value.step)
    return failed


def test_a_checkpoint_that_fails_to_load_is_passed_over_for_the_next_older_one_deleted_once_that_loaded(
        saved, make_checkpoints):
    model = _model(2)
    checkpoints = make_checkpoints(model)
    assert _restores(checkpoints, 11, 2, 2) == [10, 10]
    assert _steps(saved) == [5, 10]  # a failed load deletes nothing
    assert checkpoints.roll_back(Quorum(4, [0], 0, "restore"), 11) == 5
    assert torch.equal(model.weight, _model(2).weight)
    assert _steps(saved) == [5]  # the abandoned timeline's, once the older one loaded


def test_with_no_checkpoint_that_loads_the_run_ends_with_exit_19_naming_each_and_nothing_deleted(
        saved, make_checkpoints):
    checkpoints = make_checkpoints(_model(4))  # neither checkpoint's shape
    assert _restores(checkpoints, 11, 2, 4) == [10, 10, 5, 5]
    with pytest.raises(NothingToRestore) as nothing:
        checkpoints.roll_back(Quorum(6, [0], 0, "restore"), 11)
    assert nothing.value.exit_code == EXIT_STEP_FAILED
    message = str(nothing.value)
    assert message.startswith("the restore before step 11 found no checkpoint that loads: global_step_10 (2 failed "
                              "loads, the last: cannot load ")
    assert "; global_step_5 (2 failed loads, the last: cannot load " in message
    assert message.endswith("; every checkpoint is left as it was")
    assert _steps(saved) == [5, 10]


class _CountedReads:
    """The run's real store, its reads of a checkpoint's failed-load counts (``add(key, 0)``) counted by key."""

    def __init__(self, store):
        self.store, self.reads = store, collections.Counter()

    def add(self, key, amount):
        if amount == 0:
            self.reads[key] += 1
        return self.store.add(key, amount)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_checkpoint_passed_over_has_its_count_read_once_for_its_line_and_event(saved, make_checkpoints):
    checkpoints = make_checkpoints(_model(2))
    _restores(checkpoints, 11, 2, 2)
    store = checkpoints.load_failures.store = _CountedReads(checkpoints.load_failures.store)
    checkpoints.events = EventLog(saved / "events.jsonl", rank=0)
    assert checkpoints.roll_back(Quorum(4, [0], 0, "restore"), 11) == 5
    assert store.reads[count_key(10, 0)] == 1  # the rejection's count is the event's figure
    (passed,) = read_events(saved / "events.jsonl", "live_restore_passed_over")
    assert (passed["checkpoint"], passed["failures"]) == (10, 2)


def test_a_checkpoints_failed_loads_are_the_highest_of_its_ranks_counts_passed_over_at_the_limit(store):
    rank_0, rank_1 = (LoadFailures(store, rank, world=2, limit=2) for rank in (0, 1))
    rank_0.failed(6, "OSError: injected")
    rank_1.failed(6, "OSError: injected")  # the same failed restore, seen by both
    rank_0.failed(3, "OSError: other")
    assert rank_0.count(6) == 1 and rank_0.rejection(6, 1) is None
    rank_1.failed(6, "OSError: again")  # rank 0 left that epoch on rank 1's end of it, never seeing the error
    assert rank_0.count(6) == 2
    assert rank_0.rejection(6, 2) == "it failed to load 2 times (fault_tolerance.max_step_failures): OSError: again"
    assert rank_0.passed_over([6, 3]) == ["global_step_6 (2 failed loads, the last: OSError: again)"]
    # a joiner, rank 1's replacement, reads the same counts
    joiner = LoadFailures(store, 1, world=2, limit=2)
    assert joiner.rejection(6, joiner.count(6)).startswith("it failed to load 2 times")
