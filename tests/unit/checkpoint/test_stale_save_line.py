"""A manager removes saves that never committed (``global_step_N.tmp-*``) when it starts. In live mode a
manager starts with each quorum, and the save it removes is the one abandoned when a rank died in this
same run: the line once said "left by an earlier run" there (found running live_recovery.md's
`trainguard run --nproc 4 ... --set 'faults=kill:rank=3,step=5' -- python examples/user_loop.py`)."""

from __future__ import annotations

import logging

import torch

from trainguard.checkpoint.manager import CheckpointManager


def test_the_removed_save_is_named_without_claiming_an_earlier_run(tmp_path, caplog):
    stale = tmp_path / "checkpoints" / "global_step_4.tmp-6834282ddb85"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"half a save")
    model = torch.nn.Linear(2, 1)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        manager = CheckpointManager(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), save_interval=0)
    manager.close()
    lines = [r.getMessage() for r in caplog.records if str(stale) in r.getMessage()]
    assert lines == [f"removed an unfinished checkpoint, a save that never committed: {stale}"]
    assert not stale.exists()
