"""``live.local_tier``: which tier a whole live job resumes from and who receives it from which replica
(pure), and one rank's local tier on real files: saved with no communication, verified, loaded bitwise, a
damaged file or another layout passed over; a rank's step received from a replica over gloo (two forked
ranks), verified against the replica's checksums."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.forked_ranks import run_forked_ranks
from trainguard.errors import CheckpointError
from trainguard.events import EventLog
from trainguard.fs.layout import step_dir_name
from trainguard.live.local_tier import LiveLocalTier, ResumePoint, choose_live_resume


def test_the_newest_step_every_rank_holds_wins_when_newer_than_the_durable_one():
    assert choose_live_resume(10, {"local": {0: [9, 12], 1: [12, 9]}}, 1) == ResumePoint("local", 12)
    assert choose_live_resume(None, {"local": {0: [3], 1: [3]}}, 1) == ResumePoint("local", 3)


def test_a_step_no_replica_of_a_shard_holds_is_passed_over_for_an_older_one():
    # replica groups of one rank: every rank holds the one shard, so one holder is enough
    assert choose_live_resume(None, {"local": {0: [9, 12], 1: [9]}}, 1) == ResumePoint("local", 12, ((1, 0),))
    # 2 groups of 2: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1; step 12 of shard 1 is nowhere
    held = {0: [9, 12], 1: [9], 2: [9, 12], 3: [9]}
    assert choose_live_resume(None, {"local": held}, 2) == ResumePoint("local", 9)
    assert choose_live_resume(10, {"local": held}, 2) == ResumePoint("durable", 10)


def test_a_rank_that_lacks_the_step_receives_it_from_the_lowest_replica_of_its_shard_that_holds_it():
    # node 1 (ranks 2 and 3, group 1) wiped after step 12: each receives it from its shard's rank of group 0
    held = {0: [10, 12], 1: [10, 12], 2: [], 3: []}
    assert choose_live_resume(5, {"local": held}, 2) == ResumePoint("local", 12, ((2, 0), (3, 1)))
    # 3 groups of 2: rank 0 lacks it (a damaged file), rank 2 holds it but rank 4 is the next replica
    held = {0: [10], 1: [12], 2: [12], 3: [12], 4: [12], 5: []}
    assert choose_live_resume(None, {"local": held}, 2) == ResumePoint("local", 12, ((0, 2), (5, 1)))
    # a quorum of groups 1 and 2 only (group 0's ranks absent): its members' copies decide
    held = {2: [12], 3: [12], 4: [], 5: [12]}
    assert choose_live_resume(None, {"local": held}, 2) == ResumePoint("local", 12, ((4, 2),))


def test_the_durable_checkpoint_wins_at_an_equal_or_newer_step_and_none_means_a_fresh_start():
    assert choose_live_resume(12, {"local": {0: [12], 1: [12]}}, 1) == ResumePoint("durable", 12)
    assert choose_live_resume(None, {"local": {0: [], 1: []}}, 1) == ResumePoint("durable", None)
    assert choose_live_resume(None, {"local": {0: [], 1: [4], 2: [], 3: [4]}}, 2) == ResumePoint("durable", None)
    assert choose_live_resume(None, {}, 2) == ResumePoint("durable", None)


def test_the_memory_tier_wins_when_newer_and_the_first_tier_given_at_an_equal_step():
    def tiers(memory: int, local: int) -> dict:
        return {"memory": {0: [memory], 1: [memory]}, "local": {0: [local], 1: [local]}}

    assert choose_live_resume(10, tiers(13, 12), 1) == ResumePoint("memory", 13)
    assert choose_live_resume(10, tiers(12, 12), 1) == ResumePoint("memory", 12)
    assert choose_live_resume(10, tiers(11, 12), 1) == ResumePoint("local", 12)
    # the local tier's newer step is whole across the shards, the memory tier's only on one replica of each
    held = {"memory": {0: [14], 1: [14], 2: [], 3: []}, "local": {0: [12], 1: [12], 2: [12], 3: [12]}}
    assert choose_live_resume(10, held, 2) == ResumePoint("memory", 14, ((2, 0), (3, 1)))


def _tier(tmp_path, group_size: int = 2, keep_last: int = 2) -> LiveLocalTier:
    return LiveLocalTier(tmp_path / "run", tier="local", template=None, interval=2, keep_last=keep_last, rank=1,
                         world=4, group_size=group_size, ranks_per_node=4,
                         events=EventLog(tmp_path / "events.jsonl", rank=1))


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    scheduler.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "guards": {"skipped": seed},
            "scheduler": scheduler.state_dict(), "committed": {"step": seed, "loss": 0.5},
            "stateful": {"sampler": {"position": seed * 8}}}


def test_a_ranks_local_step_is_held_verified_and_loads_bitwise(tmp_path):
    tier = _tier(tmp_path)
    tier.save(2, _state(2))
    tier.save(4, _state(4))
    assert tier.held() == [2, 4] and tier.dir == (tmp_path / "run" / "local" / "node0").resolve()
    loaded = tier.load(4)
    expected = _state(4)
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected["model"].items())
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
    # the whole run state, or a job resumed from this tier refuses it (a scheduler) or loses the loop's objects
    assert {key: loaded[key] for key in ("guards", "scheduler", "committed", "stateful")} == {
        key: expected[key] for key in ("guards", "scheduler", "committed", "stateful")}


def test_a_damaged_file_or_another_layout_is_not_held_and_newer_steps_are_discarded(tmp_path):
    tier = _tier(tmp_path, keep_last=3)
    for step in (2, 4, 6):
        tier.save(step, _state(step))
    model_file = tier.dir / step_dir_name(4) / "model_world_size_4_rank_1.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped: the rank manifest's checksum no longer matches
    model_file.write_bytes(bytes(data))
    assert tier.held() == [2, 6]
    assert _tier(tmp_path, group_size=1).held() == []  # saved with replica groups of 2 ranks
    tier.discard_newer(2)
    assert tier.held() == [2]


def _exchanging_rank(rank: int, root: str, results: str) -> None:
    """Rank 0 holds steps 4 and 6 (step 6's model file damaged after it was saved), rank 1 (another node)
    none: rank 1 receives step 4 from rank 0 and loads it bitwise; step 6's damaged bytes are refused."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
        tier = LiveLocalTier(Path(root) / "run", tier="local", template=None, interval=2, keep_last=3, rank=rank,
                             world=2, group_size=1, ranks_per_node=1,
                             events=EventLog(Path(root) / "events.jsonl", rank=rank))
        if rank == 0:
            tier.save(4, _state(4))
            tier.save(6, _state(6))
            tier.wait()
            model_file = tier.dir / step_dir_name(6) / "model_world_size_2_rank_0.pt"
            data = bytearray(model_file.read_bytes())
            data[len(data) // 2] ^= 0xFF
            model_file.write_bytes(bytes(data))
        dist.barrier()
        received = tier.exchange(4, [(1, 0)], lambda member: member)
        if rank == 1:
            assert received > 0 and tier.held() == [4] and tier.dir == (Path(root) / "run/local/node1").resolve()
            loaded, expected = tier.load(4), _state(4)
            assert all(torch.equal(loaded["model"][k], v) for k, v in expected["model"].items())
            assert loaded["stateful"] == expected["stateful"] and loaded["scheduler"] == expected["scheduler"]
            with pytest.raises(CheckpointError, match=r"model_world_size_2_rank_1\.pt: the bytes received from rank 0 "
                                                      r"for step 6 do not match its rank manifest's checksum$"):
                tier.exchange(6, [(1, 0)], lambda member: member)
            assert tier.held() == [4]  # step 6 never committed for rank 1
        else:
            assert received == 0
            tier.exchange(6, [(1, 0)], lambda member: member)  # sends every file, the damaged one too
        dist.barrier()
        dist.destroy_process_group()
        Path(results, f"ok{rank}").write_text("")
    except BaseException:
        Path(results, f"error{rank}").write_text(traceback.format_exc())


def test_a_rank_receives_a_step_from_a_replica_verified_and_refuses_bytes_that_do_not_match(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    run_forked_ranks(_exchanging_rank, 2, (str(tmp_path), str(results)), results)
