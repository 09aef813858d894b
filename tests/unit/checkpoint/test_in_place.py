"""The memory tier's state files staged in place: the state is copied straight into the spare file it
is committed as; the committed files are those ``save_tensor`` writes, byte for byte; a layout that
moved is written anew and planned again; and a process killed at any instant of a save leaves every
committed step whole, with the bytes of that one step only."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from trainguard.checkpoint.hashing_file import HashingFile, save_tensor
from trainguard.checkpoint.checksum import checksum_matches
from trainguard.checkpoint.local.in_place import InPlaceStaging, commit_staged, placeholders
from trainguard.checkpoint.local.paths import SPARE_DIR, rank_file_names
from trainguard.checkpoint.local.reader import rank_holdings
from trainguard.checkpoint.manifest import FileEntry
from trainguard.checkpoint.local.writer import prune, rank_steps, remove_if_abandoned, save_rank_step
from trainguard.checkpoint.safe_load import safe_torch_load
from trainguard.checkpoint.snapshot import CopySplit
from trainguard.checkpoint.staging import ReusableStager

WORLD, RANK = 2, 1
KINDS = ("model", "optim")


def _state(step: int, size: int = 200_000, lr: float | None = None) -> dict[str, dict]:
    """Every tensor filled with ``step``; the learning rate is ``step`` too (a plain value in the pickle)
    unless given."""
    return {"model": {"w": torch.full((size,), float(step)), "norm": torch.full((7,), float(step)),
                      "empty": torch.empty(0)},
            "optim": {"state.w.exp_avg": torch.full((size,), float(step)), "state.w.step": torch.tensor(float(step)),
                      "param_groups.w.lr": float(step) if lr is None else lr}}


class Rank:
    """One rank's memory-tier saves, as ``MemoryTier`` makes them, in the calling thread."""

    def __init__(self, directory: Path):
        self.dir = directory
        names = rank_file_names(WORLD, RANK)
        self.stager = ReusableStager(placeholders)
        self.staging = InPlaceStaging(directory / SPARE_DIR, {kind: names[kind] for kind in KINDS},
                                      {kind: (lambda state: state) for kind in KINDS})

    def stage(self, state: dict[str, dict]) -> tuple[list, dict]:
        """The copies into the staged files (made by the caller, all of them listed as made "now") and
        the files."""
        plan = self.stager.plan(state)
        split, files = self.staging.stage(plan, CopySplit.of(plan.copies, lazy=set()))
        assert not split.later_cpu and not split.later_cuda
        return split.now, files

    def save(self, step: int, state: dict[str, dict], copy_only: int | None = None):
        copies, files = self.stage(state)
        for buffer, source in copies[:copy_only]:
            buffer.copy_(source)
        if copy_only is not None:
            return None
        saved = save_rank_step(self.dir, step, rank=RANK, world_size=WORLD, model_state=files["model"],
                               optim_state=files["optim"], extra_state=f"extra {step}".encode(), replica_extras={},
                               fsdp_config={"world_size": WORLD}, recycle=True)
        if saved.layout_moved:
            self.staging.replan()
        prune(self.dir, WORLD, RANK, keep_last=2, recycle=True)
        return saved


def _serialised(obj, path: Path) -> bytes:
    stream = HashingFile(path)
    save_tensor(obj, stream)
    stream.close_durably()
    return path.read_bytes()


def _assert_whole(directory: Path, step: int) -> None:
    """The step verifies against its rank manifest and holds the bytes of ``step`` only."""
    held = rank_holdings(directory, WORLD, RANK, [step])[step]  # every file hashed against the manifest
    assert set(held.own) == {"model", "optim", "extra"}, held
    step_dir = directory / f"global_step_{step}"
    names = rank_file_names(WORLD, RANK)
    model, optim = safe_torch_load(step_dir / names["model"]), safe_torch_load(step_dir / names["optim"])
    for tensor in (model["w"], model["norm"], optim["state.w.exp_avg"], optim["state.w.step"]):
        assert torch.all(tensor == float(step)), f"step {step} holds bytes of another step"
    assert optim["param_groups.w.lr"] in (float(step), CONSTANT_LR)


