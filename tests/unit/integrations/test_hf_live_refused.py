"""``GuardedTrainer`` refuses ``fault_tolerance.live`` with one error saying why (the Trainer draws its
batches from its own dataloader; live recovery needs each micro-batch's loss by index)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="the Trainer adapter needs accelerate (pip install 'trainguard[hf]')")

from transformers import TrainingArguments  # noqa: E402

from trainguard.config import load_config  # noqa: E402
from trainguard.integrations.hf_trainer import GuardedTrainer  # noqa: E402


def test_the_trainer_adapter_refuses_live_mode(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"^GuardedTrainer: fault_tolerance.live is not supported \(live recovery"):
        GuardedTrainer(tmp_path / "run", guard_config=load_config(None, ["fault_tolerance.live=true"]),
                       model=torch.nn.Linear(2, 1), args=args)
    assert not (tmp_path / "run").exists()
