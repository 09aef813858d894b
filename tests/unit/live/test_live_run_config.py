"""``LiveRun.from_config``: the run a configuration describes (layout, steps, global batch, the
``fault_tolerance`` keys), and one error naming the key for a layout live recovery cannot run."""

from __future__ import annotations

import pytest

from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.live.launcher import LiveRun

LIVE_LAYOUT = ["fault_tolerance.live=true", "parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batches=8"]


def test_the_config_gives_the_layout_the_batch_and_the_fault_tolerance_keys():
    config = load_config(None, [*LIVE_LAYOUT, "train.steps=60", "fault_tolerance.spares=1", "fault_tolerance.hang_s=4",
                                "fault_tolerance.collective_timeout_s=12", "fault_tolerance.stall_s=3",
                                "fault_tolerance.stall_steps=6"])
    run = LiveRun.from_config(config, kill_ranks=(3,), entry=("examples/user_loop.py",))
    assert (run.groups, run.group_size, run.world, run.steps, run.micro_batches) == (2, 2, 4, 60, 8)
    assert (run.spares, run.hang_s, run.collective_timeout_s, run.stall_s, run.stall_steps) == (1, 4.0, 12.0, 3.0, 6.0)
    assert run.kill_ranks == (3,) and run.entry == ("examples/user_loop.py",)


@pytest.mark.parametrize("change, message", [
    ("fault_tolerance.live=false", "config key 'fault_tolerance.live' must be true to start a live run"),
    ("parallel.dp_replicate=", "config key 'parallel.dp_replicate' must be ≥ 2 for a live run"),
    ("parallel.dp_replicate=1", "config key 'parallel.dp_replicate' must be ≥ 2 for a live run (the replica "
                                "groups that outlive each other's failures), got 1"),
    ("parallel.tp=2", "config key 'parallel.tp' must be 1 for a live run"),
    ("train.micro_batches=3", "config key 'train.micro_batches' must be ≥ the ranks of the live run "
                              "(parallel.dp_replicate × dp_shard = 4), got 3"),
    ("train.micro_batches=6", "config keys 'parallel.dp_replicate', 'parallel.dp_shard', 'train.micro_batches': "
                               "sharded replica groups need dp_replicate × dp_shard (2 × 2 = 4) a power of two that "
                               "divides train.micro_batches (6)"),
])
def test_a_layout_live_recovery_cannot_run_is_one_error_naming_the_key(change, message):
    config = load_config(None, [*LIVE_LAYOUT, change])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        LiveRun.from_config(config, "run.yaml")
    assert str(error.value).startswith("run.yaml: ")
