"""Multi-role checkpoints (checkpoint/roles.py): actor and critic with their own optimizers and a frozen ref,
saved as global_step_N/<role>/; a kill during the second role's save leaves the step uncommitted and resume
restores both roles from the previous step. Two real gloo processes, FSDP2-sharded models."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
from datetime import timedelta
from pathlib import Path

import torch

from conftest import flat_state
from trainguard.checkpoint.discovery import list_checkpoints, read_latest
from trainguard.checkpoint.manifest import read_manifest, verify_checkpoint

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _worker(rank: int, port: int, run_dir: str, phase: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainguard.checkpoint.roles import Role, RoleCheckpointManager

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        roles = {}
        for name, seed in (("actor", 1), ("critic", 2), ("ref", 3)):
            model = fully_shard(_model(seed))
            optimizer = None if name == "ref" else torch.optim.AdamW(model.parameters(), lr=0.01)
            roles[name] = Role(model, optimizer)

        def kill_in_second_role(role: str, step: int) -> None:
            if phase == "kill" and step == 2 and role == "actor":  # the critic's save is next: die now
                os.kill(os.getpid(), signal.SIGKILL)

        manager = RoleCheckpointManager(run_dir, roles, after_role_written=kill_in_second_role)
        step = manager.resume()

        def snapshot(tag: str) -> None:
            state = {f"{name}.{key}": value.full_tensor() for name, role in roles.items()
                     for key, value in role.model.state_dict().items()}
            if rank == 0:
                torch.save(state, Path(run_dir) / f"{tag}.pt")

        snapshot(f"{phase}_start")
        torch.manual_seed(100 + rank + step)
        while step < 2:
            step += 1
            for name in ("actor", "critic"):
                role = roles[name]
                role.optimizer.zero_grad()
                role.model(torch.randn(4, 8)).pow(2).mean().backward()
                role.optimizer.step()
            if step == 1:
                snapshot("after_step_1")
            manager.save(step)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(run_dir: Path, phase: str) -> list[int]:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    workers = [ctx.Process(target=_worker, args=(rank, port, str(run_dir), phase)) for rank in range(WORLD)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
    return [worker.exitcode for worker in workers]


def test_kill_during_second_role_leaves_step_uncommitted_and_resume_restores_both(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    assert _run(run, "kill") == [-signal.SIGKILL] * WORLD

    # step 1 committed with both roles; step 2 only in a .tmp- directory whose actor was complete
    assert read_latest(root) == 1
    infos = {info.name: info for info in list_checkpoints(root)}
    assert infos["global_step_1"].committed
    (pending,) = [info for info in infos.values() if info.step == 2]
    assert not pending.committed and pending.being_written
    assert (pending.path / "actor" / "trainguard.json").is_file()
    assert not (pending.path / "trainguard.json").exists()

    step1 = root / "global_step_1"
    assert verify_checkpoint(step1) == []
    assert read_manifest(step1).extra["roles"] == ["actor", "critic"]
    for role in ("actor", "critic"):  # each role is a checkpoint of its own, with its optimizer
        assert verify_checkpoint(step1 / role) == []
        keys = flat_state(step1 / role)
        assert any(k.startswith("optim.state.") for k in keys) and any(k.startswith("model.") for k in keys)
    assert not (step1 / "ref").exists() and verify_checkpoint(root / "ref") == []
    ref_files = {p.name: p.stat().st_ino for p in (root / "ref").iterdir()}

    # resume: both roles (and ref) exactly as after step 1; then the step-2 save commits
    assert _run(run, "resume") == [0] * WORLD
    expected = torch.load(run / "after_step_1.pt", weights_only=True)
    restored = torch.load(run / "resume_start.pt", weights_only=True)
    assert expected.keys() == restored.keys()
    assert all(torch.equal(expected[k], restored[k]) for k in expected)
    assert read_latest(root) == 2 and verify_checkpoint(root / "global_step_2") == []
    assert not any(".tmp-" in p.name for p in root.iterdir())  # the abandoned step was cleaned up
    assert {p.name: p.stat().st_ino for p in (root / "ref").iterdir()} == ref_files  # ref never re-saved
