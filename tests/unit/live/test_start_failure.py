"""The start-failure policy (``live/start_failure.py``): the run cannot start once every rank has had a process
end before its first step, and its line names each rank's code or signal, node and last error."""

import json

import torch.distributed as dist

from trainguard.live.quorum import GIVEN_UP, awaited_at_end
from trainguard.live.start_failure import EarlyExit, StartFailures, cannot_start, given_up_line, start_failure_line


def test_the_run_cannot_start_only_once_every_rank_ended_early():
    early = {1: EarlyExit(1, 1, None, "")}
    assert not cannot_start(2, early)
    early[0] = EarlyExit(0, -9, None, "")
    assert cannot_start(2, early)
    assert not cannot_start(4, early)


def test_the_line_names_each_rank_in_order_with_its_code_or_signal_node_and_last_error():
    early = {1: EarlyExit(1, 2, "b", "usage: loop.py [-h]"), 0: EarlyExit(0, -9, None, ""),
             2: EarlyExit(2, -200, "c", "")}
    assert start_failure_line(early) == (
        "live run: every rank ended before the first step (a failure at start, not retried): rank 0 was killed by "
        "SIGKILL; rank 1 exited 2 on node b: usage: loop.py [-h]; rank 2 was killed by signal 200 on node c")


def test_a_rank_reaches_the_limit_after_failed_starts_in_a_row_a_step_or_a_move_starts_its_count_again():
    failures = StartFailures(limit=3)
    assert [failures.ended(2, stepped=False) for _ in range(2)] == [False, False]
    assert not failures.ended(2, stepped=True)  # it committed a step: the failures before are not in a row
    assert [failures.ended(2, stepped=False) for _ in range(3)] == [False, False, True]
    failures.moved(2)
    assert not failures.ended(2, stepped=False)
    assert not failures.ended(3, stepped=False)  # each rank its own count


def test_the_given_up_line_names_the_rank_the_count_the_key_and_the_last_failure():
    assert given_up_line(EarlyExit(1, 1, "b", "FileNotFoundError: /data/b"), 3) == (
        "trainguard: live run: rank 1 failed at start 3 times in a row (fault_tolerance.max_start_failures), last: "
        "rank 1 exited 1 on node b: FileNotFoundError: /data/b; not started again: the run goes on without its "
        "replica group until its next start")


def test_the_quorum_awaits_at_the_end_every_rank_of_the_groups_none_of_whose_ranks_was_given_up():
    store = dist.HashStore()
    assert awaited_at_end(store, 6, 2) == {0, 1, 2, 3, 4, 5}
    store.set(GIVEN_UP, json.dumps([2]))
    assert awaited_at_end(store, 6, 2) == {0, 1, 4, 5}  # rank 3 waits to rejoin with a group that never will
