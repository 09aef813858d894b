"""Which warm spare replaces a dead rank (pure: the launcher acts on the answer).

Whole replicas (``group_size`` 1) and groups sharded by rows take the first spare still usable. With
FSDP2 inside the replica groups (``fault_tolerance.fsdp``) a spare made its default process group and
mesh with the other spares of its spare group as it started (``replica_mesh``), at position
``spare % group_size``: so a dead rank at position ``p`` takes the position-``p`` spare of the spare group
already taking over its replica group (its group is replaced whole: the other ranks end with
``GROUP_OUT_EXIT``), else of the first spare group whose spares are all usable and unused. None: no spare
fits, the rank starts cold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def spare_for(rank: int, usable: Sequence[int], assigned: Mapping[int, int], group_size: int,
              fsdp: bool) -> int | None:
    """The spare (its index) that replaces ``rank``: one of ``usable`` (spares ready and not yet used, in
    order). ``assigned``: every spare used so far, to the rank it replaced."""
    if not fsdp:
        return usable[0] if usable else None
    position, group = rank % group_size, rank // group_size

    def spare_group(spare: int) -> int:
        return spare // group_size

    taking_over = {spare_group(spare) for spare, replaced in assigned.items() if replaced // group_size == group}
    used = {spare_group(spare) for spare in assigned}
    # a spare group with a spare passed over (its self-test failed, it ended) cannot take a whole group
    whole = [spare for spare in usable if spare_group(spare) not in used
             and sum(spare_group(other) == spare_group(spare) for other in usable) == group_size]
    for spare in [s for s in usable if spare_group(s) in taking_over] + whole:
        if spare % group_size == position:
            return spare
    return None
