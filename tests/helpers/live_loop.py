r"""A small model, optimizer and data on ``trainguard.Guard``'s one loop, for the live-mode tests that need a
fast rank (test_live_durable.py, test_live_guards.py, cli/test_run_live.py); live_loop.yaml turns live
recovery on (4 gloo ranks: 2 replica groups x 2). The user's example of the same loop is
examples/user_loop.py (test_live_user_loop.py runs it live).

Each rank builds the model and optimizer (seeded: every rank starts alike), hands them to
``trainguard.Guard`` and loops with the loss of one micro-batch by index. The model has dropout: each
micro-batch's mask is drawn from (``train.seed``, step, micro-batch), so whichever rank computes it
draws the same one. Rank 0 prints every 10th step's loss.

    python -m trainguard run --nproc 4 --config tests/helpers/live_loop.yaml --run-dir runs/live \
        --set 'faults=kill:rank=3,step=5' -- python tests/helpers/live_loop.py

A rank is this script with the launcher's flags (``--store ... --rank R --run-dir DIR ...``: they decide
its place, the steps and the global batch) and its own (``--config``, ``--lr``, ``--one-cycle``: a
``OneCycleLR``, ``--seen``: a ``StepsSeen`` stateful object,
``--total``: the total passed to ``should_stop``). ``LIVE_LOOP_SPIKE_AT=P`` multiplies the loss of data position
``P`` (rollback mode's tests). ``LIVE_LOOP_DIE_IN_RESTORE=R``: rank R SIGKILLs itself once in the run, in the
middle of its first durable checkpoint load (a rollback's restore), after reading its part of the files and
before DCP's closing collective, while its peers wait in it with their own parts loaded (test_live_rollback.py);
``LIVE_LOOP_RAISE_IN_RESTORE=R``: the same read raises instead, once in the run (test_live_fingerprints.py);
``LIVE_LOOP_UNLOADABLE=R:S,T``: rank R's read of its part of ``global_step_S`` (and ``T``) raises every time
(test_live_restore_failures.py).
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import trainguard

CLASSES, FEATURES, MICRO_BATCH = 4, 12, 8
CONFIG = Path(__file__).with_suffix(".yaml")
# the tests' errors in the user's loss: a JSON list of {"step": S, "rank": R, "times": N} (rank and times
# optional: every rank, every time), each raising RuntimeError in loss_of at step S on that rank, N times
RAISE_ENV = "LIVE_LOOP_RAISE"
# a loss spike at a data position (the ``step`` loss_of is handed), every time it is fed: the position, as text
SPIKE_ENV = "LIVE_LOOP_SPIKE_AT"
SPIKE_FACTOR = 10000.0
DIE_IN_RESTORE_ENV = "LIVE_LOOP_DIE_IN_RESTORE"
RAISE_IN_RESTORE_ENV = "LIVE_LOOP_RAISE_IN_RESTORE"
UNLOADABLE_ENV = "LIVE_LOOP_UNLOADABLE"


def die_in_first_restore(run_dir: Path, rank: int, raises: bool = False) -> None:
    """This process SIGKILLs itself (``raises``: its load raises instead) after reading its part of the first
    durable checkpoint it loads, unless a process of the run already did (the marker file: the replacement
    rank must live, a load tried again must succeed)."""
    from trainguard.checkpoint.durable import SafeFileSystemReader

    marker, read_data = run_dir / f"died_in_restore_rank_{rank}", SafeFileSystemReader.read_data

    def read_then_die(self, plan, planner):
        done = read_data(self, plan, planner)
        if not marker.exists():
            marker.touch()
            if raises:
                raise OSError(f"injected: rank {rank}'s read of its part of the checkpoint failed")
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    SafeFileSystemReader.read_data = read_then_die


def unloadable(rank: int, steps: set[int]) -> None:
    """This process's read of its part of the durable checkpoint of each of ``steps`` raises, every time."""
    from trainguard.checkpoint.durable import SafeFileSystemReader

    read_data = SafeFileSystemReader.read_data

    def read_or_raise(self, plan, planner):
        if Path(self.path).name in {f"global_step_{step}" for step in steps}:
            raise OSError(f"injected: rank {rank}'s read of its part of {Path(self.path).name} failed")
        return read_data(self, plan, planner)

    SafeFileSystemReader.read_data = read_or_raise


def sample_range(step: int, micro_batch: int, micro_batches: int) -> tuple[int, int]:
    first = (step * micro_batches + micro_batch) * MICRO_BATCH
    return first, first + MICRO_BATCH


