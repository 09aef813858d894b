"""Multi-role checkpoints (checkpoint/roles.py): actor and critic with their own optimizers and a frozen ref,
saved as global_step_N/<role>/; a kill during the second role's save leaves the step uncommitted and resume
restores both roles from the previous step. Two real gloo processes, FSDP2-sharded models."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from helpers.ports import free_port
from helpers.runs import events, flat_state
from trainguard.checkpoint.discovery import list_checkpoints, read_latest
from trainguard.checkpoint.manifest import read_manifest, verify_checkpoint

WORLD = 2


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
    port = free_port()
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


# ------------------------------------------------ the CLI, merge and retention on a multi-role run
HF_STEPS = 4


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def _hf_worker(rank: int, port: int, run_dir: str) -> None:
    """An HF actor (with its huggingface/ written into its folder), a critic and a frozen ref; 4 steps,
    keep_last=2; rank 0 saves the actor's final weights as actor_final.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from trainguard.checkpoint.roles import Role, RoleCheckpointManager

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        config = _tiny_llama_config()
        torch.manual_seed(0)
        actor = fully_shard(LlamaForCausalLM(config))
        critic, ref = fully_shard(_model(2)), fully_shard(_model(3))
        roles = {
            "actor": Role(actor, torch.optim.AdamW(actor.parameters(), lr=0.01),
                          static_files=lambda directory: config.save_pretrained(directory / "huggingface")),
            "critic": Role(critic, torch.optim.AdamW(critic.parameters(), lr=0.01)),
            "ref": Role(ref),
        }
        manager = RoleCheckpointManager(run_dir, roles, keep_last=2)
        torch.manual_seed(10 + rank)
        for step in range(manager.resume() + 1, HF_STEPS + 1):
            for role, loss in ((roles["actor"], lambda: actor(torch.randint(0, 64, (2, 8))).logits.pow(2).mean()),
                               (roles["critic"], lambda: critic(torch.randn(4, 8)).pow(2).mean())):
                role.optimizer.zero_grad()
                loss().backward()
                role.optimizer.step()
            manager.save(step)
        weights = {key: value.full_tensor() for key, value in actor.state_dict().items()}
        if rank == 0:
            torch.save(weights, Path(run_dir) / "actor_final.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("roles") / "run"
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    workers = [ctx.Process(target=_hf_worker, args=(rank, port, str(run))) for rank in range(WORLD)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
    assert [worker.exitcode for worker in workers] == [0] * WORLD
    return run


def test_retention_prunes_whole_steps_and_keeps_the_frozen_role(hf_run):
    root = hf_run / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["global_step_3", "global_step_4", "ref"]
    for step in (3, 4):
        step_dir = root / f"global_step_{step}"
        assert sorted(p.name for p in step_dir.iterdir() if p.is_dir()) == ["actor", "critic"]
        assert verify_checkpoint(step_dir) == []
    assert verify_checkpoint(root / "ref") == [] and read_manifest(root / "ref").extra["role"] == "ref"
    deleted = [e["step"] for e in events(hf_run, "checkpoint_deleted")]
    assert deleted == [1, 2]


def test_cli_list_and_verify_the_whole_step_and_one_role(hf_run, tmp_path, capsys):
    from trainguard.cli import main

    assert main(["ckpt", "verify", str(hf_run)]) == 0
    assert capsys.readouterr().out.splitlines() == ["OK global_step_3", "OK global_step_4", "OK ref"]
    actor = hf_run / "checkpoints" / "global_step_4" / "actor"
    assert main(["ckpt", "verify", str(actor)]) == 0
    assert capsys.readouterr().out.splitlines() == ["OK actor"]
    assert main(["ckpt", "list", "--json", str(hf_run)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert [(f["name"], f["roles"], f["role"], f["verified"]) for f in facts] == [
        ("global_step_3", ["actor", "critic"], None, True), ("global_step_4", ["actor", "critic"], None, True),
        ("ref", None, "ref", True)]
    assert main(["ckpt", "list", str(actor)]) == 0
    assert "actor (4)" in capsys.readouterr().out

    # one flipped byte in the actor's folder: the step and the role folder both fail, naming the file
    copy = tmp_path / "run"
    shutil.copytree(hf_run, copy)
    shard = sorted((copy / "checkpoints" / "global_step_4" / "actor").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(copy)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "OK global_step_3" and out[2] == "OK ref"
    assert out[1].startswith(f"BAD global_step_4/actor/{shard.name}: ")
    assert main(["ckpt", "verify", str(shard.parent)]) == 1
    assert capsys.readouterr().out.startswith(f"BAD actor/{shard.name}: ")
    assert main(["ckpt", "verify", str(shard.parent.parent / "critic")]) == 0


def test_merge_a_role_folder_gives_the_actors_weights(hf_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from trainguard.cli import main

    target = tmp_path / "hf"
    actor = hf_run / "checkpoints" / f"global_step_{HF_STEPS}" / "actor"
    assert main(["ckpt", "merge", "--backend", "dcp", "--local_dir", str(actor), "--target_dir", str(target)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(target).state_dict()
    expected = torch.load(hf_run / "actor_final.pt", weights_only=True)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[key], expected[key]) for key in expected)
