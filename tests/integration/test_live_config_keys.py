"""Keys that live mode used to accept and then ignore (issue 35): ``optim.grad_clip`` (the closure mode
clips; live mode did not) and a ``--set`` given to ``trainguard run``'s live path (it reached the
launcher only, not the ranks' ``Guard``, which loads its own file). A user's script in live mode, started
as a user starts it (``trainguard run --nproc 2 --config FILE --set ... -- python SCRIPT``), 2 replica
groups of 1 rank, with dropout; its end state is compared with the same training done here in one
process, written from the documented contract: micro-batch ``m`` of step ``t`` drawn under
``micro_batch_rng(train.seed, t, m)``, the gradients of the step's micro-batches summed in order, clipped
to ``optim.grad_clip`` by their global norm as ``Guard.step`` clips (``max_norm / (norm + 1e-6)``), AdamW."""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys
import textwrap

import pytest
import torch

from helpers.finished_rank import MARK_FINISHED
from helpers.runs import trainguard
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.cli.run_live import run_command_live
from trainguard.live.files import final_path
from trainguard.live.rng import micro_batch_rng
from trainguard.step.live import LAUNCHER_OVERRIDES_ENV

STEPS, MICRO_BATCHES, CLIP, SEED = 4, 4, 0.05, 7

SCRIPT = textwrap.dedent('''
    import argparse

    import torch
    import torch.nn.functional as F

    import trainguard


    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)


    def loss_of(model, step, micro_batch):
        generator = torch.Generator().manual_seed(1000 * step + micro_batch)
        inputs, labels = torch.randn(4, 4, generator=generator), torch.randn(4, 1, generator=generator)
        return F.mse_loss(model(inputs), labels)


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--config")
        parser.add_argument("--run-dir")
        own, _ = parser.parse_known_args()
        model, optimizer = build()
        guard = trainguard.Guard(own.run_dir, model, optimizer, config=own.config)
        for _ in guard.steps(loss_of):
            pass
        guard.close()
''')

CONFIG = f"""
parallel: {{dp_replicate: 2, dp_shard: 1}}
train: {{steps: {STEPS}, micro_batches: {MICRO_BATCHES}}}
fault_tolerance: {{live: true}}
"""


def _trained_here(script: dict, seed: int, clip: float) -> dict[str, torch.Tensor]:
    model, optimizer = script["build"]()
    for step in range(STEPS):
        grads = []
        for micro_batch in range(MICRO_BATCHES):
            model.zero_grad(set_to_none=True)
            with micro_batch_rng(seed, step, micro_batch):
                (script["loss_of"](model, step, micro_batch) / MICRO_BATCHES).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for index, p in enumerate(model.parameters()):
            p.grad = grads[0][index].clone()
            for later in grads[1:]:
                p.grad += later[index]
        norm = math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in model.parameters()))
        if clip > 0 and clip / (norm + 1e-6) < 1:
            for p in model.parameters():
                p.grad.mul_(clip / (norm + 1e-6))
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_keys")
    (root / "script.py").write_text(SCRIPT)
    (root / "run.yaml").write_text(CONFIG)
    done = trainguard("run", "--nproc", "2", "--config", str(root / "run.yaml"), "--run-dir", str(root / "run"),
                      "--set", f"optim.grad_clip={CLIP}", "--set", f"train.seed={SEED}", "--",
                      sys.executable, str(root / "script.py"), "--config", str(root / "run.yaml"), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


def test_grad_clip_and_a_set_seed_reach_the_ranks_of_a_live_run(live_run):
    script = runpy.run_path(str(live_run / "script.py"))
    expected = _trained_here(script, SEED, CLIP)
    for rank in (0, 1):
        final = safe_torch_load(final_path(live_run / "run", rank))["model"]
        assert final.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.allclose(final[name], value, rtol=1e-5, atol=1e-7), (rank, name)
    # what the ranks did before: their file's seed (42) and no clipping; far from the run's result
    final = safe_torch_load(final_path(live_run / "run", 0))["model"]
    for seed, clip in ((SEED, 0.0), (42, CLIP)):
        ignored = _trained_here(script, seed, clip)
        assert not all(torch.allclose(final[n], v, rtol=1e-3, atol=1e-5) for n, v in ignored.items()), (seed, clip)


def test_the_set_items_reach_the_ranks_environment_and_leave_the_launchers_alone(tmp_path, monkeypatch):
    """``trainguard run``'s live path in this process, each of its 2 ranks a stand-in that writes down
    the ``TRAINGUARD_SET`` it was given and ends as a finished rank: the ranks get the ``--set`` items, and
    the launcher's own environment is as it was (it used to keep them: a later ``Guard`` in the same
    process applied them to a configuration of its own)."""
    monkeypatch.delenv(LAUNCHER_OVERRIDES_ENV, raising=False)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # whatever the code under test leaves, this test's only
    (tmp_path / "run.yaml").write_text(CONFIG)
    items = ["train.seed=7", "optim.grad_clip=0.25"]
    args = argparse.Namespace(config=str(tmp_path / "run.yaml"), overrides=items, resume=None, nproc=2,
                              kill_switch=None, supervisor_defaults={}, launcher="local", hosts=None,
                              node_command=None)
    seen = tmp_path / "seen"
    says = f"import os, sys; open(f'{{sys.argv[1]}}.{{os.getpid()}}', 'w').write(os.environ[{LAUNCHER_OVERRIDES_ENV!r}])"
    command = [sys.executable, "-c", says + "\n" + MARK_FINISHED, str(seen)]
    assert run_command_live(args, command, tmp_path / "run") == 0
    assert LAUNCHER_OVERRIDES_ENV not in os.environ
    written = sorted(tmp_path.glob("seen.*"))
    assert len(written) == 2 and all(json.loads(path.read_text()) == items for path in written)
