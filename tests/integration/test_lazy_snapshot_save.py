"""An async save copies the state while the next forward and backward run (a lazy snapshot): what it
commits is the state at ``save()``, bitwise what a synchronous save of that state writes, however the
tensors change once ``wait_for_staging()`` returned or the optimizer stepped. On CPU with two gloo
ranks; on CUDA (one rank per GPU, NCCL) with pinned staging buffers and the copy on a side stream."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch

from helpers.forked_ranks import run_forked_ranks

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Counting(torch.nn.Module):
    """A layer with a buffer that every forward pass changes (like running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.register_buffer("calls", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def _worker(rank: int, world: int, device_type: str, store: str, root: str, results: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from trainguard.checkpoint.durable import read_full_state_dict
        from trainguard.checkpoint.manager import CheckpointManager
        from trainguard.checkpoint.manifest import verify_checkpoint

        torch.set_num_threads(1)
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        torch.manual_seed(0)
        model = torch.nn.Sequential(_Counting(), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
        mesh = init_device_mesh(device_type, (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        lazy = CheckpointManager(Path(root) / "lazy", model, optimizer, async_save=True, keep_last=5)
        sync = CheckpointManager(Path(root) / "sync", model, optimizer, async_save=False, keep_last=5)

        def forward_backward() -> None:
            model(torch.randn(16, 64, device=device)).square().mean().backward()

        def state_now() -> dict[str, torch.Tensor]:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            flat = {f"model.{k}": v for k, v in model_sd.items()}
            flat.update({f"optim.state.{k}.{name}": v for k, s in optim_sd["state"].items() for name, v in s.items()})
            return {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu().clone() for k, v in flat.items()}

        def corrupt() -> None:
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1000.0)
                for state in optimizer.state.values():
                    state["exp_avg"].mul_(-7.0)

        forward_backward()
        optimizer.step()
        optimizer.zero_grad()
        saved_states = {}
        for step in (1, 2):
            saved_states[step] = state_now()
            lazy.save_durable(step)
            forward_backward()  # the next step's forward (changes the buffer) and backward run during the copy
            if step == 1:
                lazy.wait_for_staging()  # explicitly, then the tensors change
                corrupt()
                sync.save_durable(step)  # the state as changed: must not leak into the lazy checkpoint
            else:
                optimizer.step()  # waits for the copy by itself (a step pre-hook)
                corrupt()
            optimizer.zero_grad()
            lazy.close()
            optimizer.param_groups[0]["lr"] = 0.05  # a scheduler's step: the next save records it
        assert lazy.durable.capture.hits == 1  # the second save reused the first one's plan
        sync.close()
        ckpt = Path(root) / "lazy" / "checkpoints"
        for step, expected in saved_states.items():
            saved = read_full_state_dict(ckpt / f"global_step_{step}")
            for key, value in expected.items():
                assert torch.equal(saved[key], value), f"step {step}: {key} is not the state at save()"
            if rank == 0:
                assert verify_checkpoint(ckpt / f"global_step_{step}") == []
        # bitwise what a synchronous save writes: the live state rolled back to step 2's, saved again
        with torch.no_grad():
            model_sd, optim_sd = get_state_dict(model, optimizer)
            for key, tensor in model_sd.items():
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                target = saved_states[2][f"model.{key}"].to(local.device)
                if isinstance(tensor, DTensor):
                    target = torch.distributed.tensor.distribute_tensor(target, tensor.device_mesh,
                                                                        tensor.placements).to_local()
                local.copy_(target)
            for key, state in optim_sd["state"].items():
                for name, tensor in state.items():
                    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                    target = saved_states[2][f"optim.state.{key}.{name}"].to(local.device)
                    if isinstance(tensor, DTensor):
                        target = torch.distributed.tensor.distribute_tensor(target, tensor.device_mesh,
                                                                            tensor.placements).to_local()
                    local.copy_(target)
        sync.save_durable(2)
        sync.close()
        Path(results, f"ok{rank}").write_text("ok")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(results, f"error{rank}").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_lazy_async_save_commits_the_state_at_save_bitwise_as_a_sync_save(tmp_path, device_type):
    # CUDA: a process of its own (no CUDA state inherited through fork), one rank per GPU
    world = 2 if device_type == "cpu" else min(2, torch.cuda.device_count())
    results = tmp_path / "results"
    results.mkdir()
    run_forked_ranks(_worker, world, (world, device_type, str(tmp_path / "store"), str(tmp_path), str(results)),
                     results, timeout=240, start_method="fork" if device_type == "cpu" else "spawn")
    lazy = tmp_path / "lazy" / "checkpoints" / "global_step_2"
    sync = tmp_path / "sync" / "checkpoints" / "global_step_2"
    names = sorted(p.name for p in lazy.iterdir() if p.name.endswith(".distcp") or p.name.startswith("extra_state"))
    assert names == [f"__{r}_0.distcp" for r in range(world)] + [
        f"extra_state_world_size_{world}_rank_{r}.pt" for r in range(world)]
    for name in names:
        if name.endswith(".distcp"):
            assert (lazy / name).read_bytes() == (sync / name).read_bytes(), name