def batch(step: int, micro_batch: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one micro-batch, a pure function of its index: the data position is the step."""
    first, _ = sample_range(step, micro_batch, micro_batches)
    generator = torch.Generator().manual_seed(first)
    inputs = torch.randn(MICRO_BATCH, FEATURES, generator=generator)
    return inputs, (inputs[:, :CLASSES].argmax(dim=1) + (inputs[:, -1] > 1).long()) % CLASSES


def build_model() -> torch.nn.Module:
    """Seeded: every rank starts alike."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 24), torch.nn.GELU(), torch.nn.LayerNorm(24),
                               torch.nn.Dropout(0.1), torch.nn.Linear(24, CLASSES))


class StepsSeen:
    """The loop's own state (``Guard(stateful=...)``), updated before each step: how many steps the loop
    asked for, and the last one."""

    def __init__(self):
        self.steps, self.last = 0, -1

    def before(self, step: int) -> None:
        self.steps, self.last = self.steps + 1, step

    def state_dict(self) -> dict:
        return {"steps": self.steps, "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.last = state["steps"], state["last"]


def one_cycle(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.OneCycleLR:
    """A schedule whose LR is not a function of the step alone (its momentum cycles too)."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)


def rank_main(argv: list[str]) -> None:
    model = build_model()
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--run-dir", type=Path, required=True)  # the launcher's flag: the run's directory
    parser.add_argument("--steps", type=int)  # the launcher's flag: the run's steps
    parser.add_argument("--one-cycle", action="store_true", help="step a OneCycleLR over the run's steps")
    parser.add_argument("--seen", action="store_true", help="keep a StepsSeen as stateful")
    parser.add_argument("--total", type=int)  # the total passed to should_stop (default: guard.total_steps)
    own, _ = parser.parse_known_args(argv)  # the rest are the launcher's flags, the guard's
    optimizer = torch.optim.AdamW(model.parameters(), lr=own.lr, weight_decay=0.1)
    scheduler = one_cycle(optimizer, own.steps) if own.one_cycle else None
    seen = StepsSeen() if own.seen else None
    # the first layer stands in for an input embedding: its gradient norm is what guards.health judges
    guard = trainguard.Guard(own.run_dir, model, optimizer, scheduler, stateful={"seen": seen} if seen else None,
                             config=own.config, embedding=model[0].weight)  # live: the config says so

    errors = json.loads(os.environ.get(RAISE_ENV, "[]"))
    spike_at = int(os.environ[SPIKE_ENV]) if SPIKE_ENV in os.environ else None
    if os.environ.get(DIE_IN_RESTORE_ENV) == str(guard.rank):
        die_in_first_restore(own.run_dir, guard.rank)
    if os.environ.get(RAISE_IN_RESTORE_ENV) == str(guard.rank):
        die_in_first_restore(own.run_dir, guard.rank, raises=True)
    unloadable_rank, _, unloadable_steps = os.environ.get(UNLOADABLE_ENV, "").partition(":")
    if unloadable_rank == str(guard.rank):
        unloadable(guard.rank, {int(step) for step in unloadable_steps.split(",")})

    def loss_of(model: torch.nn.Module, step: int, micro_batch: int) -> torch.Tensor:
        for error in errors:
            left = error.get("times", -1)  # below 0: every time
            if error["step"] == step and error.get("rank", guard.rank) == guard.rank and left != 0:
                error["times"] = left - 1
                raise RuntimeError(f"injected error in the loss of step {step} on rank {guard.rank}")
        inputs, labels = batch(step, micro_batch, guard.micro_batches)
        loss = F.cross_entropy(model(inputs), labels)
        return loss * SPIKE_FACTOR if step == spike_at else loss

    def samples_of(step: int, micro_batch: int) -> tuple[int, int]:  # for the events' sample check
        return sample_range(step, micro_batch, guard.micro_batches)

    step = guard.resume()
    while not guard.should_stop(step, guard.total_steps if own.total is None else own.total):
        if seen is not None:
            seen.before(step)
        outcome = guard.step(loss_of, samples_of)
        step = outcome.step
        if guard.rank == 0 and outcome.rolled_back:
            print(f"rolled back to step {step}", flush=True)
        if guard.rank == 0 and step % 10 == 0:
            print(f"step {step} loss {outcome.loss:.4f}", flush=True)
    guard.close()  # ends this process with the quorum's code


if __name__ == "__main__":
    rank_main(sys.argv[1:])
