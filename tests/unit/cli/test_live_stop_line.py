"""The line `trainguard train`/`run` prints after a live run's agreed stop. A start with the kill switch
armed commits nothing: the line once ended "saved None" (found running cli.md's killswitch, then
`trainguard train --set fault_tolerance.live=true ... --set lifecycle.kill_switch_path=PATH`)."""

from __future__ import annotations

from pathlib import Path

from trainguard.cli.train_live import newest_checkpoint_words, step_failed_words, stop_line

ARMED_AT_START = {"reason": "kill_switch", "step": 0, "outcome": "not_started",
                  "message": "kill switch shared/STOP exists at start: nothing loaded or trained"}


def test_a_stop_with_nothing_committed_says_nothing_saved_not_none():
    line = stop_line(ARMED_AT_START, None, resumable=False)
    assert line == ("trainguard: live run stopped at step 0: kill switch shared/STOP exists at start: nothing "
                    "loaded or trained; nothing saved")
    assert "None" not in newest_checkpoint_words(None)


def test_a_stop_that_saved_names_the_checkpoint_as_before():
    saved = Path("/runs/a/checkpoints/global_step_4")
    signal = {"reason": "signal", "step": 4, "message": "received SIGTERM"}
    assert stop_line(signal, saved, resumable=True) == (
        f"trainguard: live run stopped by SIGTERM/SIGUSR1: saved {saved}; run again with --resume auto to continue")
    assert stop_line({**ARMED_AT_START, "step": 4, "message": "kill switch shared/STOP exists"}, saved, False) == (
        f"trainguard: live run stopped at step 4: kill switch shared/STOP exists; saved {saved}")
    assert newest_checkpoint_words(saved) == f"the newest checkpoint is {saved}"


def test_exit_19_names_its_cause_a_step_or_a_restore_with_no_checkpoint_that_loads():
    """The quorum's record (``LiveStop``) says which: a restore's was called a step's failure before."""
    step = {"reason": "step_failed", "step": 11, "message": "step 11 failed 3 times in a row ..."}
    restore = {"reason": "restore_failed", "step": 6, "message": "the restore before step 7 found no checkpoint ..."}
    assert step_failed_words(step) == step_failed_words(None) == \
        "a step failed fault_tolerance.max_step_failures times in a row"
    assert step_failed_words(restore) == ("the restore before step 7 found no checkpoint that loads (each failed "
                                          "fault_tolerance.max_step_failures times)")
