"""The memory tier: a checkpoint of every step in node memory (/dev/shm), replicated as the local tier
is; a run that loses its processes and a node's memory redoes at most one step and ends bitwise equal
to a run without the failure."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import traceback
import uuid
from pathlib import Path

import pytest
import torch

from helpers.runs import assert_same_tensors, events, ok, step_losses, train
from trainguard.checkpoint.memory_tier import run_key
from trainguard.events.log import read_events

WORLD = 2
STEPS = 6
CRASH_DURING = 5  # the processes die in the middle of this step


def _setup(rank: int, store: str, run_dir: str, memory_dir: str, writer: str = "process"):
    """A rank's model, optimizer and ``CheckpointManager`` with the memory tier every step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.events import EventLog
    from trainguard.step.local_tier import build_memory_tier

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    # HSDP over two "nodes" (one rank each): the ranks are replicas, so either can restore the other
    names = ("dp_replicate", "dp_shard")
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=names))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = CheckpointConfig(save_interval=0, memory_interval=1, memory_dir=memory_dir, writer=writer)
    events = EventLog(Path(run_dir) / "events.jsonl", rank=rank, host="h")
    memory = build_memory_tier(Path(run_dir), config, mesh_shape=(WORLD, 1), mesh_dim_names=names,
                               ranks_per_node=1, model=model, events=events)
    return model, optimizer, CheckpointManager(run_dir, model, optimizer, config=config, events=events, memory=memory)


def _worker(rank: int, phase: str, store: str, run_dir: str, memory_dir: str, results: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    model, optimizer, manager = _setup(rank, store, run_dir, memory_dir)
    memory = manager.memory
    torch.manual_seed(100 + rank)  # each rank's data stream: restored from the extra state on resume
    step = manager.resume()
    Path(results, f"resumed{rank}_{phase}").write_text(str(step))
    while step < STEPS:
        step += 1
        model(torch.randn(16, 64)).square().mean().backward()
        if phase == "crash" and step == CRASH_DURING:
            os._exit(9)  # dies between backward and optimizer step: the memory save of step 4 may be in flight
        optimizer.step()
        optimizer.zero_grad()
        # what a committed step recovers, not the skip rule: the loop lets the previous write end
        # first (a save that finds it running is skipped, see test_a_save_finding_a_write_in_flight...)
        manager.memory.wait()
        manager.save(step)
    manager.close()
    Path(results, f"plans{rank}_{phase}").write_text(str(memory.in_place.plans))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    flat.update({f"optim.{k}.{n}": v for k, s in optim_sd["state"].items() for n, v in s.items()})
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}
    torch.save(full, Path(results, f"state{rank}_{phase}.pt"))


