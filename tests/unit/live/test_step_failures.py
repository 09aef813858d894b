"""The retry limit of a live step whose computation raised (``live/step_failures.py``): pure counting."""

from trainguard.config import load_config
from trainguard.errors import EXIT_STEP_FAILED, ConfigError
from trainguard.live.step_failures import StepFailed, StepFailures, StepFailureVerdict, failure_text
from trainguard.runtime.policy import NEVER_RESTART, stop_explanation

import pytest


def test_the_same_step_failing_limit_times_in_a_row_ends_the_run():
    failures = StepFailures(limit=3)
    assert [failures.failed(5) for _ in range(3)] == [StepFailureVerdict.RETRY, StepFailureVerdict.RETRY,
                                                       StepFailureVerdict.END]


def test_a_commit_or_another_step_starts_the_count_again():
    failures = StepFailures(limit=2)
    assert failures.failed(5) is StepFailureVerdict.RETRY
    failures.committed()
    assert failures.failed(5) is StepFailureVerdict.RETRY
    assert failures.failed(6) is StepFailureVerdict.RETRY  # another step: its own first failure
    assert failures.failed(6) is StepFailureVerdict.END


def test_a_limit_of_one_ends_at_the_first_failure():
    assert StepFailures(limit=1).failed(0) is StepFailureVerdict.END


def test_the_error_is_one_line_and_exit_19_is_never_restarted():
    assert failure_text(ValueError("bad batch\nmore")) == "ValueError: bad batch"
    assert failure_text(KeyError()) == "KeyError"
    assert StepFailed("x").exit_code == EXIT_STEP_FAILED == 19
    assert EXIT_STEP_FAILED in NEVER_RESTART
    assert "not restarted" in stop_explanation(EXIT_STEP_FAILED, 5, None, None)


def test_the_config_key_defaults_to_3_and_must_be_positive():
    assert load_config(None, []).fault_tolerance.max_step_failures == 3
    assert load_config(None, ["fault_tolerance.max_step_failures=1"]).fault_tolerance.max_step_failures == 1
    with pytest.raises(ConfigError, match="fault_tolerance.max_step_failures"):
        load_config(None, ["fault_tolerance.max_step_failures=0"])
