"""A recompute after a flip at rest loads a checkpoint whose lazy copy was made after that flip's step
began: the checkpoint must hold the state of its step whenever the copy runs."""

from __future__ import annotations

import time

import torch
from torch import nn

import trainguard
from trainguard.checkpoint.durable import read_full_state_dict
from trainguard.config import load_config
from trainguard.events import read_events


def test_a_stateflip_right_after_an_async_save_whose_copy_is_late_is_not_in_the_checkpoint_recomputed_from(
        tmp_path, quiet):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = trainguard.Guard(tmp_path, model, optimizer, config=load_config(None, [
        "checkpoint.save_interval=2", "checkpoint.async_save=true", "guards.fingerprint.interval=2",
        "faults=stateflip:rank=0,step=3,site=0.weight,state=weight,index=3,bit=29"]))
    write_static_files = guard.checkpoints.static_files

    def late(directory):  # the save's background thread copies the state after this: after step 3 began
        time.sleep(0.5)
        write_static_files(directory)

    guard.checkpoints.static_files = late
    inputs = torch.randn(8, 4)
    saved_weight = None
    step = guard.resume()
    while not guard.should_stop(step, 4):
        outcome = guard.step(lambda: model(inputs).square().mean().backward())
        step = outcome.step
        if step == 2 and saved_weight is None:
            saved_weight = model[0].weight.detach().clone()
    guard.close()
    recomputes = [(e["step"], e["to_step"]) for e in read_events(tmp_path / "events.jsonl")
                  if e["kind"] == "fingerprint_recompute"]
    assert recomputes == [(3, 2)]
    assert torch.equal(read_full_state_dict(tmp_path / "checkpoints/global_step_2")["model.0.weight"], saved_weight)
