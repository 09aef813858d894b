"""examples/hf_trainer.py with the Trainer's ``max_steps`` fixed at ``--max-steps`` whatever ``--steps`` (the
live launcher's, ``train.steps``) says: a script whose Trainer disagrees with its live launcher."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_trainer  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, required=True)
    max_steps = parser.parse_known_args()[0].max_steps
    with_launchers_steps = hf_trainer.training_arguments
    hf_trainer.training_arguments = lambda run_dir, steps, **kwargs: with_launchers_steps(run_dir, max_steps, **kwargs)
    hf_trainer.main()
