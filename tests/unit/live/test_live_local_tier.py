"""``live.local_tier``: which tier a whole live job resumes from (pure), and one rank's local tier on real
files: saved with no communication, verified, loaded bitwise, a damaged file or another layout passed over."""

from __future__ import annotations

import torch

from trainguard.events import EventLog
from trainguard.fs.layout import step_dir_name
from trainguard.live.local_tier import LiveLocalTier, ResumePoint, choose_live_resume


def test_the_newest_step_every_rank_holds_wins_when_newer_than_the_durable_one():
    assert choose_live_resume(10, {"local": [[9, 12], [12, 9]]}) == ResumePoint("local", 12)
    assert choose_live_resume(None, {"local": [[3], [3]]}) == ResumePoint("local", 3)


def test_a_step_one_rank_lacks_is_passed_over_for_an_older_one_all_hold():
    assert choose_live_resume(None, {"local": [[9, 12], [9]]}) == ResumePoint("local", 9)
    assert choose_live_resume(10, {"local": [[9, 12], [9]]}) == ResumePoint("durable", 10)


def test_the_durable_checkpoint_wins_at_an_equal_or_newer_step_and_none_means_a_fresh_start():
    assert choose_live_resume(12, {"local": [[12], [12]]}) == ResumePoint("durable", 12)
    assert choose_live_resume(None, {"local": [[], [4]]}) == ResumePoint("durable", None)
    assert choose_live_resume(None, {}) == ResumePoint("durable", None)


def test_the_memory_tier_wins_when_newer_and_the_first_tier_given_at_an_equal_step():
    assert choose_live_resume(10, {"memory": [[13], [13]], "local": [[12], [12]]}) == ResumePoint("memory", 13)
    assert choose_live_resume(10, {"memory": [[12], [12]], "local": [[12], [12]]}) == ResumePoint("memory", 12)
    assert choose_live_resume(10, {"memory": [[11], [11]], "local": [[12], [12]]}) == ResumePoint("local", 12)


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