CONSTANT_LR = 0.5


@pytest.mark.parametrize("lr", [None, CONSTANT_LR], ids=["lr changing", "lr constant"])
def test_a_step_is_copied_into_the_spare_it_is_committed_as_and_is_what_save_tensor_writes(tmp_path: Path,
                                                                                          lr: float | None) -> None:
    """With the plain values unchanged, the writer reuses what it wrote around the records last time
    (the small tensors' records included, in place): the files are still the serialiser's, byte for byte."""
    rank = Rank(tmp_path / "memory")
    names = rank_file_names(WORLD, RANK)
    for step in range(1, 6):
        spares = {kind: tmp_path / "memory" / SPARE_DIR / names[kind] for kind in KINDS}
        inodes = {kind: path.stat().st_ino for kind, path in spares.items() if path.exists()}
        state = _state(step, lr=lr)
        assert not rank.save(step, state).layout_moved
        step_dir = tmp_path / "memory" / f"global_step_{step}"
        for kind in KINDS:
            written = step_dir / names[kind]
            assert written.read_bytes() == _serialised(state[kind], tmp_path / f"expected-{step}-{kind}")
            if kind in inodes:  # from the third step on: the pruned step's file, written over where it is
                assert written.stat().st_ino == inodes[kind]
        assert rank_steps(tmp_path / "memory", WORLD, RANK) == list(range(max(1, step - 1), step + 1))
        _assert_whole(tmp_path / "memory", step)
    assert rank.staging.plans == 1


def test_a_moved_layout_is_written_anew_from_the_same_bytes_and_planned_again(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "memory")
    names = rank_file_names(WORLD, RANK)
    for step in (1, 2, 3):
        rank.save(step, _state(step))
    state = _state(4)
    state["optim"]["param_groups.w.name"] = "a plain value whose pickle moves every record after it" * 100
    saved = rank.save(4, state)
    assert saved.layout_moved
    written = tmp_path / "memory" / "global_step_4" / names["optim"]
    assert written.read_bytes() == _serialised(state["optim"], tmp_path / "expected-optim")
    _assert_whole(tmp_path / "memory", 4)
    state = _state(5)
    state["optim"]["param_groups.w.name"] = "a plain value whose pickle moves every record after it" * 100
    assert not rank.save(5, state).layout_moved  # planned again: in place
    assert rank.staging.plans == 2
    _assert_whole(tmp_path / "memory", 5)


def test_a_copy_cut_short_leaves_the_committed_steps_whole(tmp_path: Path) -> None:
    """The lazy copy writes into the spare, never into a committed step: a save that dies halfway
    through its copy (a crash) leaves the steps before it as they were, and the next save commits."""
    rank = Rank(tmp_path / "memory")
    for step in (1, 2, 3):
        rank.save(step, _state(step))
    rank.save(4, _state(4), copy_only=2)
    assert rank_steps(tmp_path / "memory", WORLD, RANK) == [2, 3]
    for step in (2, 3):
        _assert_whole(tmp_path / "memory", step)
    rank.save(4, _state(4))
    _assert_whole(tmp_path / "memory", 4)


def _saving_forever(directory: str) -> None:
    rank = Rank(Path(directory))
    step = 0
    while True:
        step += 1
        rank.save(step, _state(step, size=1_000_000))


def _killed_mid_save(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    directory = tmp_path / f"trial{seed}"
    process = multiprocessing.get_context("fork").Process(target=_saving_forever, args=(str(directory),))
    process.start()
    deadline = time.monotonic() + 60
    while len(rank_steps(directory, WORLD, RANK)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.5))
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    steps = rank_steps(directory, WORLD, RANK)
    assert steps, "nothing committed before the kill"
    for step in steps:
        _assert_whole(directory, step)
    Rank(directory).save(steps[-1] + 1, _state(steps[-1] + 1))  # the spare left behind is written over
    _assert_whole(directory, steps[-1] + 1)


