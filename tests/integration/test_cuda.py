"""On a GPU (skipped where CUDA is not available): the reference trainer over NCCL stops and resumes
bitwise; the doctor's burn-in runs on the device and catches a planted miscompute; the CUDA generators
go into and come back from a checkpoint's RNG state; CUDA sources are staged into page-locked host
memory, in staging buffers, in a writer process's shared arena and in the memory tier's files themselves.

The trainer test comes first: it starts its ranks in new processes before this process touches CUDA
itself (a process forked after CUDA is initialised cannot use it)."""

from __future__ import annotations

import pytest
import torch

from helpers.runs import assert_same_tensors, events, ok, step_losses, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_trainer_on_cuda_stops_and_resumes_bitwise(tmp_path):
    nproc = min(2, torch.cuda.device_count())  # NCCL: one rank per GPU
    straight, split = tmp_path / "straight", tmp_path / "split"
    ok(train(straight, nproc, 8, "--save-interval", "4"))
    ok(train(split, nproc, 8, "--save-interval", "4", "--set", "train.exit_at_step=4"))
    assert [e["step"] for e in events(split, "run_finished")] == [4]
    resumed = ok(train(split, nproc, 8, "--save-interval", "4", "--resume", "auto"))
    assert "global_step_4" in resumed.stdout
    assert assert_same_tensors(straight / "checkpoints/global_step_8", split / "checkpoints/global_step_8") > 20
    straight_losses = step_losses(straight)
    assert sorted(straight_losses) == list(range(1, 9))
    assert step_losses(split) == straight_losses  # float equality: bitwise


def test_more_ranks_than_gpus_is_one_clear_line(tmp_path):
    result = train(tmp_path / "run", torch.cuda.device_count() + 1, 2)
    assert result.returncode == 2
    assert "has no GPU of its own" in result.stderr


def test_burn_in_on_the_gpu_is_repeatable_and_catches_a_planted_miscompute():
    from trainguard.doctor.burnin import burn_in
    from trainguard.faults.spec import parse_faults

    device = torch.device("cuda", 0)
    clean = burn_in(device, reps=6, size=1024)
    assert clean.ok, clean.detail
    assert clean.metrics["differing_reps"] == [] and clean.metrics["max_error_over_bound"] < 1.0
    flipped = burn_in(device, reps=6, size=1024, faults=parse_faults("miscompute:rep=3"))
    assert not flipped.ok and flipped.detail == "rep 3 of 6 differs from rep 0 (checksum mismatch)"


def test_cuda_generators_are_captured_and_restored():
    from trainguard.checkpoint.rng_state import capture_rng_state, restore_rng_state

    torch.cuda.manual_seed_all(123)
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    first = torch.rand(1000, device="cuda")
    restore_rng_state(state)
    assert torch.equal(torch.rand(1000, device="cuda"), first)


def test_cuda_sources_are_staged_into_page_locked_buffers():
    from trainguard.checkpoint.shared_buffers import allocate_shared
    from trainguard.checkpoint.staging import ReusableStager

    source = {"weight": torch.randn(256, 256, device="cuda"), "step": 7}
    stager = ReusableStager()
    staged = stager.stage(source)
    assert staged["weight"].device.type == "cpu" and staged["weight"].is_pinned()
    assert torch.equal(staged["weight"], source["weight"].cpu()) and staged["step"] == 7

    _arena, (buffer,) = allocate_shared([source["weight"]])
    assert buffer.is_pinned()  # registered with cudaHostRegister: the copy below is a real async DMA
    buffer.copy_(source["weight"], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer, source["weight"].cpu())


def test_a_state_on_cuda_is_copied_by_the_side_stream_into_the_page_locked_files_it_is_committed_as():
    """The memory tier's in-place staging with CUDA sources (the spare files in /dev/shm): the mappings
    are page-locked, the side stream's copies land in them, a tensor changed after ``wait()`` (as the
    next optimizer step does) leaves the step's bytes alone, and each committed file is what
    ``save_tensor`` writes of the state at the save, byte for byte; one plan for every step."""
    import io
    import shutil
    import tempfile
    from pathlib import Path

    from trainguard.checkpoint.hashing_file import save_tensor
    from trainguard.checkpoint.local.in_place import InPlaceStaging, placeholders
    from trainguard.checkpoint.local.paths import SPARE_DIR, rank_file_names
    from trainguard.checkpoint.local.writer import prune, save_rank_step
    from trainguard.checkpoint.snapshot import CopySplit, LazySnapshot
    from trainguard.checkpoint.staging import ReusableStager

    directory = Path(tempfile.mkdtemp(prefix="trainguard-cuda-in-place-", dir="/dev/shm"))
    try:
        names = rank_file_names(1, 0)
        staging = InPlaceStaging(directory / SPARE_DIR, {kind: names[kind] for kind in ("model", "optim")},
                                 {kind: (lambda state: state) for kind in ("model", "optim")})
        stager = ReusableStager(placeholders)
        weight = torch.randn(1_000_000, device="cuda")
        exp_avg = torch.randn(1_000_000, device="cuda")
        for step in range(1, 6):
            state = {"model": {"w": weight, "b": torch.full((7,), float(step), device="cuda")},
                     "optim": {"state.w.exp_avg": exp_avg, "param_groups.w.lr": 0.1 * step}}
            expected = {}
            for kind in ("model", "optim"):
                stream = io.BytesIO()
                save_tensor({key: value.cpu() if isinstance(value, torch.Tensor) else value
                             for key, value in state[kind].items()}, stream)
                expected[kind] = stream.getvalue()
            plan = stager.plan(state)
            split, files = staging.stage(plan, CopySplit.of(plan.copies, lazy={weight.data_ptr(), exp_avg.data_ptr()}))
            assert len(split.later_cuda) == 2 and all(view.is_pinned() for view, _ in split.later_cuda)
            snapshot = LazySnapshot(split)
            snapshot.wait()
            weight.add_(1.0)  # the next optimizer step, on the training stream after the side stream's copies
            exp_avg.mul_(0.5)
            snapshot.copied()
            save_rank_step(directory, step, rank=0, world_size=1, model_state=files["model"],
                           optim_state=files["optim"], extra_state=b"extra", replica_extras={},
                           fsdp_config={"world_size": 1}, recycle=True)
            prune(directory, 1, 0, keep_last=2, recycle=True)
            for kind in ("model", "optim"):
                assert (directory / f"global_step_{step}" / names[kind]).read_bytes() == expected[kind], (step, kind)
        assert staging.plans == 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)
