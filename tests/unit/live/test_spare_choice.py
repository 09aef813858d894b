"""Which warm spare replaces a dead rank (``live/spare_choice.py``): the first usable one, or with FSDP2 the
spare at the dead rank's position of the spare group taking over its replica group."""

from trainguard.live.spare_choice import spare_for


def test_without_fsdp_the_first_usable_spare_replaces_any_rank():
    assert spare_for(3, [1, 2], {0: 5}, 2, fsdp=False) == 1
    assert spare_for(3, [], {}, 2, fsdp=False) is None


def test_with_fsdp_a_lost_group_goes_to_one_spare_group_position_for_position():
    # 2 spare groups of 2 (spares 0-3); rank 3 (group 1, position 1) dies first, then rank 2 leaves
    assert spare_for(3, [0, 1, 2, 3], {}, 2, fsdp=True) == 1
    assert spare_for(2, [0, 2, 3], {1: 3}, 2, fsdp=True) == 0
    # group 0 lost next: the whole spare group 1, not a spare of the group taking over group 1
    assert spare_for(0, [2, 3], {1: 3, 0: 2}, 2, fsdp=True) == 2
    # while spare group 0 takes over group 1, group 0's loss does not take spare 0
    assert spare_for(0, [0, 2, 3], {1: 3}, 2, fsdp=True) == 2


def test_with_fsdp_a_spare_group_with_a_spare_passed_over_takes_no_group():
    assert spare_for(3, [0, 2, 3], {}, 2, fsdp=True) == 3  # spare 1 failed its self-test: spare group 0 is not whole
    assert spare_for(3, [0], {}, 2, fsdp=True) is None  # no spare fits: the rank starts cold