@pytest.mark.parametrize("seed", range(3))
def test_a_process_killed_at_any_instant_of_its_saves_leaves_every_committed_step_whole(tmp_path: Path,
                                                                                        seed: int) -> None:
    _killed_mid_save(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 130))
def test_a_process_killed_at_any_instant_of_its_saves_leaves_every_committed_step_whole_many(tmp_path: Path,
                                                                                             seed: int) -> None:
    _killed_mid_save(tmp_path, seed)


def test_a_tier_staged_again_in_one_process_commits_its_own_state(tmp_path: Path) -> None:
    """Two stagings of one directory in a process (a memory tier built again) share the mappings of
    its files: the second plans its own layout (here the records swapped places in a spare of the same
    size) and commits its own bytes."""

    def state(step: int, order: tuple[str, str]) -> dict[str, dict]:
        values = {"plus": torch.full((100_000,), float(step)), "minus": torch.full((100_000,), -float(step))}
        return {"model": {key: values[key] for key in order}, "optim": {"lr": float(step)}}

    first = Rank(tmp_path / "memory")
    for step in (1, 2, 3):
        first.save(step, state(step, ("plus", "minus")))
    second = Rank(tmp_path / "memory")
    assert not second.save(4, state(4, ("minus", "plus"))).layout_moved  # same size: the records swapped places
    loaded = safe_torch_load(tmp_path / "memory" / "global_step_4" / rank_file_names(WORLD, RANK)["model"])
    assert torch.all(loaded["plus"] == 4.0) and torch.all(loaded["minus"] == -4.0)


def test_a_node_mates_cleanup_during_the_commit_finds_the_step_directory_in_use(tmp_path: Path) -> None:
    """Ranks of a node share the directory, and a rank starting up removes the step directories that
    hold no rank's files (``clean_rank_leftovers``): the staged file is moved into the step under a
    temporary name before it is completed, so the directory is not empty meanwhile."""
    rank = Rank(tmp_path / "memory")
    step_dir = tmp_path / "memory" / "global_step_1"
    state = _state(1)
    copies, files = rank.stage(state)
    for buffer, source in copies:
        buffer.copy_(source)

    def cleaned_up_meanwhile(staged: dict) -> dict:
        remove_if_abandoned(step_dir)  # what another rank's start does while this rank writes the step
        return staged

    def write_new(path: Path, staged: dict) -> FileEntry:
        raise AssertionError("the layout did not move: nothing is written anew")

    step_dir.mkdir(parents=True)
    target = step_dir / rank_file_names(WORLD, RANK)["model"]
    entry, in_place = commit_staged(files["model"], target, cleaned_up_meanwhile, write_new)
    assert in_place and entry.checksum.startswith("xxh3_64_pieces:") and checksum_matches(target, entry.checksum)
    assert target.read_bytes() == _serialised(state["model"], tmp_path / "expected")


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_placeholders_are_not_filled_under_deterministic_algorithms():
    """The trainer turns deterministic algorithms on, which fills new tensors with NaN: placeholders
    would then be a second copy of the state, written for nothing. 256 MiB (above glibc's largest mmap
    threshold, so pages fresh from the kernel, whatever the heap holds) stay out of memory until read:
    filled, they would all be resident."""
    source = torch.empty(64 << 20, device="meta")  # its shape and dtype only
    torch.use_deterministic_algorithms(True)
    try:
        before = _resident_bytes()
        (buffer,) = placeholders([source])
        assert _resident_bytes() - before < (32 << 20)
        assert buffer.shape == source.shape and buffer.dtype == source.dtype
        assert torch.isnan(torch.empty(16)).all()  # the setting is untouched for everything else
    finally:
        torch.use_deterministic_algorithms(False)
