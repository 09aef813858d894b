"""Live rollback mode's data positions (``live/data_positions.py``): the position of step t is the t-th one
not skipped; the skipped ranges round-trip through the guards' state and a malformed one is refused."""

import pytest

from trainguard.errors import CheckpointError
from trainguard.live.data_positions import DataPositions


def test_without_a_skipped_range_the_position_is_the_step():
    positions = DataPositions()
    assert [positions.position(step) for step in range(5)] == [0, 1, 2, 3, 4]


def test_positions_jump_past_each_skipped_window():
    positions = DataPositions()
    positions.skip(6, 8)
    positions.skip(10, 11)
    assert [positions.position(step) for step in range(4, 10)] == [4, 5, 8, 9, 11, 12]


def test_a_restored_step_moves_the_cursor_the_rollback_spans_its_window_from():
    positions = DataPositions()
    positions.skip(2, 4)
    positions.move_to(3)  # steps 0-2 fed positions 0, 1, 4
    assert positions.consumed_samples == 5
    assert positions.span_ahead(1, 2) == (6, 8)  # the window of steps 4-5, after step 3's position


def test_the_skipped_ranges_round_trip_and_a_malformed_state_is_refused():
    positions = DataPositions()
    positions.skip(6, 8)
    loaded = DataPositions()
    loaded.load_state_dict(positions.state_dict())
    assert loaded.skipped == [(6, 8)]
    with pytest.raises(CheckpointError, match="data_positions.skipped"):
        loaded.load_state_dict({"skipped": [[8, 6]]})