def _rank_main(target, rank: int, phase: str, *args: str) -> None:
    """``target(rank, phase, *args)`` in a rank's process, then the group's end; an error goes to
    ``results/error{rank}_{phase}`` (``args[-1]`` is ``results``)."""
    try:
        import torch.distributed as dist

        target(rank, phase, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(args[-1], f"error{rank}_{phase}").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _run(phase: str, tmp_path: Path, run_dir: Path, memory_dir: str, results: Path, target=_worker) -> None:
    """Runs ``target`` on every rank, ``(rank, phase, store, run_dir, memory_dir,
    results)``; fails with the ranks' errors."""
    context = multiprocessing.get_context("fork")
    store = tmp_path / f"store-{phase}-{uuid.uuid4().hex[:6]}"
    procs = [context.Process(target=_rank_main,
                             args=(target, rank, phase, str(store), str(run_dir), memory_dir, str(results)))
             for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
        if proc.is_alive():
            proc.kill()
            proc.join()
    errors = [p.read_text() for p in sorted(results.glob(f"error*_{phase}"))]
    assert not errors, "\n".join(errors)


@pytest.fixture
def shm_root():
    root = Path("/dev/shm") / f"trainguard-test-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_memory_tier_recovers_a_lost_node_with_at_most_one_step_redone_bitwise(tmp_path, shm_root):
    results = tmp_path / "results"
    results.mkdir()
    memory_dir = str(shm_root / "{run}" / "node{node}")
    _run("clean", tmp_path, tmp_path / "clean", memory_dir, results)
    for rank in range(WORLD):  # every step copied into the file it is committed as (planned once; the
        # first step's plan, from get_state_dict, may differ from the kept plan's plain values once)
        plans = int((results / f"plans{rank}_clean").read_text())
        assert plans <= 2, f"rank {rank}: the in-place layout was planned {plans} times in {STEPS} steps"

    run_dir = tmp_path / "faulty"
    _run("crash", tmp_path, run_dir, memory_dir, results)
    node_dirs = sorted((shm_root / run_key(run_dir)).glob("node*"))
    assert [d.name for d in node_dirs] == ["node0", "node1"]
    # owner-only in /dev/shm, which every user of the node can list (issue 40)
    assert [stat.S_IMODE(d.stat().st_mode) for d in node_dirs] == [0o700, 0o700]
    shutil.rmtree(node_dirs[1])  # node 1 lost: its memory with it

    _run("resume", tmp_path, run_dir, memory_dir, results)
    resumed = {int((results / f"resumed{r}_resume").read_text()) for r in range(WORLD)}
    assert len(resumed) == 1
    (step,) = resumed
    assert CRASH_DURING - 1 - step <= 1, f"resumed at step {step}: more than one completed step redone"
    events = list(read_events(run_dir / "events.jsonl"))
    started = [e for e in events if e["kind"] == "run_started"]
    assert started[-1]["tier"] == "memory" and started[-1]["step"] == step
    assert any(e["kind"] == "local_recovered" and e["rank"] == 1 and e["tier"] == "memory" for e in events)
    for rank in range(WORLD):
        clean = torch.load(results / f"state{rank}_clean.pt", weights_only=True)
        after = torch.load(results / f"state{rank}_resume.pt", weights_only=True)
        assert clean.keys() == after.keys()
        for key in clean:
            assert torch.equal(clean[key], after[key]), f"rank {rank}: {key} differs from the run without the failure"


def test_trainer_with_memory_interval_resumes_from_memory_after_a_kill(tmp_path, shm_root):
    """The reference trainer with ``checkpoint.memory_interval=1``: rank 1 killed as it starts step 7,
    the restart resumes from the memory tier (step 6, or 5 when step 6's write was still in flight, or
    older by the saves skipped) and ends bitwise equal to a run without the kill."""
    memory = ["--save-interval", "10", "--set", "checkpoint.memory_interval=1",
              "--set", f"checkpoint.memory_dir={shm_root}/{{run}}/node{{node}}"]
    ok(train(tmp_path / "straight", 2, 10, "--save-interval", "10"))
    crashed = tmp_path / "crashed"
    assert train(crashed, 2, 10, *memory, faults="kill:rank=1,step=7").returncode != 0
    ok(train(crashed, 2, 10, *memory, faults="kill:rank=1,step=7"))  # fires once per run directory
    started = events(crashed, "run_started")[-1]
    # the newest step both ranks committed before the kill (a save that found the previous write
    # running was skipped: a loaded machine may skip one); +1: committed on both, the killed rank's
    # event not written yet
    before_kill = [e for e in events(crashed, "local_saved") if e["tier"] == "memory" and e["time"] < started["time"]]
    newest = max(set.intersection(*({e["step"] for e in before_kill if e["rank"] == r} for r in (0, 1))))
    assert started["tier"] == "memory" and started["step"] in (newest, newest + 1) and started["step"] <= 6
    assert assert_same_tensors(tmp_path / "straight/checkpoints/global_step_10",
                               crashed / "checkpoints/global_step_10") > 20
    assert step_losses(crashed) == step_losses(tmp_path / "straight")


class _HeldWriter:
    """``checkpoint.writer: thread``'s writer, held at each write until ``release`` is set: a write
    still running at the next save, for as long as the test wants."""

    def __init__(self, release):
        self.release = release

    def start(self) -> None:
        """Nothing to start: it writes in the calling thread."""

    def received(self, value):
        return value

    def run(self, function, *args, **kwargs):
        self.release.wait()
        return function(*args, **kwargs)


def _skip_worker(rank: int, phase: str, store: str, run_dir: str, memory_dir: str, results: str) -> None:
    import threading


    model, optimizer, manager = _setup(rank, store, run_dir, memory_dir, writer="thread")
    memory = manager.memory
    release = threading.Event()
    if rank == 1:
        memory.files = _HeldWriter(release)  # rank 1's write of step 1 runs on until step 2's save is over
    else:
        release.set()
    saved = []
    for step in (1, 2, 3):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        saved.append(manager.save_memory(step))
        if step == 2:
            release.set()
            memory.wait()
    manager.close()
    Path(results, f"skip{rank}").write_text(f"{saved} {memory.skipped}")


def test_a_save_finding_a_write_in_flight_on_any_rank_is_skipped_on_every_rank_and_counted(tmp_path, shm_root):
    """Rank 1's write of step 1 is held past step 2's save: neither rank waits for it (the loop would
    hang); both skip step 2 (the ring hand-over of the extra state pairs the ranks' saves) and save step
    3, whose ``local_saved`` event counts the one skipped."""
    results = tmp_path / "results"
    results.mkdir()
    run_dir = tmp_path / "run"
    _run("skip", tmp_path, run_dir, str(shm_root / "node{node}"), results, target=_skip_worker)
    assert [(results / f"skip{rank}").read_text() for rank in range(WORLD)] == ["[True, False, True] 1"] * WORLD
    saved = [(e["rank"], e["step"], e["skipped"]) for e in events(run_dir, "local_saved") if e["tier"] == "memory"]
    assert sorted(saved) == [(0, 1, 0), (0, 3, 1), (1, 1, 0), (1, 3, 1)]
