"""The start-failure policy (``live/start_failure.py``): the run cannot start once every rank has had a process
end before its first step, and its line names each rank's code or signal, node and last error."""

from trainguard.live.start_failure import EarlyExit, cannot_start, start_failure_line


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
