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
                                "fault_tolerance.stall_steps=6", "fault_tolerance.startup_s=90",
                                "fault_tolerance.max_start_failures=5"])
    run = LiveRun.from_config(config, kill_ranks=(3,), entry=("examples/user_loop.py",))
    assert (run.groups, run.group_size, run.world, run.steps, run.micro_batches) == (2, 2, 4, 60, 8)
    assert (run.spares, run.hang_s, run.collective_timeout_s, run.stall_s, run.stall_steps, run.startup_s) == (1, 4.0, 12.0, 3.0, 6.0,
                                                                                                       90.0)
    assert run.max_start_failures == 5
    assert run.kill_ranks == (3,) and run.entry == ("examples/user_loop.py",)


@pytest.mark.parametrize("change, message", [
    ("fault_tolerance.live=false", "config key 'fault_tolerance.live' must be true to start a live run"),
    ("parallel.dp_replicate=", "config key 'parallel.dp_replicate' must be ≥ 2 for a live run"),
    ("parallel.dp_replicate=1", "config key 'parallel.dp_replicate' must be ≥ 2 for a live run (the replica "
                                "groups that outlive each other's failures), got 1"),
    ("parallel.pp=2", "config key 'parallel.pp' must be 1 for a live run"),
    ("parallel.tp=2", "config key 'parallel.tp' (2) needs 'fault_tolerance.fsdp: true' in a live run"),
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


TP_LAYOUT = ["fault_tolerance.live=true", "fault_tolerance.fsdp=true", "parallel.dp_replicate=2", "parallel.tp=2"]


@pytest.mark.parametrize("shards, micro_batches, world", [(1, 4, 4), (2, 8, 8)])
def test_tensor_parallel_makes_groups_of_dp_shard_times_tp_ranks(shards, micro_batches, world):
    config = load_config(None, [*TP_LAYOUT, f"parallel.dp_shard={shards}", f"train.micro_batches={micro_batches}",
                                f"fault_tolerance.spares={shards * 2}"])
    run = LiveRun.from_config(config)
    assert (run.groups, run.group_size, run.tp, run.world, run.fsdp) == (2, shards * 2, 2, world, True)


@pytest.mark.parametrize("change, message", [
    ("fault_tolerance.fsdp=false", "config key 'parallel.tp' (2) needs 'fault_tolerance.fsdp: true' in a live run"),
    ("fault_tolerance.spares=1", "config key 'fault_tolerance.spares' must be a multiple of the ranks of a replica "
                                 "group (parallel.dp_shard × tp = 2)"),
    # the tp peers of a position read the same micro-batches: the slots are dp_replicate × dp_shard
    ("train.micro_batches=3", "sharded replica groups need dp_replicate × dp_shard (2 × 1 = 2) a power of two that "
                              "divides train.micro_batches (3)"),
    ("train.micro_batches=1", "config key 'train.micro_batches' must be ≥ the ranks of the live run "
                              "(parallel.dp_replicate × dp_shard = 2), got 1"),
])
def test_a_tensor_parallel_layout_live_recovery_cannot_run_is_one_error_naming_the_key(change, message):
    config = load_config(None, [*TP_LAYOUT, "parallel.dp_shard=1", "train.micro_batches=4", change])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        LiveRun.from_config(config, "run.yaml")
    assert str(error.value).startswith("run.yaml: ")
