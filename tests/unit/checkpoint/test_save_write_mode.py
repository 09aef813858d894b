"""Issue 38 item 2 (save cost): a synchronous save, whose loop waits for the whole write, writes its
files through the page cache (writeback started as it goes, one fsync per file); an async save, whose
loop waits for none of it, writes them directly (``O_DIRECT``: less CPU beside the training). Both
commit the same verified checkpoint."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint import hashing_file
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import verify_checkpoint


@pytest.mark.parametrize("async_save", [False, True])
def test_a_sync_save_writes_through_the_page_cache_and_an_async_one_directly(tmp_path, monkeypatch, async_save):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    opened: list[bool] = []

    class Recorded(hashing_file.HashingFile):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self.direct)

    monkeypatch.setattr(hashing_file, "HashingFile", Recorded)
    manager = CheckpointManager(tmp_path, model, optimizer, config=CheckpointConfig(save_interval=0, writer="thread"),
                                async_save=async_save, keep_last=5)
    manager.save_durable(1)
    manager.close()
    assert len(opened) == 2  # the shard and the extra state (tmp_path is on a disk: direct writes possible)
    assert opened == [async_save] * 2
    assert verify_checkpoint(tmp_path / "checkpoints" / "global_step_1") == []
