"""One process, no torchrun: ``GuardedTrainer`` on examples/hf_trainer.py's model, arguments and data,
counting the samples the data set loads. Prints ``{"loads": N, "exit_code": C}`` as its last line.

    python hf_counting_run.py RUN_DIR STEPS [KEY=VALUE ...]   (trainguard config overrides)
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from trainguard.config import load_config
from trainguard.integrations.hf_trainer import GuardedTrainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class CountingSequences(example.ArithmeticSequences):
    loads = 0

    def __getitem__(self, index: int):
        CountingSequences.loads += 1
        return super().__getitem__(index)


def main() -> None:
    run_dir, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    trainer = GuardedTrainer(run_dir, model=example.tiny_qwen2(), args=example.training_arguments(run_dir, steps),
                             train_dataset=CountingSequences(), guard_config=load_config(None, overrides))
    trainer.train()
    print(json.dumps({"loads": CountingSequences.loads, "exit_code": trainer.exit_code}))


if __name__ == "__main__":
    main()
